"""Waking whoever waits on a Work (``work.py``).

``Wakeups`` gathers the wake-ups of a burst of settled Works and delivers them
once per loop. A Work keeps its waiters in one list: asyncio futures (resolved by
the Work itself) and the kinds below, each of which wakes itself (``notify``): a
trio task, a thread blocked in ``Work.wait()``, a done callback.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any, Callable

from .._base.aio import running_loop


class Wakeups:
    """Wake-ups gathered while settling a burst of Works, delivered once per loop.

    ``deliver()`` posts each loop's items in ONE call: ``call_soon`` for the calling
    thread's own running loop (never inline: a Work may be settled inside another
    call on that thread — an await, an issue — whose caller must not see user
    callbacks run in the middle of it), ``call_soon_threadsafe`` for any other (trio:
    ``run_sync_soon``), so settling a thousand Works costs each loop one wake-up.
    (Measured against ``streams.LoopWaker``'s extra queue: the plain call is
    15-28 µs faster per small op, and the completion thread already batches.)

    ``running`` is the settling thread's own running loop (None off a loop): an
    asyncio future of THAT loop is resolved by the Work at once instead of through
    ``add`` (``Future.set_result`` runs nothing inline, it schedules the waiting
    task with ``call_soon``), which saves an abort of a thousand waiters a loop
    iteration and three tuples per waiter.

    ``later`` holds what the settled Works let go of (kept tensors, results an
    abort replaced): freeing a thousand tensors costs more than failing their
    Works, so they are dropped after the waiters ran — on the running loop by a
    callback queued behind the tasks that ``deliver`` woke, elsewhere once the
    wake-ups are posted.
    """

    __slots__ = ("_by_loop", "running", "later")

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Callable[[Any], Any], Any]]] = {}
        self.running = running_loop()
        self.later: list[Any] | None = None  # (made by whoever has something to drop)

    def add(self, loop: asyncio.AbstractEventLoop, fn: Callable[[Any], Any], arg: Any) -> None:
        items = self._by_loop.get(loop)
        if items is None:
            self._by_loop[loop] = [(fn, arg)]
        else:
            items.append((fn, arg))

    def deliver(self) -> None:
        if self._by_loop:
            self._post()
        later = self.later
        if later:
            self.later = None
            if self.running is not None:  # behind every task woken so far (futures call_soon too)
                self.running.call_soon(later.clear)
            # else: dropped here, on return, after the wake-ups went out

    def _post(self) -> None:
        running = self.running
        for loop, items in self._by_loop.items():
            if loop is running:
                loop.call_soon(_run_all, items)
                continue
            try:
                if isinstance(loop, asyncio.AbstractEventLoop):
                    loop.call_soon_threadsafe(_run_all, items)
                else:  # a trio run's token
                    loop.run_sync_soon(_run_all, items)
            except RuntimeError:  # closed loop, or trio.RunFinishedError: nobody is left to wake
                continue
        self._by_loop = {}


def _run_all(items: list[tuple[Callable[[Any], Any], Any]]) -> None:
    for fn, arg in items:
        fn(arg)


# ------------------------------------------------- who waits on a Work
class TrioWaiter:
    """A trio task parked on a Work; woken on its own run through the run's token."""

    __slots__ = ("task", "token")

    def __init__(self, task: Any, token: Any) -> None:
        self.task = task
        self.token = token

    def notify(self, work: Any, wake: Wakeups) -> None:  # the Work settled: wake on the trio thread
        wake.add(self.token, TrioWaiter.wake, self)

    def wake(self) -> None:  # on the trio thread (Wakeups call it with the waiter)
        task, self.task = self.task, None
        if task is not None:
            import trio

            trio.lowlevel.reschedule(task)


class Blocked(threading.Event):
    """A thread blocked in ``Work.wait()``."""

    def notify(self, work: Any, wake: Wakeups) -> None:
        self.set()


class Callback:
    """A done callback: run on ``loop`` (None: at once, on the settling thread)."""

    __slots__ = ("loop", "fn")

    def __init__(self, loop: Any, fn: Callable[[Any], Any]) -> None:
        self.loop = loop
        self.fn = fn

    def notify(self, work: Any, wake: Wakeups) -> None:
        if self.loop is None:
            work._run_callback(self.fn)
        else:
            wake.add(self.loop, work._run_callback, self.fn)


#: The waiters that are not asyncio futures (each wakes itself: ``notify``).
OTHER_WAITERS = frozenset((TrioWaiter, Blocked, Callback))


def trio_token() -> Any:
    """The current trio run's token, or None outside trio."""
    trio = sys.modules.get("trio")
    if trio is None:
        return None
    try:
        return trio.lowlevel.current_trio_token()
    except RuntimeError:  # not inside trio.run
        return None


def succeed_future(fut: asyncio.Future[Any], value: Any) -> None:
    fut.set_result(value)


def fail_future(fut: asyncio.Future[Any], exc: Any) -> None:
    fut.set_exception(exc)


def resolve_future(
    item: tuple[asyncio.Future[Any], tuple[Callable[[asyncio.Future[Any], Any], None], Any]],
) -> None:
    """On the waiter's loop: give its future the Work's outcome (unless it was cancelled)."""
    fut, (how, value) = item
    if not fut.done():
        how(fut, value)
