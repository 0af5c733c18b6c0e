"""A deterministic model of a CUDA device: streams, events, gates, kernels, the caching allocator.

One :class:`SimGPU` stands for the devices of every simulated rank in this
process. Each :class:`SimStream` is a FIFO of items; one *device thread* runs the
head item of every stream as soon as it is runnable (an event wait whose record
has run, a gate value reached, a kernel whose ``hold`` latch is open, an NCCL
launch whose peers are all at the head of their streams). Items run under the
GPU's lock, so a test can reason about order without timing.

"CUDA tensors" are :class:`SimTensor` s: CPU tensors that report ``is_cuda`` and
``device == cuda:0``. Inside ``with gpu.use_stream(s):`` an in-place torch op on a
SimTensor does not run: it is enqueued as a kernel on ``s`` (how the backend's
post-NCCL fix-ups run on its comm stream). Outside, ops run at once on the host.

The allocator check: a SimTensor's storage counts the SimTensor objects viewing
it; when the last one dies the block is "freed". If an item still pending on a
stream other than the allocation stream uses it, and that stream was not named
by ``record_stream``, the problem is recorded in :attr:`SimGPU.errors`.

One SimGPU is active at a time (the latest created; SimTensors report to it).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch

_tls = threading.local()
_current_gpu: SimGPU | None = None  # the GPU SimTensors belong to (one at a time)


def _plain(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.as_subclass(t, torch.Tensor)


def _key(t: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return int(t.untyped_storage().data_ptr())


class SimTensor(torch.Tensor):
    """A CPU tensor that the code under test sees as a CUDA tensor on ``cuda:0``."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)

    def record_stream(self, stream: Any) -> None:
        gpu = _current_gpu
        if not isinstance(stream, SimStream) or gpu is None:
            raise TypeError(f"record_stream needs a simulated stream, got {stream!r}")
        gpu._record_stream(_key(self), stream)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        gpu = _current_gpu
        stream = getattr(_tls, "stream", None)
        name = getattr(func, "__name__", "")
        if (gpu is not None and stream is not None and name.endswith("_") and not name.startswith("_")
                and name not in ("requires_grad_", "record_stream")):
            # An in-place op issued with a current stream: a kernel on that stream.
            gpu.kernel(stream, lambda: func(*args, **kwargs), uses=_tensors(args, kwargs))
            return args[0]
        ret = super().__torch_function__(func, types, args, kwargs)  # type: ignore[no-untyped-call]
        if gpu is not None:
            for t in _tensors((ret,), {}):
                gpu._track(t)
        return ret


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, SimTensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)

    walk(list(args) + list(kwargs.values()))
    return out


class SimEvent:
    """``torch.cuda.Event``'s host API: record / query / synchronize; streams wait on it."""

    def __init__(self, gpu: SimGPU) -> None:
        self._gpu = gpu
        self._recorded = 0  # records issued
        self._done = 0  # records the device reached
        self.device = torch.device("cuda", 0)

    def record(self, stream: Any = None) -> None:
        gpu = self._gpu
        stream = stream if stream is not None else gpu.current_stream()
        with gpu._cv:
            self._recorded += 1
            n = self._recorded
            gpu._push(stream, _Item("record", lambda: True, lambda: self._reach(n)))

    def _reach(self, n: int) -> None:
        self._done = max(self._done, n)

    def query(self) -> bool:
        with self._gpu._cv:
            return self._done >= self._recorded

    def synchronize(self) -> None:
        gpu = self._gpu
        with gpu._cv:
            target = self._recorded
            if not gpu._cv.wait_for(lambda: self._done >= target or gpu._closed, gpu.sync_limit):
                raise RuntimeError(f"SimEvent.synchronize: not reached within {gpu.sync_limit} s")


class SimStream:
    """A FIFO of device work, with torch.cuda.Stream's ``wait_event`` and ``cuda_stream``."""

    def __init__(self, gpu: SimGPU, name: str, handle: int) -> None:
        self._gpu = gpu
        self.name = name
        self.cuda_stream = handle
        self.q: collections.deque[_Item] = collections.deque()
        self.device = torch.device("cuda", 0)

    def __repr__(self) -> str:
        return f"<SimStream {self.name} #{self.cuda_stream} pending={len(self.q)}>"

    def wait_event(self, event: SimEvent) -> None:
        """CUDA semantics: waits for the event's *latest record at call time* (none: no-op)."""
        with self._gpu._cv:
            n = event._recorded
            self._gpu._push(self, _Item("wait_event", lambda: event._done >= n, lambda: None))

    def wait_stream(self, other: SimStream) -> None:
        ev = SimEvent(self._gpu)
        ev.record(other)
        self.wait_event(ev)

    def query(self) -> bool:
        with self._gpu._cv:
            return not self.q

    def synchronize(self) -> None:
        ev = SimEvent(self._gpu)
        ev.record(self)
        ev.synchronize()


class _Item:
    __slots__ = ("kind", "ready", "run", "uses", "stream", "launch")

    def __init__(self, kind: str, ready: Callable[[], bool], run: Callable[[], Any], uses: Iterable[int] = ()) -> None:
        self.kind = kind
        self.ready = ready
        self.run = run
        self.uses = tuple(uses)
        self.stream: SimStream | None = None
        self.launch: Any = None  # the NCCL launch this item runs (nccl.py)


class Latch:
    """Holds a kernel until :meth:`open` (a "long kernel" without any timing)."""

    def __init__(self, gpu: SimGPU) -> None:
        self._gpu = gpu
        self.is_open = False

    def open(self) -> None:
        with self._gpu._cv:
            self.is_open = True
            self._gpu._cv.notify_all()


class Gate:
    """A 32-bit counter streams can wait on (``cuStreamWaitValue32`` GEQ, cyclic) and write."""

    def __init__(self, gpu: SimGPU) -> None:
        self._gpu = gpu
        self.value = 0

    def _reached(self, n: int) -> bool:
        diff = (self.value - n) & 0xFFFFFFFF
        return diff < 0x80000000

    def wait(self, stream: SimStream, n: int) -> None:
        with self._gpu._cv:
            self._gpu._push(stream, _Item("gate_wait", lambda: self._reached(n), lambda: None))

    def signal(self, stream: SimStream, n: int) -> None:
        with self._gpu._cv:
            self._gpu._push(stream, _Item("gate_write", lambda: True, lambda: setattr(self, "value", n & 0xFFFFFFFF)))

    def host_write(self, n: int) -> None:
        with self._gpu._cv:
            self.value = n & 0xFFFFFFFF
            self._gpu._cv.notify_all()


class SimGPU:
    """The simulated device(s) of one test: streams, events, kernels, allocator, device thread.

    ``errors`` collects every misuse seen (allocator hazards, NCCL contract
    breaches); a test asserts it stays empty. Use as a context manager, or call
    :meth:`close`.
    """

    def __init__(self, *, sync_limit: float = 30.0, abort_drains: bool = True) -> None:
        global _current_gpu
        self._cv = threading.Condition()
        self._closed = False
        self.sync_limit = sync_limit
        self.abort_drains = abort_drains
        self.errors: list[str] = []
        self._streams: dict[int, SimStream] = {}
        self._handles = itertools.count(0x1000, 0x10)
        self.default_stream = self.stream("default")
        self._live: collections.Counter[int] = collections.Counter()
        self._recorded: dict[int, set[SimStream]] = collections.defaultdict(set)
        self._alloc: dict[int, SimStream] = {}
        self.ran: list[str] = []  # names of kernels, in the order the device ran them
        self.push_checks: list[Callable[[SimStream, _Item], None]] = []  # see nccl.py
        _current_gpu = self
        self._thread = threading.Thread(target=self._run, name="simgpu-device", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------- public API
    def stream(self, name: str = "") -> SimStream:
        """A new stream (``cuda_stream`` is a unique handle)."""
        with self._cv:
            s = SimStream(self, name or f"s{len(self._streams)}", next(self._handles))
            self._streams[s.cuda_stream] = s
            return s

    def stream_by_handle(self, handle: int) -> SimStream:
        s = self._streams.get(int(handle))
        if s is None:
            raise ValueError(f"no simulated stream has handle {handle:#x}")
        return s

    def event(self) -> SimEvent:
        return SimEvent(self)

    def latch(self) -> Latch:
        return Latch(self)

    def gate(self) -> Gate:
        return Gate(self)

    def current_stream(self) -> SimStream:
        return getattr(_tls, "stream", None) or self.default_stream

    @contextlib.contextmanager
    def use_stream(self, stream: SimStream) -> Iterator[SimStream]:
        """Make ``stream`` this thread's current stream (in-place SimTensor ops become kernels)."""
        prev = getattr(_tls, "stream", None)
        _tls.stream = stream
        try:
            yield stream
        finally:
            _tls.stream = prev

    def tensor(self, data: Any, dtype: torch.dtype | None = None, stream: SimStream | None = None) -> SimTensor:
        """A new "CUDA" tensor, allocated on ``stream`` (default: the current stream)."""
        base = torch.as_tensor(data, dtype=dtype).clone()
        t = base.as_subclass(SimTensor)
        with self._cv:
            self._alloc[_key(t)] = stream or self.current_stream()
        self._track(t)
        return t

    def empty(self, *shape: int, dtype: torch.dtype = torch.float32, stream: SimStream | None = None) -> SimTensor:
        return self.tensor(torch.zeros(*shape, dtype=dtype), stream=stream)

    def kernel(self, stream: SimStream, fn: Callable[[], Any], *, hold: Latch | None = None,
               uses: Iterable[torch.Tensor] = (), name: str = "kernel") -> None:
        """Enqueue ``fn`` as a kernel on ``stream``; it runs once ``hold`` (if any) is open."""
        ready = (lambda: hold.is_open) if hold is not None else (lambda: True)

        def run() -> None:
            self.ran.append(name)
            fn()

        with self._cv:
            self._push(stream, _Item("kernel", ready, run, [_key(t) for t in uses]))

    def host(self, t: torch.Tensor) -> torch.Tensor:
        """A plain CPU copy of a SimTensor's current contents (for assertions)."""
        with self._cv:
            return _plain(t).clone()

    def idle(self, timeout: float = 10.0) -> bool:
        """Wait until the device thread can run nothing more (all heads blocked or empty)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._runnable(), timeout)

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait until every stream is empty (``torch.cuda.synchronize``)."""
        with self._cv:
            if not self._cv.wait_for(lambda: all(not s.q for s in self._streams.values()), timeout or self.sync_limit):
                raise RuntimeError(f"SimGPU.synchronize: streams still busy: {self.busy()}")

    def busy(self) -> list[str]:
        return [f"{s.name}: {[i.kind for i in s.q]}" for s in self._streams.values() if s.q]

    def error(self, text: str) -> None:
        with self._cv:
            self.errors.append(text)

    def close(self) -> None:
        global _current_gpu
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(5.0)
        if _current_gpu is self:
            _current_gpu = None

    def __enter__(self) -> SimGPU:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------- internals
    def _push(self, stream: SimStream, item: _Item) -> None:
        """Append ``item`` to ``stream`` (the caller holds ``_cv``)."""
        if stream._gpu is not self:
            raise TypeError(f"{stream!r} is not a stream of this simulated GPU")
        item.stream = stream
        for check in self.push_checks:
            check(stream, item)
        stream.q.append(item)
        self._cv.notify_all()

    def _runnable(self) -> bool:
        return any(s.q and s.q[0].ready() for s in self._streams.values())

    def _run(self) -> None:
        with self._cv:
            while not self._closed:
                progressed = False
                for s in list(self._streams.values()):
                    while s.q and s.q[0].ready():
                        item = s.q.popleft()
                        try:
                            item.run()
                        except Exception as exc:  # noqa: BLE001 - a kernel's bug is the test's failure
                            self.errors.append(f"{item.kind} on {s.name} raised {exc!r}")
                        progressed = True
                if progressed:
                    self._cv.notify_all()
                else:
                    self._cv.wait(0.05)

    def _track(self, t: torch.Tensor) -> None:
        key = _key(t)
        with self._cv:
            self._live[key] += 1
        weakref.finalize(t, self._untrack, key)

    def _untrack(self, key: int) -> None:
        with self._cv:
            self._live[key] -= 1
            if self._live[key] > 0:
                return
            del self._live[key]
            alloc = self._alloc.pop(key, None)
            recorded = self._recorded.pop(key, set())
            for s in self._streams.values():
                if s is alloc or s in recorded:
                    continue
                if any(key in item.uses for item in s.q):
                    self.errors.append(
                        f"allocator: a tensor was freed while {s.name} still uses it and "
                        f"record_stream({s.name}) was never called")

    def _record_stream(self, key: int, stream: SimStream) -> None:
        with self._cv:
            self._recorded[key].add(stream)
