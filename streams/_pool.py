"""Dedicated communication streams per device and a pool of reusable CUDA events."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable

import torch

from ._errors import DeviceLike, device_index, require_cuda

__all__ = ["EventPool", "StreamSet", "comm_stream"]


class StreamSet:
    """Owns one dedicated CUDA stream per device, created on first use.

    Communication kernels issued on these streams overlap with compute on the default or
    current stream. By default each stream gets the *highest* priority that
    :meth:`torch.cuda.Stream.priority_range` reports, so that communication kernels are
    scheduled ahead of queued compute kernels.

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
            CudaUnavailable: CUDA cannot be used.
        """
        index = device_index(device, "StreamSet.get")
        stream = self._streams.get(index)
        if stream is not None:
            return stream
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = torch.cuda.Stream(device=index, priority=self.priority)
                self._streams[index] = stream
            return stream

    @property
    def priority(self) -> int:
        """The priority this set's streams are created with (resolved lazily; needs CUDA)."""
        if self._priority is None:
            require_cuda("StreamSet.priority")
            # priority_range() is (least, greatest); numerically lower is higher priority.
            self._priority = min(torch.cuda.Stream.priority_range())  # type: ignore[call-arg]
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
