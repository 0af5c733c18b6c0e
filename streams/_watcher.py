"""Turning CUDA event completion into event-loop wake-ups: one watcher thread per device.

How a watcher waits for one event (``mode``):

* Both modes first *spin* on ``event.query()`` for ``spin`` seconds (default 50 µs). Short
  operations complete inside the spin, so their wake-up latency is a few microseconds.
* ``mode="sync"`` (default) then calls ``event.synchronize()``. Torch releases the GIL there,
  so the event loop and other threads run freely; the watcher thread sleeps in the driver if
  the event was created with ``blocking=True`` (what :class:`streams.EventPool` does), and is
  parked in the driver's own spin/yield loop otherwise — that costs CPU on the watcher thread,
  never on the loop. The catch: a thread inside ``synchronize()`` cannot be interrupted, so
  :meth:`EventWatcher.close` cannot stop it before the event completes (it is a daemon thread,
  and ``close`` is bounded by its timeout regardless).
* ``mode="poll"`` then calls ``event.query()`` with a sleep between calls that doubles from
  ``spin`` up to ``poll_interval`` (default 1 ms). Use it for events whose ``synchronize()``
  would hold the GIL or spin, or to keep ``close`` able to interrupt a wait. Its latency for
  long operations is up to ``poll_interval``.

The watcher never polls on the event loop thread: completions reach the loop through a
:class:`streams.LoopWaker`, batched.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Hashable, Literal, NamedTuple, Protocol

from ._waker import loop_waker

__all__ = ["EventWatcher", "WatcherClosed", "default_watcher", "wait_event"]

_log = logging.getLogger("streams")


class EventLike(Protocol):
    """What a watcher needs from an event: :class:`torch.cuda.Event` satisfies it."""

    def query(self) -> bool:
        """True once all work recorded before the event has completed."""
        ...

    def synchronize(self) -> None:
        """Block until the event has completed."""
        ...


class WatcherClosed(RuntimeError):
    """The watcher was closed before the event was seen to complete."""


class _Entry(NamedTuple):
    event: EventLike
    callback: Callable[..., Any]
    args: tuple[Any, ...]
    on_fail: Callable[[BaseException], Any] | None


def _report(message: str, exc: BaseException) -> None:
    """Report an exception raised by a user callback without stopping anything."""
    _log.error(message, exc_info=(type(exc), exc, exc.__traceback__))


class EventWatcher:
    """Waits for events on one daemon thread and runs a callback after each completes.

    Events are waited for strictly in the order they were passed to :meth:`watch` (the head of
    the queue first), so callbacks run in issue order even when a later event completes first.
    That matches a single CUDA stream, where a later event cannot complete before an earlier
    one, and costs nothing more than the latency of the slowest earlier event otherwise.

    Callbacks run on the watcher thread and should be short (e.g. :meth:`LoopWaker.post`).
    An exception from a callback is reported (``error_handler``, default: logged to the
    ``"streams"`` logger) and never stops the thread.

    The thread is started on the first :meth:`watch`, is named
    ``streams-watcher-<device>``, and is the only thread a watcher ever creates. See the
    module docstring for ``mode``, ``spin`` and ``poll_interval``.
    """

    def __init__(
        self,
        device: Hashable = None,
        *,
        mode: Literal["sync", "poll"] = "sync",
        spin: float = 50e-6,
        poll_interval: float = 1e-3,
        error_handler: Callable[[str, BaseException], Any] | None = None,
        cuda_device: int | None = None,
    ) -> None:
        """Create an idle watcher (no thread yet).

        Args:
            device: a label (anything hashable), used in the thread name and repr.
            mode: ``"sync"`` or ``"poll"``, how to wait after spinning (module docstring).
            spin: seconds to spin on ``query()`` before falling back; 0 disables spinning.
            poll_interval: longest sleep between queries in ``"poll"`` mode.
            error_handler: called as ``error_handler(message, exc)`` when a callback raises
                or a wait fails without ``on_fail``; default: log to the ``"streams"`` logger.
            cuda_device: the CUDA device of the events, made current on the thread before
                its first wait. torch's ``Event.query``/``synchronize`` have no device guard
                (ATen/cuda/CUDAEvent.h): on a thread that never set its device they run on
                device 0 and create its primary context (hundreds of MB on GPU 0; an error
                in EXCLUSIVE_PROCESS mode).
        """
        if mode not in ("sync", "poll"):
            raise ValueError(f"mode must be 'sync' or 'poll', got {mode!r}")
        if spin < 0 or poll_interval <= 0:
            raise ValueError("spin must be >= 0 and poll_interval > 0")
        self.device = device
        self.mode = mode
        self.spin = spin
        self.poll_interval = poll_interval
        self._error_handler = error_handler or _report
        self.cuda_device = cuda_device
        self._queue: deque[_Entry] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._current: _Entry | None = None  # the entry being waited for, popped from _queue
        self._idle = False  # True while the thread waits on _cond for work
        self._closed = False  # no more watch() calls
        self._abort = False  # discard queued entries; "poll" mode also gives up its wait

    # -- public API ------------------------------------------------------------------------

    def watch(
        self,
        event: EventLike,
        callback: Callable[..., Any],
        /,
        *args: Any,
        on_fail: Callable[[BaseException], Any] | None = None,
    ) -> None:
        """Call ``callback(*args)`` on the watcher thread once ``event`` has completed.

        Thread-safe and cheap: appends to a deque, and notifies the thread only when it is
        idle. Never blocks on the event.

        Args:
            event: anything with ``query() -> bool`` and ``synchronize()``.
            callback: called with ``*args`` after the event and all earlier ones completed.
            on_fail: called with the exception instead of ``callback`` if waiting raises
                (e.g. a CUDA error) or the entry is discarded by :meth:`close`
                (:class:`WatcherClosed`).

        Raises:
            WatcherClosed: the watcher has been closed.
        """
        entry = _Entry(event, callback, args, on_fail)
        with self._cond:
            if self._closed:
                raise WatcherClosed(f"{self!r} is closed")
            self._queue.append(entry)
            if self._thread is None:
                self._start()
            elif self._idle:
                self._cond.notify()

    @property
    def pending(self) -> int:
        """Entries whose event has not been seen to complete yet (queued or being waited)."""
        return len(self._queue) + (self._current is not None)

    @property
    def thread(self) -> threading.Thread | None:
        """The watcher thread, or None before the first :meth:`watch`."""
        return self._thread

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def close(self, timeout: float | None = 5.0, *, drain: bool = True) -> bool:
        """Stop the watcher; idempotent and bounded by ``timeout``.

        With ``drain=True`` the thread first waits for every entry queued before ``close``
        and runs their callbacks; entries still queued after ``timeout`` seconds are
        discarded. With ``drain=False`` queued entries are discarded at once. Discarded
        entries get ``on_fail(WatcherClosed(...))``; their callbacks never run. An event the
        thread is already waiting for in ``"sync"`` mode cannot be interrupted (its callback
        runs when it completes); the thread is a daemon and does not keep the process alive.

        Returns:
            True if the thread has stopped (or never started), False if it is still inside a
            wait when ``timeout`` expires.
        """
        with self._cond:
            self._closed = True
            if not drain:
                self._abort = True
            self._cond.notify_all()
            thread = self._thread
        if not drain:
            self._discard()
        if thread is None:
            return True
        if thread is threading.current_thread():  # close() called from a callback
            return False
        thread.join(timeout)
        if thread.is_alive():
            with self._cond:
                self._abort = True
            self._discard()
            return False
        return True

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"EventWatcher(device={self.device!r}, mode={self.mode!r}, {state}, "
            f"pending={self.pending})"
        )

    # -- thread --------------------------------------------------------------------------

    def _start(self) -> None:
        """Start the thread (called with the lock held, once)."""
        self._thread = threading.Thread(
            target=self._run, name=f"streams-watcher-{self.device}", daemon=True
        )
        self._thread.start()

    def _discard(self) -> None:
        """Fail every queued (not yet waited-for) entry with WatcherClosed."""
        with self._cond:
            dropped = list(self._queue)
            self._queue.clear()
        for entry in dropped:
            self._fail(entry, WatcherClosed(f"{self!r} closed before the event completed"))

    def _run(self) -> None:
        if self.cuda_device is not None:
            try:
                import torch

                torch.cuda.set_device(self.cuda_device)
            except Exception as exc:  # noqa: BLE001 - reported; waits then fail where the device is unusable
                self._error_handler(f"{self!r} could not select cuda:{self.cuda_device}", exc)
        cond = self._cond
        while True:
            with cond:
                while not self._queue and not self._closed:
                    self._idle = True
                    cond.wait()
                self._idle = False
                if not self._queue or self._abort:
                    break
                entry = self._current = self._queue.popleft()
            try:
                done = self._wait(entry.event)
            except Exception as exc:  # noqa: BLE001 - any failure here is reported, not raised (see the surrounding code)
                self._current = None
                self._fail(entry, exc)
                continue
            self._current = None
            if not done:  # "poll" mode gave up because of close(drain=False)
                self._fail(entry, WatcherClosed(f"{self!r} closed before the event completed"))
                continue
            try:
                entry.callback(*entry.args)
            except Exception as exc:  # noqa: BLE001 - any failure here is reported, not raised (see the surrounding code)
                self._error_handler(f"exception in EventWatcher callback {entry.callback!r}", exc)
        self._discard()

    def _wait(self, event: EventLike) -> bool:
        """Wait for ``event``; False if abandoned because of close (poll mode only)."""
        if event.query():
            return True
        if self.spin > 0:
            deadline = time.perf_counter() + self.spin
            while time.perf_counter() < deadline:
                if event.query():
                    return True
        if self.mode == "sync":
            event.synchronize()
            return True
        delay = max(self.spin, 1e-5)
        while not event.query():
            if self._abort:
                return False
            time.sleep(delay)
            delay = min(delay * 2, self.poll_interval)
        return True

    def _fail(self, entry: _Entry, exc: BaseException) -> None:
        if entry.on_fail is None:
            self._error_handler(f"EventWatcher could not wait for {entry.event!r}", exc)
            return
        try:
            entry.on_fail(exc)
        except Exception as exc2:  # noqa: BLE001 - any failure here is reported, not raised (see the surrounding code)
            self._error_handler(f"exception in EventWatcher on_fail {entry.on_fail!r}", exc2)


# Default watchers, one per device key, created on first use (never at import).
_defaults: dict[Hashable, EventWatcher] = {}
_defaults_lock = threading.Lock()


def default_watcher(device: Hashable = None) -> EventWatcher:
    """Return the process-wide default :class:`EventWatcher` for ``device``, creating it once.

    ``device`` is a CUDA device index, or None for the watcher shared by events whose device
    is unknown. A default watcher that has been closed is replaced by a fresh one.
    """
    watcher = _defaults.get(device)
    if watcher is None or watcher.closed:
        with _defaults_lock:
            watcher = _defaults.get(device)
            if watcher is None or watcher.closed:
                label = "shared" if device is None else device
                cuda = device if isinstance(device, int) and not isinstance(device, bool) else None
                watcher = _defaults[device] = EventWatcher(label, cuda_device=cuda)
    return watcher


def forget() -> None:
    """Close and drop the default watchers (see :func:`streams.reset`)."""
    with _defaults_lock:
        watchers = list(_defaults.values())
        _defaults.clear()
    for w in watchers:
        w.close(timeout=1.0, drain=False)


def _event_device(event: Any) -> Hashable:
    """The CUDA device index an event was recorded on, if it says (torch events do)."""
    device = getattr(event, "device", None)
    index = getattr(device, "index", None)
    return index if isinstance(index, int) else None


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():  # a cancelled waiter is simply ignored
        fut.set_result(None)


def _reject(fut: asyncio.Future[None], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


async def wait_event(event: EventLike, *, watcher: EventWatcher | None = None) -> None:
    """Wait, without blocking the event loop, until ``event`` has completed.

    Returns at once if ``event.query()`` is already true. Otherwise the event is queued on
    ``watcher`` (default: :func:`default_watcher` of the event's device) and the calling task
    sleeps on a future that the watcher thread resolves through the running loop's
    :class:`LoopWaker`. Works under asyncio and uvloop.

    Cancelling the awaiting task is safe: the watcher still waits for the event and its
    wake-up for the cancelled future is ignored. Failures while waiting (CUDA errors) and
    closing the watcher first (:class:`WatcherClosed`) are raised here.
    """
    if event.query():
        return
    loop = asyncio.get_running_loop()
    waker = loop_waker(loop)
    fut: asyncio.Future[None] = loop.create_future()
    if watcher is None:
        watcher = default_watcher(_event_device(event))
    watcher.watch(
        event, waker.post, _resolve, fut, on_fail=lambda exc: waker.post(_reject, fut, exc)
    )
    await fut
