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

The lane is one launch order, not one thread: a job issued while the lane is idle
(nothing queued, nothing launching) is launched on the caller's thread at once
(:meth:`Lane.launch`), which costs no thread hop; the lane's thread launches what
is issued while it is busy, in order after it. A launch that NCCL leaves in
``ncclInProgress`` (a non-blocking communicator deferring its kernel) is never
polled on the caller's thread (an event loop): the lane's thread finishes it, and
later jobs queue behind it.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Protocol


class Member(Protocol):
    """What a lane needs from a communicator's backend."""

    health_interval: float

    def launch_next(self, inline: bool = False) -> bool:
        """Launch the member's oldest queued job (nothing if it has none). ``inline``: on
        the caller's thread, which must not wait for NCCL to leave ``ncclInProgress``;
        False then means that the lane's thread must finish it (:meth:`finish_launch`)."""

    def finish_launch(self) -> None:
        """Lane thread: finish the launch that :meth:`launch_next` left in progress."""

    def busy(self) -> bool:
        """Whether it has jobs in flight (that a health check should poll)."""

    def health_check(self) -> None:
        """Poll the communicator for an asynchronous error."""


class _Finish:
    """A launch left in progress on a caller's thread, for the lane's thread to finish."""

    __slots__ = ("member",)

    def __init__(self, member: Member) -> None:
        self.member = member


class _Marker:
    """Reached by the lane once every job queued before it was launched."""

    def __init__(self) -> None:
        self.reached = threading.Event()


_STOP = object()


class Lane:
    """The launch thread of one CUDA device (see the module docstring)."""

    #: Launch on the caller's thread when idle. Off, as measured: on an H100 (NCCL 2.28.9)
    #: the caller's issue cost rose from 53-74 to 128-131 us of thread CPU and the event
    #: loop stalled 23-25 ms, since NCCL starts a thread for every non-blocking launch
    #: (src/group.cc 736 at v2.28.9-1) and that start then runs on the caller's thread
    #: (docs/performance.md, "Launching on the caller's thread"). While off, nothing
    #: tests the inline path (its tests went with the revert). Kept for one more
    #: measurement (a blocking communicator launched inline), not as a second way to
    #: launch: remove it if that loses too.
    inline = False

    def __init__(self, index: int, bind: Any) -> None:
        self.index = index
        self._bind = bind
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # The launch order: ``_backlog`` items posted and not yet run by the thread, and
        # whether a launch is under way (``_busy``, on a caller's thread or the lane's).
        self._turn = threading.Condition(threading.Lock())
        self._backlog = 0
        self._busy = False
        self._dormant = False  # the thread sleeps with no timeout (no health checks due)
        self._members: set[Any] = set()
        self.thread = threading.Thread(
            target=self._run, name=f"asynccoll-nccl-launch-{index}", daemon=True
        )
        self.thread.start()

    def launch(self, member: Member) -> None:
        """One job of ``member`` was queued: launch it here and now if the lane is idle,
        else post it: the lane's thread launches it in this order."""
        turn = self._turn
        with turn:
            if self._backlog or self._busy or not self.inline:
                self._backlog += 1
                self._queue.put(member)
                return
            self._busy = True
        finished = True
        try:
            finished = member.launch_next(inline=True)
        finally:
            with turn:
                if not finished:  # in progress: the thread finishes it, before anything else
                    self._backlog += 1
                    self._queue.put(_Finish(member))
                elif self._dormant and member.busy():  # in flight now: health checks are due
                    self._dormant = False
                    self._queue.put(None)
                self._busy = False
                if self._backlog:
                    turn.notify()

    def post(self, member: Member) -> None:
        """One job of ``member`` was queued: the lane's thread launches it in this order."""
        with self._turn:
            self._backlog += 1
            self._queue.put(member)

    def drained(self, timeout: float) -> bool:
        """Wait (bounded) until everything posted before this call was launched."""
        if threading.current_thread() is self.thread:
            return True
        marker = _Marker()
        self.post(marker)  # type: ignore[arg-type]
        return marker.reached.wait(timeout)

    def _take_turn(self) -> None:
        with self._turn:
            while self._busy:
                self._turn.wait()
            self._busy = True

    def _end_turn(self) -> None:
        with self._turn:
            self._busy = False
            self._backlog -= 1

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
            with self._turn:  # against an inline launch (``launch``: the dormant check)
                busy = [m for m in members if m.busy()]
                self._dormant = not busy
            try:
                item = get(timeout=min(m.health_interval for m in busy)) if busy else get()
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            if item is not None:
                self._take_turn()
                try:
                    if isinstance(item, _Marker):
                        item.reached.set()
                    elif isinstance(item, _Finish):
                        item.member.finish_launch()
                    else:
                        item.launch_next()
                finally:
                    self._end_turn()
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
