"""The loop-adapter seam: the few places where asyncio and trio differ.

Everything here works under asyncio, uvloop and trio (directly or through anyio).
The hot path — awaiting a :class:`~asynccoll.Work` and waking its waiters — lives
in ``work.py`` and uses each library's own primitives (an asyncio future woken
through the loop's batched waker; trio's ``wait_task_rescheduled`` woken through
the run's token); the rest — running blocking set-up off the loop on daemon
threads, bounded waits — uses anyio's cancel scopes, and no anyio worker thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from typing import Any, Awaitable, Callable

import anyio

from . import shutdown

#: This thread's running asyncio loop, or None (asyncio's C function: no exception, no
#: Python frame; the hot path asks it on every await). The one place that reaches for it.
running_loop = asyncio._get_running_loop


def trio_running() -> bool:
    """True inside ``trio.run`` (and no asyncio loop runs in this thread)."""
    if running_loop() is not None:
        return False
    import sniffio

    try:
        return sniffio.current_async_library() == "trio"
    except sniffio.AsyncLibraryNotFoundError:  # no async library runs in this thread
        return False


def current_task() -> object | None:
    """The running task (asyncio or trio), or None outside any."""
    if running_loop() is not None:
        return asyncio.current_task()
    if trio_running():
        import trio

        return trio.lowlevel.current_task()
    return None


#: A set-up job: runs the blocking work, returns how to hand its outcome over.
_Job = Callable[[], Callable[[], None]]

#: How long a set-up thread waits idle for its next job before it ends.
_IDLE_S = 1.0


class _Worker:
    """A daemon thread that runs set-up jobs one after the other (see :class:`_Workers`)."""

    def __init__(self, workers: _Workers, job: _Job, name: str) -> None:
        self._workers = workers
        #: The next job and its thread name; ``None``: end (set under the workers' lock).
        self.next: tuple[_Job, str] | None = (job, name)
        self.given = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            assert self.next is not None
            (job, me.name), self.next = self.next, None
            shutdown.register_native_thread(me)  # a torch constructor may run in it at exit
            try:
                deliver = job()
            finally:
                # Nothing of the job outlives it here: a store or a group it made, kept by
                # an idle thread, was destroyed in it at exit, under finalization (C++
                # destructors in a daemon thread then: "terminate called without an
                # active exception", seen in 3 of 12 runs of the simulated-GPU bench).
                del job
                shutdown.unregister_native_thread(me)
                me.name = "asynccoll-setup-idle"
            # Idle before the outcome is out: the waiter's next hop, at once, finds this
            # thread (listed after it, it raced the waiter and lost on a busy machine).
            listed = self._workers.idle(self)
            deliver()
            del deliver
            if not (listed and self._workers.wait(self)):
                return


class _Workers:
    """The process's set-up threads (``run_in_thread``): daemons, each reused while idle
    for up to ``_IDLE_S``, so that a hop off the loop wakes a waiting thread instead of
    starting one (on a busy machine a new thread starts behind every running one: 0.1
    to 4 ms measured with two ranks on two cores, against 0.1 ms for a woken one). A
    job that blocks for long holds only its own thread: the next job gets another.
    Idle threads end at exit (``shutdown.on_exit``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        shutdown.on_exit(self._end)

    def start(self, job: _Job, name: str) -> None:
        with self._lock:
            if self._idle:
                worker = self._idle.pop()  # the last to go idle: its stack is warm
                worker.next = (job, name)
                worker.given.set()
                return
        worker = _Worker(self, job, name)
        worker.thread.start()

    def idle(self, worker: _Worker) -> bool:
        """List ``worker`` as idle (False: the process exits; it ends instead)."""
        with self._lock:
            if shutdown.exiting():
                return False
            self._idle.append(worker)
            return True

    def wait(self, worker: _Worker) -> bool:
        """Wait for the idle ``worker``'s next job: in ``worker.next`` (True), or it ends
        (False)."""
        if not worker.given.wait(_IDLE_S):
            with self._lock:
                if worker in self._idle:  # no job was given meanwhile: end
                    self._idle.remove(worker)
                    return False
            worker.given.wait()  # given under the lock: set by now
        worker.given.clear()
        return worker.next is not None

    def _end(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            for worker in idle:
                worker.next = None
                worker.given.set()


_WORKERS = _Workers()


def spawn(fn: Callable[[], Any], name: str) -> concurrent.futures.Future[Any]:
    """Run blocking ``fn`` on a set-up thread; its outcome is the future's (for a caller
    that goes on meanwhile; :func:`run_in_thread` waits for it)."""
    result: concurrent.futures.Future[Any] = concurrent.futures.Future()
    # Running from the start: a waiter that gives up (asyncio.wrap_future cancels the
    # future it wraps) cannot cancel it, so fn's outcome still reaches ``on_late``.
    result.set_running_or_notify_cancel()

    def job() -> Callable[[], None]:
        """Run ``fn``; return how to hand its outcome over (after the thread is idle)."""
        try:
            value = fn()
        except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting task
            return functools.partial(result.set_exception, exc)
        return functools.partial(result.set_result, value)

    _WORKERS.start(job, name)
    return result


async def _result(future: concurrent.futures.Future[Any]) -> Any:
    """The result of ``future`` (set by another thread), woken by that thread.

    No thread of ours waits for it: anyio's worker threads are not daemons, and
    one parked in ``future.result()`` while ``fn`` sits in a C++ call (a TCPStore
    or Gloo constructor) held interpreter shutdown for tens of seconds after
    Ctrl-C or a timeout.
    """
    if not trio_running():
        return await asyncio.wrap_future(future)
    import trio

    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def wake(_: concurrent.futures.Future[Any]) -> None:
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:  # the run ended meanwhile: nobody waits any more
            pass

    future.add_done_callback(wake)
    await done.wait()
    return future.result()


async def run_in_thread(
    fn: Callable[[], Any],
    timeout: float | None,
    *,
    on_late: Callable[[Any], None] | None = None,
    name: str = "asynccoll-setup",
) -> Any:
    """Run blocking ``fn`` on a set-up thread (one of its own until it returns) without
    blocking the loop.

    Raises the builtin ``TimeoutError`` after ``timeout`` seconds. If the wait times
    out or is cancelled, ``fn`` keeps running (a blocking call cannot be
    interrupted) and ``on_late(result)`` receives its result if it still succeeds,
    so whatever it acquired can be given back.
    """
    return await wait_for(spawn(fn, name), timeout, on_late=on_late)


async def wait_for(
    future: concurrent.futures.Future[Any],
    timeout: float | None,
    *,
    on_late: Callable[[Any], None] | None = None,
) -> Any:
    """The outcome of a set-up thread's job (:func:`spawn`), as :func:`run_in_thread`
    waits for it: ``TimeoutError`` after ``timeout``; a wait that ends before the job
    (timed out, cancelled) hands its result, if it succeeds, to ``on_late``."""
    try:
        with anyio.fail_after(timeout):
            return await _result(future)
    except BaseException:
        if on_late is not None:
            late_for(future, on_late)
        raise


def late_for(future: concurrent.futures.Future[Any], on_late: Callable[[Any], None]) -> None:
    """``on_late(result)`` once ``future`` succeeds (nothing if it fails)."""

    def late(f: concurrent.futures.Future[Any]) -> None:
        if f.exception() is None:
            on_late(f.result())

    future.add_done_callback(late)


async def settle_within(waitables: list[Any], timeout: float) -> int:
    """Await each of ``waitables`` (ignoring their errors) for at most ``timeout``
    seconds in all; returns how many were not done by then."""
    with anyio.move_on_after(timeout):
        for w in waitables:
            try:
                await w
            except Exception:  # noqa: BLE001 - only the end matters, not the outcome
                continue
    return sum(1 for w in waitables if not w.done())


async def race(primary: Callable[[], Awaitable[Any]], guard: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``primary`` (a creation) and ``guard`` (a watch over it); the first to finish
    cancels the other. ``primary``'s result if it has one (a creation that ended as the
    watch fired is up on every member), else the first error as it is (raised out of
    the task group it would come wrapped in an ExceptionGroup, which no ``except`` of
    the contract's errors catches), else ``guard``'s result."""
    results: dict[int, Any] = {}
    errors: list[Exception] = []
    async with anyio.create_task_group() as tg:

        async def run(index: int, fn: Callable[[], Awaitable[Any]]) -> None:
            try:
                results[index] = await fn()
            except Exception as exc:  # noqa: BLE001 - raised below, unwrapped
                errors.append(exc)
            tg.cancel_scope.cancel()

        tg.start_soon(run, 0, primary)
        tg.start_soon(run, 1, guard)
    if 0 in results:
        return results[0]
    if errors:
        raise errors[0]
    return results[1]
