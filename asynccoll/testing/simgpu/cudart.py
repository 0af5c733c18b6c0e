"""Doubles of ``torch.cuda`` (and torch's CUDA tensor factories) on a :class:`SimGPU`.

While a SimGPU is open, ``torch.cuda.Stream``, ``ExternalStream``, ``Event``,
``current_stream``, ``set_device``, ``device``, ``stream``, ... are replaced here,
so that the code under test (``streams``, the NCCL backend's ``CudaRuntime``) runs
unmodified. Functions are bound to the real ones' signatures (``_double.strict``: a
wrong argument raises ``TypeError`` where torch would); ``Stream``, ``ExternalStream``
and ``Event`` are subclasses of the real classes whose C++-level members (torch's
``_CudaStreamBase``/``_CudaEventBase``, absent from a CPU build) are simulated, so the
real Python methods (``wait_event``, ``wait_stream``, ``record_event``) run on top;
``tests/testing/test_simgpu_device.py`` pins every overridden signature to torch's.

Rules, with their source:

* Per-thread current device (``cudaSetDevice`` is per host thread) and per-thread,
  per-device current stream (c10/cuda/CUDAStream.cpp, ``current_streams`` is
  ``thread_local``). A thread that never selected a device uses device 0.
* ``torch.cuda.Stream()`` does not create a stream: it hands out one of 32 pool
  streams per priority level per device, round-robin (c10/cuda/CUDAStream.cpp,
  ``kStreamsPerPool = 1 << 5``, ``getStreamFromPool``): the 33rd "new" stream is the
  first one again, and is shared with every other user of the pool.
* ``CUDAEvent::query``/``synchronize`` have no device guard (ATen/cuda/CUDAEvent.h:
  "cudaEventQuery can be safely called from any device"): they run on the calling
  thread's current device, and the CUDA runtime initialises that device's primary
  context on the first call (CUDA Runtime API, "Initialization"). A thread that
  queries an event of ``cuda:d`` while its current device is another one is an
  error here (it would cost a context on that device, hundreds of MB, or fail in
  EXCLUSIVE_PROCESS mode).
* ``cudaSetDevice`` initialises the device's primary context and makes it current
  on the thread (CUDA 12.0 runtime API notes) — what driver calls (``driver.py``)
  need; ``Event.record`` and ``Stream.wait_event`` guard to the stream's device
  (ATen/cuda/CUDAEvent.h ``CUDAGuard``), and an event recorded on one device cannot
  be recorded on another ("Event device ... does not match recording stream's").
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator

import torch
import torch.cuda.streams as _streams_mod

from ._double import strict
from .device import Device, EventState, Item, StreamState, open_gpu

_REAL_STREAM = torch.cuda.Stream
_REAL_EXTERNAL = torch.cuda.ExternalStream
_REAL_EVENT = torch.cuda.Event
_POOL = 32  # c10/cuda/CUDAStream.cpp: kStreamsPerPool
_LEVELS = 4  # c10: max_compile_time_stream_priorities; torch reports priority_range() == (0, -3)
_CLOCK_HZ = 1.98e9  # torch.cuda._sleep counts GPU cycles (H100 boost clock)


def _rt() -> TorchCuda:
    rt: TorchCuda = open_gpu().runtime
    return rt


class Stream(_REAL_STREAM):
    """``torch.cuda.Stream`` double: a stream of torch's per-device pool (see module docstring)."""

    _sim_state: StreamState

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
        rt = _rt()
        obj: Stream = rt.wrap(cls, rt.pool_stream(rt.index(device), priority))
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # the real class has no __init__; the dummy CPU base would raise

    # torch/csrc/cuda/Stream.cpp (THCPStream): the C++ members
    @property
    def cuda_stream(self) -> int:  # type: ignore[override]
        return self._sim_state.handle

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self._sim_state.device)

    @property
    def device_index(self) -> int:  # type: ignore[override]
        return self._sim_state.device

    @property
    def device_type(self) -> int:  # type: ignore[override]
        return 1  # c10::DeviceType::CUDA

    @property
    def priority(self) -> int:  # type: ignore[override]
        return self._sim_state.priority

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return (0, -(_LEVELS - 1))

    def query(self) -> bool:
        gpu = open_gpu()
        with gpu.cv:
            return not self._sim_state.q

    def synchronize(self) -> None:
        ev = Event()
        ev.record(self)
        ev.synchronize()

    def __eq__(self, o: object) -> bool:
        st = getattr(o, "_sim_state", None)
        return isinstance(st, StreamState) and st is self._sim_state

    def __hash__(self) -> int:
        return hash((self._sim_state.device, self._sim_state.handle))

    def __repr__(self) -> str:
        s = self._sim_state
        return f"<torch.cuda.Stream device=cuda:{s.device} cuda_stream={s.handle:#x} ({s.name})>"


class ExternalStream(Stream):
    """``torch.cuda.ExternalStream`` double: wraps an existing handle (no new stream)."""

    def __new__(cls, stream_ptr: int, device: Any = None, **kwargs: Any) -> ExternalStream:
        rt = _rt()
        obj: ExternalStream = rt.wrap(
            cls, open_gpu().state_by_handle(int(stream_ptr), rt.index(device))
        )
        return obj


class Event(_REAL_EVENT):
    """``torch.cuda.Event`` double (ATen/cuda/CUDAEvent.h semantics, see the module docstring)."""

    _sim: EventState
    _timing: bool
    _times: dict[int, float]

    def __new__(
        cls,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
        external: bool = False,
    ) -> Event:
        if interprocess:
            raise NotImplementedError("interprocess events are not simulated")
        obj = object.__new__(cls)
        obj._sim = EventState()
        obj._timing = enable_timing
        obj._times = {}
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    @property
    def device(self) -> torch.device | None:  # type: ignore[override]
        d = self._sim.device
        return None if d is None else torch.device("cuda", d)

    @property
    def cuda_event(self) -> int:  # type: ignore[override]
        return id(self._sim)

    def record(self, stream: Any = None) -> None:
        rt = _rt()
        if stream is None:
            stream = rt.current_stream()
        state = open_gpu().stream_state(stream)
        ev = self._sim
        if ev.device is not None and ev.device != state.device:
            raise RuntimeError(
                f"Event device cuda:{ev.device} does not match recording stream's device "
                f"cuda:{state.device}"
            )
        gpu = open_gpu()
        with gpu.cv:
            ev.device = state.device
            ev.recorded += 1
            n = ev.recorded
            times = self._times

            def reach() -> None:
                ev.done = max(ev.done, n)
                times[n] = time.monotonic()

            gpu.push(state, Item("record", reach))

    def wait(self, stream: Any = None) -> None:
        rt = _rt()
        if stream is None:
            stream = rt.current_stream()
        state = open_gpu().stream_state(stream)
        ev = self._sim
        gpu = open_gpu()
        with gpu.cv:
            n = ev.recorded  # the record current at call time (none: nothing to wait for)
            gpu.push(state, Item("wait_event", ready=lambda: ev.done >= n))

    def query(self) -> bool:
        ev = self._sim
        if ev.device is not None:
            _rt().unguarded(ev.device, "torch.cuda.Event.query")
        gpu = open_gpu()
        with gpu.cv:
            return ev.done >= ev.recorded

    def synchronize(self) -> None:
        ev = self._sim
        if ev.device is not None:
            _rt().unguarded(ev.device, "torch.cuda.Event.synchronize")
        gpu = open_gpu()
        with gpu.cv:
            target = ev.recorded
            if not gpu.cv.wait_for(lambda: ev.done >= target or gpu.closed, gpu.sync_limit):
                raise RuntimeError(f"Event.synchronize: not reached within {gpu.sync_limit} s")

    def elapsed_time(self, end_event: Any) -> float:
        a, b = self._times.get(self._sim.recorded), end_event._times.get(end_event._sim.recorded)
        if not (self._timing and end_event._timing) or a is None or b is None:
            raise RuntimeError(
                "elapsed_time: events need enable_timing=True and must have completed"
            )
        return float((b - a) * 1e3)

    def __repr__(self) -> str:
        return f"<torch.cuda.Event {id(self._sim):#x} recorded={self._sim.recorded} done={self._sim.done}>"


class _Thread(threading.local):
    def __init__(self) -> None:
        self.device: int | None = None  # never selected: the runtime uses device 0
        self.streams: dict[int, StreamState] = {}
        self.ctx: int | None = None  # the device whose primary context is current (driver API)
        self.ctx_stack: list[int | None] = []  # cuCtxPushCurrent/PopCurrent


class _DeviceGuard:
    """``torch.cuda.device(d)``: select ``d`` for the block (no-op for None/-1)."""

    def __init__(self, rt: TorchCuda, device: Any) -> None:
        self.rt = rt
        self.idx = (
            None if device is None or (isinstance(device, int) and device < 0) else rt.index(device)
        )
        self.prev: int | None = None

    def __enter__(self) -> _DeviceGuard:
        t = self.rt.tls
        self.prev = t.device
        if self.idx is not None and self.idx != self.rt.current_device():
            self.rt.select(self.idx)
        return self

    def __exit__(self, *exc: Any) -> None:
        t = self.rt.tls
        if self.idx is not None and t.device != self.prev:
            t.device = self.prev
            if self.prev is not None:
                t.ctx = self.prev


class TorchCuda:
    """The ``torch.cuda`` doubles of one SimGPU: per-thread state, the stream pool, the patches."""

    def __init__(self, gpu: Device) -> None:
        self.gpu = gpu
        self.tls = _Thread()
        self._pool: dict[tuple[int, int], list[StreamState]] = {}
        self._next: dict[tuple[int, int], int] = {}
        self._saved: list[tuple[Any, str, Any]] = []
        self.contexts: dict[int, set[str]] = {}  # device -> threads that bound its primary context

    # ------------------------------------------------------------ thread state
    def current_device(self) -> int:
        d = self.tls.device
        return 0 if d is None else d

    def index(self, device: Any) -> int:
        """torch's ``_get_device_index`` for CUDA devices (None: the current device)."""
        if device is None:
            return self.current_device()
        if isinstance(device, bool):
            raise ValueError(f"Expected a cuda device, but got: {device!r}")
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            if device.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {device}")
            return self.current_device() if device.index is None else device.index
        if isinstance(device, int):
            if not 0 <= device < self.gpu.devices:
                raise RuntimeError(f"CUDA error: invalid device ordinal {device}")
            return device
        raise ValueError(f"Expected a cuda device, but got: {device!r}")

    def select(self, idx: int) -> None:
        """``cudaSetDevice(idx)``: current device; its primary context initialised and current."""
        if not 0 <= idx < self.gpu.devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal {idx}")
        self.tls.device = idx
        self.tls.ctx = idx
        self.contexts.setdefault(idx, set()).add(threading.current_thread().name)

    def unguarded(self, device: int, what: str) -> None:
        """A runtime call without a device guard, on an object of ``device``."""
        cur = self.current_device()
        self.contexts.setdefault(cur, set()).add(threading.current_thread().name)
        if self.tls.ctx is None:
            self.tls.ctx = cur
        if cur != device:
            self.gpu.error(
                f"{what} on thread {threading.current_thread().name!r} for cuda:{device}, whose current device is "
                f"cuda:{cur}: no device guard there, so the runtime binds cuda:{cur}'s primary context "
                "(set the thread's device first)"
            )

    def current_state(self, device: int | None = None) -> StreamState:
        d = self.current_device() if device is None else device
        return self.tls.streams.get(d) or self.gpu.default_state(d)

    def current_stream(self, device: Any = None) -> Stream:
        return self.stream_object(self.current_state(self.index(device)))

    def wrap(self, cls: type, state: StreamState) -> Any:
        obj: Any = object.__new__(cls)
        obj._sim_state = state
        return obj

    def stream_object(self, state: StreamState) -> Stream:
        obj: Stream = self.wrap(Stream, state)
        return obj

    def event_object(self) -> Event:
        return Event()

    def pool_stream(self, device: int, priority: int) -> StreamState:
        level = min(max(-int(priority), 0), _LEVELS - 1)
        key = (device, level)
        pool = self._pool.get(key)
        if pool is None:
            pool = self._pool[key] = [
                self.gpu.new_stream(device, -level, f"pool{device}.{level}.{i}")
                for i in range(_POOL)
            ]
        i = self._next.get(key, 0)
        self._next[key] = i + 1
        return pool[i % _POOL]

    @contextlib.contextmanager
    def stream_context(self, stream: Any) -> Iterator[Any]:
        """``torch.cuda.stream(s)``: ``s`` current on its device, and its device current."""
        if stream is None:
            yield None
            return
        state = self.gpu.stream_state(stream)
        t = self.tls
        prev_dev, prev_stream = t.device, t.streams.get(state.device)
        if state.device != self.current_device():
            self.select(state.device)
        t.streams[state.device] = state
        try:
            yield stream
        finally:
            if prev_stream is None:
                t.streams.pop(state.device, None)
            else:
                t.streams[state.device] = prev_stream
            t.device = prev_dev

    # -------------------------------------------------------------- patching
    def install(self) -> None:
        c = torch.cuda
        fns: dict[str, Callable[..., Any]] = {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "init": lambda: None,
            "device_count": lambda: self.gpu.devices,
            "current_device": self.current_device,
            "set_device": lambda device: self.select(self.index(device)),
            "current_stream": self.current_stream,
            "default_stream": lambda device=None: self.stream_object(
                self.gpu.default_state(self.index(device))
            ),
            "set_stream": self._set_stream,
            "stream": self.stream_context,
            "synchronize": lambda device=None: self.gpu.synchronize(device=self.index(device)),
            "get_device_capability": lambda device=None: self.gpu.capability[self.index(device)],
            "get_device_name": lambda device=None: "Simulated GPU",
            "_sleep": self._sleep,
        }
        for name, impl in fns.items():
            self._patch(c, name, strict(getattr(c, name), impl))
        self._patch(c, "device", strict(c.device, lambda device: _DeviceGuard(self, device)))
        self._patch(c, "Stream", Stream)
        self._patch(c, "ExternalStream", ExternalStream)
        self._patch(c, "Event", Event)
        self._patch(_streams_mod, "Event", Event)  # Stream.record_event's global
        self._patch(
            torch.backends.cuda, "is_built", strict(torch.backends.cuda.is_built, lambda: True)
        )
        for name in ("empty", "zeros", "ones", "full"):
            self._patch(torch, name, self._factory(getattr(torch, name)))

    def uninstall(self) -> None:
        while self._saved:
            obj, name, old = self._saved.pop()
            setattr(obj, name, old)

    def _patch(self, obj: Any, name: str, new: Any) -> None:
        self._saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, new)

    def _set_stream(self, stream: Any) -> None:
        if stream is None:
            return
        state = self.gpu.stream_state(stream)
        if state.device != self.current_device():
            self.select(state.device)
        self.tls.streams[state.device] = state

    def _sleep(self, cycles: int) -> None:
        self.gpu.kernel(
            self.current_state(), lambda: None, seconds=cycles / _CLOCK_HZ, name="_sleep"
        )

    def _factory(self, real: Callable[..., Any]) -> Callable[..., Any]:
        """``torch.empty``/``zeros``/``ones``/``full``: ``device="cuda..."`` gives a SimTensor on
        the current stream of that device (the caching allocator's stream); other devices: torch."""

        def factory(*args: Any, device: Any = None, **kwargs: Any) -> Any:
            dev = (
                torch.device(device)
                if isinstance(device, (str, int)) and not isinstance(device, bool)
                else device
            )
            if isinstance(dev, int):
                dev = torch.device("cuda", dev)
            if not isinstance(dev, torch.device) or dev.type != "cuda":
                return real(*args, device=device, **kwargs)
            idx = self.index(dev)
            host = real(*args, **kwargs)
            return self.gpu.tensor(
                host, stream=self.stream_object(self.current_state(idx)), device=idx
            )

        factory.__wrapped__ = real  # type: ignore[attr-defined]
        return factory


def bound_contexts(gpu: Device) -> dict[int, set[str]]:
    """Which threads bound each device's primary context (for tests of the device rule)."""
    return {d: set(names) for d, names in gpu.runtime.contexts.items()}
