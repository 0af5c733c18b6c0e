"""Dedicated communication streams per device and a pool of reusable CUDA events."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable

import torch

from ._errors import CudaUnavailable, DeviceLike, device_index, require_cuda

__all__ = ["EventPool", "OwnStreams", "StreamSet", "comm_stream", "own_streams"]


class OwnStreams:
    """CUDA streams this process created for itself, never shared with other code.

    ``torch.cuda.Stream()`` does not create a stream: it hands out one of 32 pooled
    streams per priority level per device, round-robin (c10/cuda/CUDAStream.cpp), so
    the 33rd "new" stream is the first one again, shared with FSDP, user code and
    every other caller. A communication stream must be its own: a ``wait_stream`` on
    an alias waits on itself, foreign kernels queue behind the collectives, two
    communicators could share one. These streams are created with
    ``cuStreamCreateWithPriority`` (``cuda-bindings``) and wrapped as
    :class:`torch.cuda.ExternalStream`.

    :meth:`acquire` hands out a stream no one else holds; :meth:`release` takes it
    back for reuse. Streams are never destroyed: the caching allocator records events
    on every stream named by ``record_stream`` when it frees those blocks, so a
    stream must outlive every tensor ever recorded on it. Thread-safe.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[int, int], list[torch.cuda.Stream]] = {}
        self._ranges: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self.created = 0

    def acquire(self, device: DeviceLike = None, priority: int | None = None) -> torch.cuda.Stream:
        """A stream of ``device`` held by nobody else (None priority: the highest).

        Raises:
            CudaUnavailable: CUDA or ``cuda-bindings`` cannot be used.
        """
        index = device_index(device, "OwnStreams.acquire")
        with self._lock:
            prio = self._priority(index, priority)
            free = self._free.get((index, prio))
            if free:
                return free.pop()
            self.created += 1
        return self._create(index, prio)

    def release(self, stream: torch.cuda.Stream) -> None:
        """Give ``stream`` (from :meth:`acquire`) back; it may be handed out again."""
        key = (int(stream.device.index or 0), int(stream.priority))
        with self._lock:
            self._free.setdefault(key, []).append(stream)

    def _priority(self, index: int, priority: int | None) -> int:
        rng = self._ranges.get(index)
        if rng is None:
            rng = self._ranges[index] = _driver_call(
                index, "cuCtxGetStreamPriorityRange", lambda cu: cu.cuCtxGetStreamPriorityRange()
            )
        least, greatest = rng
        if priority is None:
            return greatest
        return min(max(int(priority), greatest), least)

    def _create(self, index: int, priority: int) -> torch.cuda.Stream:
        handle = _driver_call(
            index,
            "cuStreamCreateWithPriority",
            lambda cu: cu.cuStreamCreateWithPriority(
                int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), priority
            ),
        )
        stream: torch.cuda.Stream = torch.cuda.ExternalStream(int(handle), device=index)
        return stream


def _driver_call(index: int, what: str, fn: Callable[[Any], tuple[Any, ...]]) -> Any:
    """``fn(cuda.bindings.driver)`` with ``index``'s primary context current (pushed and popped
    around the call, so the calling thread's own context is left as it was); its results
    after the ``CUresult``, raising RuntimeError for an error code."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:
        raise CudaUnavailable(
            f"streams of its own need cuda-bindings ({exc}): pip install cuda-bindings "
            "(or asynccoll[nccl], which includes it)"
        ) from exc
    err, dev = cu.cuDeviceGet(index)
    _check(err, "cuDeviceGet")
    err, ctx = cu.cuDevicePrimaryCtxRetain(
        dev
    )  # held for the process: the streams are never destroyed
    _check(err, "cuDevicePrimaryCtxRetain")
    (err,) = cu.cuCtxPushCurrent(ctx)
    _check(err, "cuCtxPushCurrent")
    try:
        out = fn(cu)
        _check(out[0], what)
        return out[1] if len(out) == 2 else out[1:]
    finally:
        cu.cuCtxPopCurrent()


def _check(err: Any, what: str) -> None:
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: CUDA error {int(err)} ({err})")


_own: OwnStreams | None = None
_own_lock = threading.Lock()


def own_streams() -> OwnStreams:
    """The process-wide :class:`OwnStreams`, created on first use (never at import)."""
    global _own
    if _own is None:
        with _own_lock:
            if _own is None:
                _own = OwnStreams()
    return _own


class StreamSet:
    """Owns one dedicated CUDA stream per device, created on first use.

    Communication kernels issued on these streams overlap with compute on the default or
    current stream. By default each stream gets the *highest* priority the device
    offers, so that communication kernels are scheduled ahead of queued compute
    kernels. The streams are the set's own (:class:`OwnStreams`), never torch's pool.

    Thread-safe: concurrent :meth:`get` calls for a device return the same stream.
    """

    def __init__(self, *, priority: int | None = None) -> None:
        """Create an empty set.

        Args:
            priority: CUDA stream priority for every stream of this set (lower numbers are
                higher priorities); None picks the highest priority available.
        """
        self._priority = priority
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def get(self, device: DeviceLike = None) -> torch.cuda.Stream:
        """Return this set's stream for ``device`` (None: the current device), creating it once.

        Raises:
            CudaUnavailable: CUDA (or cuda-bindings) cannot be used.
        """
        index = device_index(device, "StreamSet.get")
        stream = self._streams.get(index)
        if stream is not None:
            return stream
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = own_streams().acquire(index, self._priority)
                self._streams[index] = stream
            return stream

    @property
    def priority(self) -> int:
        """The priority this set's streams are created with (resolved lazily; needs CUDA)."""
        if self._priority is None:
            require_cuda("StreamSet.priority")
            self._priority = own_streams()._priority(device_index(None, "StreamSet.priority"), None)
        return self._priority

    def __len__(self) -> int:
        """Number of streams created so far."""
        return len(self._streams)

    def __repr__(self) -> str:
        return f"StreamSet(devices={sorted(self._streams)}, priority={self._priority})"


# The process-wide default set used by comm_stream(); created on first use, never at import.
_default_set: StreamSet | None = None
_default_set_lock = threading.Lock()


def default_stream_set() -> StreamSet:
    """Return the process-wide :class:`StreamSet` behind :func:`comm_stream`, creating it once."""
    global _default_set
    if _default_set is None:
        with _default_set_lock:
            if _default_set is None:
                _default_set = StreamSet()
    return _default_set


def forget() -> None:
    """Drop the process-wide stream set and own-stream pool (see :func:`streams.reset`)."""
    global _default_set, _own
    with _default_set_lock, _own_lock:
        _default_set = None
        _own = None


def comm_stream(device: DeviceLike = None) -> torch.cuda.Stream:
    """Return the dedicated, highest-priority communication stream of ``device``.

    Args:
        device: ``int``, ``"cuda:N"``, :class:`torch.device`, or None for the current device.

    The same stream object is returned for every call with the same device (it lives in a
    lazily created default :class:`StreamSet`).

    Raises:
        CudaUnavailable: CUDA cannot be used.
    """
    require_cuda("comm_stream")
    return default_stream_set().get(device)


class EventPool:
    """A thread-safe pool of reusable :class:`torch.cuda.Event` objects for one device.

    :meth:`acquire` hands out a released event when there is one, else creates a new one.
    :meth:`release` returns an event to the pool; call it only when nothing will wait on,
    query or synchronize the event's *current* recording any more (re-recording a released
    event is how it is reused). A stream wait already enqueued with ``stream.wait_event`` is
    not affected by a later re-record, so an event may be released right after the last
    ``wait_event`` call and after the host-side watcher has seen it complete.

    Events are created with ``blocking=True`` by default (``cudaEventBlockingSync``), so that
    :meth:`torch.cuda.Event.synchronize` — which :class:`streams.EventWatcher` uses after its
    short spin — puts the waiting thread to sleep instead of spinning a CPU core.
    ``len(pool)`` is the number of free events.
    """

    def __init__(
        self,
        device: DeviceLike,
        *,
        timing: bool = False,
        blocking: bool = True,
        max_free: int | None = None,
        factory: Callable[[], Any] | None = None,
    ) -> None:
        """Create an empty pool.

        Args:
            device: the CUDA device the events are recorded on (checked on first use).
            timing: create events with ``enable_timing=True`` (slower to record).
            blocking: create events with blocking synchronisation (see the class docstring).
            max_free: keep at most this many free events; extra released ones are dropped.
            factory: creates a new event (default: ``torch.cuda.Event`` on ``device``); a
                simulated GPU (``asynccoll.testing.simgpu``) passes its own. With a factory,
                ``device`` must be an ``int`` and no CUDA call is made.
        """
        self._device = device
        self._index: int | None = None
        self.timing = timing
        self.blocking = blocking
        self.max_free = max_free
        self._free: deque[torch.cuda.Event] = deque()
        self._lock = threading.Lock()
        self.created = 0
        self._factory = factory
        if factory is not None:
            if not isinstance(device, int) or isinstance(device, bool):
                raise ValueError(f"EventPool with a factory needs an int device, got {device!r}")
            self._index = device

    @property
    def device(self) -> int:
        """The pool's CUDA device index (needs CUDA)."""
        if self._index is None:
            self._index = device_index(self._device, "EventPool")
        return self._index

    def acquire(self) -> torch.cuda.Event:
        """Return a free event, or a new one when the pool is empty.

        Raises:
            CudaUnavailable: CUDA cannot be used.
        """
        index = self.device
        with self._lock:
            if self._free:
                return self._free.pop()
            self.created += 1
        if self._factory is not None:
            event: torch.cuda.Event = self._factory()
            return event
        with torch.cuda.device(index):
            return torch.cuda.Event(enable_timing=self.timing, blocking=self.blocking)

    def release(self, event: torch.cuda.Event) -> None:
        """Give ``event`` back to the pool for reuse.

        Raises:
            ValueError: the event was recorded on another device.
        """
        ev_device = getattr(event, "device", None)
        if ev_device is not None and ev_device.index != self.device:
            raise ValueError(
                f"event was recorded on {ev_device}, but this pool is for cuda:{self.device}"
            )
        with self._lock:
            if self.max_free is None or len(self._free) < self.max_free:
                self._free.append(event)

    def __len__(self) -> int:
        """The number of free events."""
        return len(self._free)

    def __repr__(self) -> str:
        return (
            f"EventPool(device={self._device!r}, timing={self.timing}, "
            f"blocking={self.blocking}, free={len(self._free)}, created={self.created})"
        )
