"""One launch thread per CUDA device, shared by every NCCL communicator on it.

Since NCCL 2.26, communicators that share a device must launch in the same host
order on every rank (``NCCL_LAUNCH_ORDER_IMPLICIT`` orders a device's kernels by host
launch order, NCCL src/enqueue.cc ``getImplicitOrder``), and host threads racing to
launch on one device are a fatal error (``NCCL_LAUNCH_RACE_FATAL``, on by default,
src/misc/strongstream.cc); before 2.26 concurrent communicators may deadlock (NCCL
docs, "Using multiple NCCL communicators concurrently"). One thread per device,
taking the jobs of all its communicators in the order they were issued, gives every
rank the host order its program issued — the same order, as collectives require.

A :class:`Lane` is a process-wide service: started by its first communicator,
ended when its last one leaves. Its queue holds *members* (one entry per job
issued); each member keeps its own jobs, so an aborted member drops them at once.

Every launch runs on the lane's thread, never on the caller's: a launch on the
caller's thread when the lane is idle was built and measured on an H100 (NCCL
2.28.9) and lost, since NCCL starts a thread for every non-blocking launch
(src/group.cc 736 at v2.28.9-1) and that start then ran on the caller's thread: its
issue cost rose from 53-74 to 128-131 us of thread CPU and the event loop stalled
23-25 ms (docs/performance.md, "Launching on the caller's thread").
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Protocol


class Member(Protocol):
    """What a lane needs from a communicator's backend."""

    health_interval: float

    def launch_next(self) -> None:
        """Launch the member's oldest queued job (nothing if it has none)."""

    def busy(self) -> bool:
        """Whether it has jobs in flight (that a health check should poll)."""

    def health_check(self) -> None:
        """Poll the communicator for an asynchronous error."""


class _Marker:
    """Reached by the lane once every job queued before it was launched."""

    def __init__(self) -> None:
        self.reached = threading.Event()


_STOP = object()


class Lane:
    """The launch thread of one CUDA device (see the module docstring)."""

    def __init__(self, index: int, bind: Any) -> None:
        self.index = index
        self._bind = bind
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._members: set[Any] = set()
        self.thread = threading.Thread(
            target=self._run, name=f"asynccoll-nccl-launch-{index}", daemon=True
        )
        self.thread.start()

    def post(self, member: Member) -> None:
        """One job of ``member`` was queued: the lane's thread launches it in this order."""
        self._queue.put(member)

    def drained(self, timeout: float) -> bool:
        """Wait (bounded) until everything posted before this call was launched."""
        if threading.current_thread() is self.thread:
            return True
        marker = _Marker()
        self.post(marker)  # type: ignore[arg-type]
        return marker.reached.wait(timeout)

    def _run(self) -> None:
        try:
            self._bind(self.index)
        except Exception:  # noqa: BLE001, S110 - a bad device shows up as the first launch's error
            pass
        get = self._queue.get
        next_check = 0.0
        while True:
            with _LOCK:
                members = list(self._members)
            busy = [m for m in members if m.busy()]
            try:
                item = get(timeout=min(m.health_interval for m in busy)) if busy else get()
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            if isinstance(item, _Marker):
                item.reached.set()
            elif item is not None:
                item.launch_next()
            now = time.monotonic()
            if busy and (item is None or now >= next_check):
                next_check = now + min(m.health_interval for m in busy)
                for m in busy:
                    m.health_check()


_LANES: dict[int, Lane] = {}
_LOCK = threading.Lock()


def join(index: int, member: Member, bind: Any) -> Lane:
    """``member`` launches on device ``index`` from now on; the device's lane (started if none)."""
    with _LOCK:
        lane = _LANES.get(index)
        if lane is None:
            lane = _LANES[index] = Lane(index, bind)
        lane._members.add(member)
        return lane


def leave(lane: Lane, member: Member) -> None:
    """``member`` is done with ``lane``; the last one to leave ends the thread."""
    with _LOCK:
        lane._members.discard(member)
        if lane._members or _LANES.get(lane.index) is not lane:
            return
        del _LANES[lane.index]
    lane._queue.put(_STOP)
