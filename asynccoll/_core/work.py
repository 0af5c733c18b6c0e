"""Work: the handle of one issued operation, awaitable from asyncio and uvloop.

A Work is settled exactly once, from whatever thread learns the outcome (a Gloo
worker thread, the deadline timer, a CUDA event watcher, ``abort()`` on any
thread). Settling never blocks: waiters on an event loop are woken through that
loop's batched waker, synchronous ``wait()`` callers through a lazily created
``threading.Event``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Generator, Protocol

_PENDING = 0
_DONE = 1
_FAILED = 2


class Waker(Protocol):
    """Delivers callables to one event loop from any thread (see ``streams.LoopWaker``)."""

    def post(self, fn: Callable[..., Any], *args: Any) -> bool: ...


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
        "_on_settle",
        "_loop",
        "_waker",
        "_stream_hook",
        "__weakref__",
    )

    def __init__(
        self,
        op: str,
        seq: int,
        value: Any = None,
        keep: Any = None,
        loop: asyncio.AbstractEventLoop | None = None,
        waker: Waker | None = None,
        on_settle: Callable[["Work"], None] | None = None,
    ) -> None:
        self.op = op
        self.seq = seq
        self._state = _PENDING
        # The result on success (known at issue time for in-place ops), the
        # exception on failure.
        self._value = value
        # Tensors that must outlive the operation (allocator safety, §3).
        self._keep = keep
        self._lock = threading.Lock()
        self._waiters: list[asyncio.Future[Any]] | None = None
        self._callbacks: list[tuple[asyncio.AbstractEventLoop | None, Callable[[Work], Any]]] | None = None
        self._event: threading.Event | None = None
        self._on_settle = on_settle
        self._loop = loop
        self._waker = waker
        # Set by device backends: makes a stream wait for the op (``wait_stream``).
        self._stream_hook: Callable[[Any], None] | None = None

    # ------------------------------------------------------------------ settle
    def _set_result(self, value: Any = None) -> bool:
        """Mark success (any thread). Returns False if the Work was already settled."""
        return self._settle(_DONE, value)

    def _set_exception(self, exc: BaseException) -> bool:
        """Mark failure (any thread). Returns False if the Work was already settled."""
        return self._settle(_FAILED, exc)

    def _settle(self, state: int, value: Any) -> bool:
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
        # The communicator forgets the Work before anyone wakes, so a task resumed
        # by it sees consistent bookkeeping (``comm.pending``).
        on_settle = self._on_settle
        if on_settle is not None:
            self._on_settle = None
            on_settle(self)
        if event is not None:
            event.set()
        if waiters:
            for fut in waiters:
                self._deliver(fut.get_loop(), self._wake, fut)
        if callbacks:
            for loop, fn in callbacks:
                if loop is None:
                    self._run_callback(fn)
                else:
                    self._deliver(loop, self._run_callback, fn)
        return True

    def _deliver(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], arg: Any) -> None:
        if asyncio._get_running_loop() is loop:
            fn(arg)
            return
        try:
            if loop is self._loop and self._waker is not None:
                self._waker.post(fn, arg)
            else:
                loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop was closed: nobody is left to wake
            pass

    def _wake(self, fut: asyncio.Future[Any]) -> None:
        if not fut.done():
            fut.set_result(None)

    def _run_callback(self, fn: Callable[["Work"], Any]) -> None:
        try:
            fn(self)
        except Exception as exc:  # a user callback must not break the settling thread
            loop = asyncio._get_running_loop()
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

    def add_done_callback(self, fn: Callable[["Work"], Any]) -> None:
        """Call ``fn(work)`` when the Work settles.

        Added from a running event loop, ``fn`` runs on that loop; otherwise it runs
        in the thread that settles the Work. A Work already settled runs ``fn`` soon
        (on the loop) or at once (without one).
        """
        loop = asyncio._get_running_loop()
        with self._lock:
            if self._state == _PENDING:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append((loop, fn))
                return
        if loop is None:
            self._run_callback(fn)
        else:
            loop.call_soon(self._run_callback, fn)

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

    def wait_stream(self, stream: Any = None) -> None:
        """Make ``stream`` (default: current) wait for this op on the device, no host block.

        For CPU operations this is a no-op once the Work is done; the CUDA backend
        replaces it with an event wait.
        """
        hook = self._stream_hook
        if hook is not None:
            hook(stream)

    def __await__(self) -> Generator[Any, None, Any]:
        if self._state == _PENDING:
            fut = asyncio.get_running_loop().create_future()
            with self._lock:
                pending = self._state == _PENDING
                if pending:
                    if self._waiters is None:
                        self._waiters = []
                    self._waiters.append(fut)
            if pending:
                yield from fut.__await__()
        return self.result()

    def __repr__(self) -> str:
        state = ("pending", "done", "failed")[self._state]
        return f"<Work {self.op} seq={self.seq} {state}>"

