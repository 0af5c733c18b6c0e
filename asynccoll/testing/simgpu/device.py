"""A deterministic model of CUDA devices: streams, hardware queues, events, kernels, the allocator.

One :class:`SimGPU` holds the devices (``cuda:0`` .. ``cuda:N-1``) of every simulated
rank in this process. What the code under test sees of it are the doubles of
``torch.cuda`` and ``cuda.bindings.driver`` (``cudart.py``, ``driver.py``), installed
while the SimGPU is open; this module is the device behind them.

Rules, each from the CUDA documentation or torch source named:

* A stream is a FIFO: an item starts (is *dispatched*) only when every earlier item
  of its stream has completed (CUDA C Programming Guide, "Streams").
* Streams feed a fixed number of *hardware queues* per device, assigned round-robin
  when a stream is created; a queue dispatches in push order, so an item that cannot
  start blocks everything pushed behind it on that queue, from any stream
  (``CUDA_DEVICE_MAX_CONNECTIONS``: "the number of compute and copy engine concurrent
  connections (work queues) from the host to each device", 1 to 32, default 8 —
  CUDA C Programming Guide, "CUDA Environment Variables"). ``hw_queues`` defaults to
  that variable, as the driver reads it. This is how a wait enqueued before its
  producer deadlocks (``cuStreamWaitValue32``'s note: ordering through it "is not
  visible to CUDA").
* A dispatched kernel runs concurrently with later items of other streams; it
  completes when its ``hold`` allows (a latch, a timed ``torch.cuda._sleep``, or the
  NCCL rules in ``nccl.py``).
* An event records the work its stream holds at ``record`` time; a stream that waits
  on it waits for that recording only (``cudaStreamWaitEvent``: "the wait ... is
  on the most recent call to cudaEventRecord"); never recorded: no wait, and
  ``query()`` is true.
* The caching allocator: a block freed while a stream other than its allocation
  stream still uses it, and that stream was never named by ``record_stream``, is a
  hazard (torch ``Tensor.record_stream`` docs) recorded in :attr:`SimGPU.errors`.

"CUDA tensors" are :class:`SimTensor` s: CPU tensors whose ``device`` is the simulated
device they were allocated on. An in-place op on one, issued while its device's
current stream of the calling thread has work pending, is enqueued as a kernel on
that stream; otherwise it runs at once (an idle stream would run it at once).

One SimGPU is open at a time (the latest created; SimTensors report to it).
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import time
import weakref
from typing import Any, Callable, Iterable

import torch
from torch._C import DisableTorchFunctionSubclass

_current_gpu: Device | None = None  # the open GPU (SimTensors report to it)
_DEFAULT_QUEUES = 8  # CUDA_DEVICE_MAX_CONNECTIONS default (CUDA C Programming Guide)


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain CPU tensor (the subclass's dispatch off, as torch's docs on
    extending torch do it)."""
    with DisableTorchFunctionSubclass():
        return torch.Tensor.as_subclass(t, torch.Tensor)


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (the allocator's block)."""
    with DisableTorchFunctionSubclass():
        return int(t.untyped_storage().data_ptr())


def open_gpu() -> Device:
    """The open simulated GPU (RuntimeError when none is)."""
    gpu = _current_gpu
    if gpu is None:
        raise RuntimeError("no simulated GPU is open")
    return gpu


class SimTensor(torch.Tensor):
    """A CPU tensor that the code under test sees as a CUDA tensor on its simulated device."""

    _sim_device: torch.device
    #: ``__torch_function__`` dispatches so far (benchmarks count the simulated tensor's cost).
    dispatches = 0

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        try:
            return self._sim_device
        except (
            AttributeError
        ):  # a tensor made by torch itself (e.g. inside an op): its storage's device
            gpu = _current_gpu
            dev = torch.device(
                "cuda", gpu._device_of.get(storage_key(self), 0) if gpu is not None else 0
            )
            self._sim_device = dev
            return dev

    def record_stream(self, stream: Any) -> None:
        """``Tensor.record_stream``: the block is not reused before ``stream``'s current work ends."""
        gpu = open_gpu()
        state = gpu.stream_state(stream)  # TypeError for anything but a CUDA stream
        if state.device != self.device.index:
            # c10 CUDACachingAllocator::recordStream: a stream of another device is an error.
            raise RuntimeError(
                f"record_stream: stream on cuda:{state.device}, tensor on {self.device}"
            )
        gpu._record_stream(storage_key(self), state)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        SimTensor.dispatches += 1
        gpu = _current_gpu
        name = getattr(func, "__name__", "")
        if (
            gpu is not None
            and name.endswith("_")
            and not name.startswith("_")
            and name not in ("requires_grad_", "record_stream")
            and args
            and isinstance(args[0], SimTensor)
        ):
            state = gpu._stream_for_kernel(args[0])
            if state is not None:  # the current stream has work pending: a kernel behind it
                gpu.kernel(
                    state, lambda: func(*args, **kwargs), uses=_tensors(args, kwargs), name=name
                )
                return args[0]
        ret = super().__torch_function__(func, types, args, kwargs)  # type: ignore[no-untyped-call]
        if gpu is not None and isinstance(ret, (torch.Tensor, list, tuple)):
            made = _tensors((ret,), {})
            if made:
                src = next(iter(_tensors(args, kwargs)), None)
                for t in made:
                    if t is not src:
                        gpu._track(t, src)
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


class StreamState:
    """The device side of one ``cudaStream_t``: its FIFO, device, priority, hardware queue."""

    def __init__(
        self, gpu: Device, handle: int, device: int, priority: int, name: str, hwq: int
    ) -> None:
        self.gpu = gpu
        self.handle = handle
        self.device = device
        self.priority = priority
        self.name = name
        self.hwq = hwq
        self.q: collections.deque[Item] = collections.deque()
        self.destroyed = False

    def __repr__(self) -> str:
        return f"<stream {self.name} cuda:{self.device} #{self.handle:#x} q{self.hwq} pending={len(self.q)}>"


class EventState:
    """One ``cudaEvent_t``: how many records were issued and how many the device reached."""

    __slots__ = ("device", "recorded", "done")

    def __init__(self) -> None:
        self.device: int | None = None
        self.recorded = 0
        self.done = 0

    def reached(self, n: int) -> bool:
        return self.done >= n


class Item:
    """One thing on a stream: ``ready`` gates its start, ``hold`` its end, ``run`` is its effect."""

    __slots__ = (
        "kind",
        "ready",
        "hold",
        "run",
        "uses",
        "stream",
        "launch",
        "dispatched",
        "on_dispatch",
    )

    def __init__(
        self,
        kind: str,
        run: Callable[[], Any] = lambda: None,
        *,
        ready: Callable[[], bool] | None = None,
        hold: Callable[[], bool] | None = None,
        uses: Iterable[int] = (),
    ) -> None:
        self.kind = kind
        self.ready = ready
        self.hold = hold
        self.run = run
        self.uses = tuple(uses)
        self.stream: StreamState | None = None
        self.launch: Any = None  # the NCCL launch this item runs (nccl.py)
        self.dispatched = False
        self.on_dispatch: Callable[[], None] | None = None


class Latch:
    """Holds a kernel until :meth:`open` (a "long kernel" without any timing)."""

    def __init__(self, gpu: Device) -> None:
        self._gpu = gpu
        self.is_open = False

    def open(self) -> None:
        with self._gpu.cv:
            self.is_open = True
            self._gpu.cv.notify_all()


class Device:
    """The simulated devices of one test: streams, queues, events, kernels, allocator, device thread.

    ``errors`` collects every misuse seen (allocator hazards, CUDA and NCCL contract
    breaches); a test asserts it stays empty. :class:`SimGPU` (``gpu.py``) is this model
    with the vendor doubles installed on top.
    """

    #: The ``torch.cuda`` and ``cuda.bindings.driver`` doubles (``cudart.TorchCuda``,
    #: ``driver.Driver``), set by :class:`SimGPU`.
    runtime: Any
    driver: Any

    def __init__(
        self,
        *,
        devices: int = 1,
        hw_queues: int | None = None,
        capability: tuple[int, int] = (9, 0),
        sync_limit: float = 30.0,
        abort_drains: bool = True,
        stream_mem_ops: bool = True,
    ) -> None:
        global _current_gpu
        prev = _current_gpu
        if prev is not None and not prev.closed:
            raise RuntimeError("a simulated GPU is already open; close it first")
        self.cv = threading.Condition()
        self._closed = False
        self.devices = devices
        env = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
        self.hw_queues = hw_queues or (int(env) if env else _DEFAULT_QUEUES)
        self.capability = [capability] * devices
        self.stream_mem_ops = stream_mem_ops
        self.sync_limit = sync_limit
        self.abort_drains = abort_drains
        self.errors: list[str] = []
        self._streams: dict[int, StreamState] = {}  # by handle (default streams: by -1 - device)
        self._handles = itertools.count(0x1000, 0x10)
        self._hwq: list[list[collections.deque[Item]]] = [
            [collections.deque() for _ in range(self.hw_queues)] for _ in range(devices)
        ]
        self._created = [0] * devices
        self._live: collections.Counter[int] = collections.Counter()
        self._recorded: dict[int, set[StreamState]] = collections.defaultdict(set)
        self._alloc: dict[int, StreamState] = {}
        self._device_of: dict[int, int] = {}
        self.ran: list[str] = []  # names of kernels, in the order the device completed them
        self.push_checks: list[Callable[[StreamState, Item], None]] = []  # see nccl.py
        self.observers: list[
            Callable[[Item], None]
        ] = []  # called as each item completes (benchmarks)
        self._defaults = [self._new_state(0, d, 0, f"default{d}") for d in range(devices)]
        _current_gpu = self
        self._thread = threading.Thread(target=self._run, name="simgpu-device", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    # ----------------------------------------------------------- public API
    def stream(self, name: str = "", device: int | None = None, priority: int = 0) -> Any:
        """A new stream of its own (as ``cuStreamCreate``), as a ``torch.cuda.Stream`` double."""
        dev = self.runtime.current_device() if device is None else device
        state = self.new_stream(dev, priority, name)
        return self.runtime.stream_object(state)

    def new_stream(self, device: int, priority: int = 0, name: str = "") -> StreamState:
        with self.cv:
            handle = next(self._handles)
            return self._new_state(handle, device, priority, name or f"s{handle:#x}")

    def stream_state(self, stream: Any) -> StreamState:
        """The device side of a stream double (or of a raw handle on ``device`` 0)."""
        state = getattr(stream, "_sim_state", None)
        if isinstance(state, StreamState):
            return state
        raise TypeError(f"not a simulated CUDA stream: {stream!r}")

    def state_by_handle(self, handle: int, device: int) -> StreamState:
        h = int(handle)
        state = self._defaults[device] if h in (0, 1, 2) else self._streams.get(h)
        if state is None or state.destroyed:
            raise ValueError(f"no simulated stream has handle {h:#x}")
        return state

    def default_state(self, device: int) -> StreamState:
        return self._defaults[device]

    def event(self) -> Any:
        """A new ``torch.cuda.Event`` double."""
        return self.runtime.event_object()

    def latch(self) -> Latch:
        return Latch(self)

    def use_stream(self, stream: Any) -> Any:
        """``torch.cuda.stream(stream)`` (in-place SimTensor ops become kernels on it)."""
        return self.runtime.stream_context(stream)

    def tensor(
        self,
        data: Any,
        dtype: torch.dtype | None = None,
        stream: Any = None,
        device: int | torch.device | None = None,
    ) -> SimTensor:
        """A new "CUDA" tensor on ``device`` (default: the calling thread's current device),
        allocated on ``stream`` (default: that device's current stream)."""
        if isinstance(device, torch.device):
            device = device.index or 0
        dev = self.runtime.current_device() if device is None else int(device)
        state = self.stream_state(stream) if stream is not None else self.runtime.current_state(dev)
        base = torch.as_tensor(data, dtype=dtype).clone()
        t = base.as_subclass(SimTensor)
        key = storage_key(t)
        with self.cv:
            self._alloc[key] = state
            self._device_of[key] = state.device
        self._track(t, None)
        return t

    def empty(
        self,
        *shape: int,
        dtype: torch.dtype = torch.float32,
        stream: Any = None,
        device: int | None = None,
    ) -> SimTensor:
        return self.tensor(torch.zeros(*shape, dtype=dtype), stream=stream, device=device)

    def kernel(
        self,
        stream: Any,
        fn: Callable[[], Any],
        *,
        hold: Latch | None = None,
        uses: Iterable[torch.Tensor] = (),
        name: str = "kernel",
        seconds: float | None = None,
    ) -> None:
        """Enqueue ``fn`` as a kernel on ``stream``; it ends once ``hold`` (if any) is open,
        or ``seconds`` after it started."""
        state = stream if isinstance(stream, StreamState) else self.stream_state(stream)
        started: list[float] = []

        def end() -> bool:
            if hold is not None and not hold.is_open:
                return False
            return seconds is None or (bool(started) and time.monotonic() >= started[0] + seconds)

        def run() -> None:
            self.ran.append(name)
            fn()

        item = Item(
            "kernel",
            run,
            hold=end if (hold is not None or seconds is not None) else None,
            uses=[storage_key(t) for t in uses],
        )
        if seconds is not None:
            item.on_dispatch = lambda: started.append(time.monotonic())
        with self.cv:
            self.push(state, item)

    def host(self, t: torch.Tensor) -> torch.Tensor:
        """A plain CPU copy of a SimTensor's current contents (for assertions)."""
        with self.cv:
            return plain(t).clone()

    def idle(self, timeout: float = 10.0) -> bool:
        """Wait until the device can do nothing more (all heads blocked or empty)."""
        with self.cv:
            return self.cv.wait_for(lambda: not self._step(dry=True), timeout)

    def synchronize(self, timeout: float | None = None, device: int | None = None) -> None:
        """Wait until every stream (of ``device``, or of all devices) is empty."""
        with self.cv:
            ok = self.cv.wait_for(
                lambda: all(not s.q for s in self.states() if device is None or s.device == device),
                timeout or self.sync_limit,
            )
            if not ok:
                raise RuntimeError(f"SimGPU.synchronize: streams still busy: {self.busy()}")

    def busy(self) -> list[str]:
        return [f"{s.name}: {[i.kind for i in s.q]}" for s in self.states() if s.q]

    def error(self, text: str) -> None:
        with self.cv:
            self.errors.append(text)

    def close(self) -> None:
        global _current_gpu
        with self.cv:
            if self._closed:
                return
            self._closed = True
            self.cv.notify_all()
        self._thread.join(5.0)
        self.closing()
        if _current_gpu is self:
            _current_gpu = None

    def closing(self) -> None:
        """After the device thread stopped, before the GPU is let go (a subclass's hook)."""

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------- internals
    def _new_state(self, handle: int, device: int, priority: int, name: str) -> StreamState:
        if not 0 <= device < self.devices:
            raise ValueError(f"cuda:{device} does not exist ({self.devices} simulated device(s))")
        hwq = (
            self._created[device] % self.hw_queues
        )  # round-robin, as the driver assigns connections
        self._created[device] += 1
        state = StreamState(self, handle, device, priority, name, hwq)
        if handle:
            self._streams[handle] = state
        return state

    def states(self) -> list[StreamState]:
        return self._defaults + list(self._streams.values())

    def push(self, state: StreamState, item: Item) -> None:
        """Append ``item`` to ``state``'s FIFO and hardware queue (the caller holds ``cv``)."""
        if state.gpu is not self:
            raise TypeError(f"{state!r} is not a stream of this simulated GPU")
        if state.destroyed:
            raise RuntimeError(f"{state!r} was destroyed")
        item.stream = state
        for check in self.push_checks:
            check(state, item)
        state.q.append(item)
        self._hwq[state.device][state.hwq].append(item)
        self.cv.notify_all()

    def _step(self, dry: bool = False) -> bool:
        """Dispatch and complete what can be; with ``dry``, only say whether anything could."""
        progressed = False
        for queues in self._hwq:
            for hq in queues:
                while hq:
                    item = hq[0]
                    st = item.stream
                    assert st is not None
                    if st.q[0] is not item or (item.ready is not None and not item.ready()):
                        break  # the queue is blocked by its head
                    if dry:
                        return True
                    hq.popleft()
                    item.dispatched = True
                    if item.on_dispatch is not None:
                        item.on_dispatch()
                    progressed = True
        for st in self.states():
            while st.q and st.q[0].dispatched and (st.q[0].hold is None or st.q[0].hold()):
                if dry:
                    return True
                item = st.q.popleft()
                try:
                    item.run()
                except Exception as exc:  # noqa: BLE001 - a kernel's bug is the test's failure
                    self.errors.append(f"{item.kind} on {st.name} raised {exc!r}")
                for observe in self.observers:
                    observe(item)
                progressed = True
        return progressed

    def _run(self) -> None:
        with self.cv:
            while not self._closed:
                if self._step():
                    self.cv.notify_all()
                else:
                    self.cv.wait(0.005)

    def _stream_for_kernel(self, t: SimTensor) -> StreamState | None:
        """Where an in-place op on ``t`` goes: its device's current stream, if work is pending there."""
        state = self.runtime.current_state(t.device.index)
        with self.cv:
            return state if state.q else None

    def _track(self, t: torch.Tensor, src: torch.Tensor | None) -> None:
        key = storage_key(t)
        with self.cv:
            self._live[key] += 1
            if key not in self._device_of and src is not None:
                self._device_of[key] = self._device_of.get(storage_key(src), 0)
            dev = self._device_of.get(key)
        if dev is not None:
            t._sim_device = torch.device("cuda", dev)  # type: ignore[attr-defined]
        weakref.finalize(t, self._untrack, key)

    def _untrack(self, key: int) -> None:
        with self.cv:
            self._live[key] -= 1
            if self._live[key] > 0:
                return
            del self._live[key]
            self._device_of.pop(key, None)
            alloc = self._alloc.pop(key, None)
            recorded = self._recorded.pop(key, set())
            for s in self.states():
                if s is alloc or s in recorded:
                    continue
                if any(key in item.uses for item in s.q):
                    self.errors.append(
                        f"allocator: a tensor was freed while {s.name} still uses it and "
                        f"record_stream({s.name}) was never called"
                    )

    def _record_stream(self, key: int, state: StreamState) -> None:
        with self.cv:
            self._recorded[key].add(state)
