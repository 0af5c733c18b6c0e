"""Work: the handle of one issued operation, awaitable from any loop or thread.

A Work is settled exactly once, by the communicator's ledger (``ledger.py``), from
whatever thread learns the outcome (a backend's completion thread, the deadline
service, ``abort()`` on any thread). Settling sets the state at once, so every
waiter — on any event loop, or blocked in ``wait()`` on any thread — sees the
outcome without depending on the loop that issued the op. Waking is batched by
the ledger (:class:`Wakeups`): one wake-up per event loop for a whole burst.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any, Callable, Generator

_PENDING = 0
_DONE = 1
_FAILED = 2

_get_running_loop = asyncio._get_running_loop


class Work:
    """Handle of an issued collective: ``await work`` yields its result.

    Cancelling a task that awaits a Work cancels only the waiting: the operation
    keeps running and its tensors stay referenced until it completes.
    """

    __slots__ = (
        "op",
        "seq",
        "_state",
        "_value",
        "_lock",
        "_waiters",
        "_callbacks",
        "_event",
        "_keep",
        "_stream_hook",
        "__weakref__",
    )

    def __init__(self, op: str, seq: int, value: Any = None, keep: Any = None) -> None:
        self.op = op
        self.seq = seq
        self._state = _PENDING
        # The result on success (known at issue time for in-place ops), the
        # exception on failure.
        self._value = value
        # Tensors that must outlive the operation (allocator safety, §3).
        self._keep = keep
        self._lock = threading.Lock()
        # Futures of awaiting tasks, on any loop.
        self._waiters: list[Any] | None = None  # asyncio futures and _TrioWaiter s
        self._callbacks: list[tuple[asyncio.AbstractEventLoop | None, Callable[[Work], Any]]] | None = None
        self._event: threading.Event | None = None
        # Set by device backends: makes a stream wait for the op (``wait_stream``).
        self._stream_hook: Callable[[Any], None] | None = None

    # ------------------------------------------------------------------ settle
    def _settle(self, state: int, value: Any, wake: Wakeups) -> bool:
        """Mark the outcome (any thread; only the ledger calls this). Waiters go to ``wake``.

        Returns False if the Work was already settled.
        """
        with self._lock:
            if self._state != _PENDING:
                return False
            self._state = state
            if state == _FAILED or value is not None:
                self._value = value
            waiters, self._waiters = self._waiters, None
            callbacks, self._callbacks = self._callbacks, None
            event = self._event
        self._keep = None
        if event is not None:
            event.set()
        if waiters is not None:
            for fut in waiters:
                if type(fut) is _TrioWaiter:
                    wake.add(fut.token, _TrioWaiter.wake, fut)
                else:
                    wake.add(fut.get_loop(), _wake, fut)
        if callbacks is not None:
            for loop, fn in callbacks:
                if loop is None:
                    self._run_callback(fn)
                else:
                    wake.add(loop, self._run_callback, fn)
        return True

    def _run_callback(self, fn: Callable[[Work], Any]) -> None:
        try:
            fn(self)
        except Exception as exc:  # noqa: BLE001 - a user callback must not break the settling thread
            loop = _get_running_loop()
            if loop is not None:
                loop.call_exception_handler(
                    {"message": "exception in Work done callback", "exception": exc}
                )
            else:
                threading.excepthook(
                    threading.ExceptHookArgs((type(exc), exc, exc.__traceback__, None))
                )

    # ------------------------------------------------------------------ public
    def done(self) -> bool:
        """True once the operation finished, successfully or not."""
        return self._state != _PENDING

    def exception(self) -> BaseException | None:
        """The failure, or None on success. Raises ``InvalidStateError`` while pending."""
        if self._state == _PENDING:
            raise asyncio.InvalidStateError(f"{self!r} is still pending")
        return self._value if self._state == _FAILED else None

    def result(self) -> Any:
        """The output (tensor, list or object); raises the failure. Never blocks."""
        state = self._state
        if state == _DONE:
            return self._value
        if state == _FAILED:
            raise self._value
        raise asyncio.InvalidStateError(f"{self!r} is still pending")

    def add_done_callback(self, fn: Callable[[Work], Any]) -> None:
        """Call ``fn(work)`` when the Work settles.

        Added from a running event loop, ``fn`` runs on that loop; otherwise it runs
        in the thread that settles the Work. A Work already settled runs ``fn`` soon
        (on the loop) or at once (without one).
        """
        loop: Any = _get_running_loop() or _trio_token()
        with self._lock:
            if self._state == _PENDING:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append((loop, fn))
                return
        if loop is None:
            self._run_callback(fn)
        elif isinstance(loop, asyncio.AbstractEventLoop):
            loop.call_soon(self._run_callback, fn)
        else:
            loop.run_sync_soon(self._run_callback, fn)

    def wait(self, timeout: float | None = None) -> Any:
        """Block the calling thread until done; returns ``result()``.

        For synchronous code on other threads, never on the event loop. On expiry of
        ``timeout`` raises the builtin ``TimeoutError``; the operation keeps running.
        """
        if self._state == _PENDING:
            with self._lock:
                if self._state == _PENDING and self._event is None:
                    self._event = threading.Event()
                event = self._event
            if event is not None and not event.wait(timeout):
                raise TimeoutError(f"{self!r} not done after {timeout} s")
        return self.result()

    def set_stream_hook(self, hook: Callable[[Any], None]) -> None:
        """For device backends, at submit: ``wait_stream(s)`` will call ``hook(s)``, which
        makes stream ``s`` wait for this op on the device."""
        self._stream_hook = hook

    def wait_stream(self, stream: Any = None) -> None:
        """Make ``stream`` (default: current) wait for this op on the device, no host block.

        For CPU operations this is a no-op; the CUDA backend installs an event wait.
        """
        hook = self._stream_hook
        if hook is not None:
            hook(stream)

    def __await__(self) -> Generator[Any, None, Any]:
        if self._state == _PENDING:
            loop = _get_running_loop()
            if loop is None:  # not asyncio: trio (anything else raises there)
                return (yield from self._trio_wait().__await__())
            fut = loop.create_future()
            with self._lock:
                pending = self._state == _PENDING
                if pending:
                    if self._waiters is None:
                        self._waiters = []
                    self._waiters.append(fut)
            if pending:
                yield from fut.__await__()
        return self.result()

    async def _trio_wait(self) -> Any:
        import trio

        waiter = _TrioWaiter(trio.lowlevel.current_task(), trio.lowlevel.current_trio_token())
        with self._lock:
            pending = self._state == _PENDING
            if pending:
                if self._waiters is None:
                    self._waiters = []
                self._waiters.append(waiter)
        if pending:

            def abort(_: Any) -> Any:
                # Cancelling the wait cancels only the wait (a later wake finds it gone).
                waiter.task = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        return self.result()

    def __repr__(self) -> str:
        state = ("pending", "done", "failed")[self._state]
        return f"<Work {self.op} seq={self.seq} {state}>"


class _TrioWaiter:
    """A trio task parked on a Work; woken on its own run through the run's token."""

    __slots__ = ("task", "token")

    def __init__(self, task: Any, token: Any) -> None:
        self.task = task
        self.token = token

    def wake(self) -> None:  # on the trio thread (Wakeups call it with the waiter)
        task, self.task = self.task, None
        if task is not None:
            import trio

            trio.lowlevel.reschedule(task)


def _trio_token() -> Any:
    """The current trio run's token, or None outside trio."""
    trio = sys.modules.get("trio")
    if trio is None:
        return None
    try:
        return trio.lowlevel.current_trio_token()
    except RuntimeError:  # not inside trio.run
        return None


def _wake(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_result(None)


class Bundle:
    """Several member Works that one backend operation settles together.

    A flattened coalesced batch is one collective standing for many ops: the backend
    reports its outcome once, for the bundle; on success ``finish`` (copying the
    flat result back into the members' tensors) runs before the members settle.
    ``keep`` holds the flat buffers until then.
    """

    __slots__ = ("works", "op", "seq", "finish", "keep")

    def __init__(
        self, works: list[Work], op: str, finish: Callable[[], object] | None = None, keep: Any = None
    ) -> None:
        self.works = works
        self.op = op
        self.seq = works[0].seq
        self.finish = finish
        self.keep = keep

    def __repr__(self) -> str:
        return f"<Bundle {self.op} seqs={[w.seq for w in self.works]}>"


class Wakeups:
    """Wake-ups gathered while settling a burst of Works, delivered once per loop.

    ``deliver()`` runs the items of the calling thread's own running loop at once
    and posts each other loop's items in ONE ``call_soon_threadsafe`` (trio:
    ``run_sync_soon``), so settling a thousand Works costs each loop one wake-up.
    (Measured against ``streams.LoopWaker``'s extra queue: the plain call is
    15-28 µs faster per small op, and the completion thread already batches.)
    """

    __slots__ = ("_by_loop",)

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Callable[[Any], Any], Any]]] = {}

    def add(self, loop: asyncio.AbstractEventLoop, fn: Callable[[Any], Any], arg: Any) -> None:
        items = self._by_loop.get(loop)
        if items is None:
            self._by_loop[loop] = [(fn, arg)]
        else:
            items.append((fn, arg))

    def deliver(self) -> None:
        if not self._by_loop:
            return
        running = _get_running_loop()
        for loop, items in self._by_loop.items():
            if loop is running:
                _run_all(items)
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
