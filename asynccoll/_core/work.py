"""Work: the handle of one issued operation, awaitable from any loop or thread.

A Work is settled exactly once, by the communicator's ledger (``ledger.py``), from
whatever thread learns the outcome (a backend's completion thread, the deadline
service, ``abort()`` on any thread). Settling sets the state at once, so every
waiter — on any event loop, or blocked in ``wait()`` on any thread — sees the
outcome without depending on the loop that issued the op. Waking is batched by
the ledger (:class:`Wakeups`): one wake-up per event loop for a whole burst.

A backend that can tell cheaply whether an op has finished attaches its
:class:`~.completion.Completion` (:meth:`Work.attach`): whoever asks whether a
pending Work is done, or starts waiting on it, has that queue settle what already
finished first, on the asking thread; a waiter of a Work still pending then has the
backend's completion thread watch for it (``completion.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Callable, Generator, Sequence

from .._base.aio import running_loop
from .completion import Completion, Completions
from .wakeups import (
    OTHER_WAITERS,
    Blocked,
    Callback,
    TrioWaiter,
    Wakeups,
    fail_future,
    resolve_future,
    succeed_future,
    trio_token,
)

_PENDING = 0
_DONE = 1
_FAILED = 2


__all__ = ["BatchWork", "Bundle", "MemberWork", "Wakeups", "Work", "settle_all"]


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
        "_keep",
        "_stream_hook",
        "_completion",
        "__weakref__",
    )

    #: True for a :class:`BatchWork` (settling it settles its members).
    _fans_out = False

    def __init__(
        self,
        op: str,
        seq: int,
        value: Any = None,
        keep: Any = None,
        lock: threading.Lock | None = None,
    ) -> None:
        self.op = op
        self.seq = seq
        self._state = _PENDING
        self._value = value  # the result (known at issue for in-place ops), or the exception
        # Tensors that must outlive the operation (allocator safety, §3).
        self._keep = keep
        # Orders settling against taking a waiter. The ledger gives all its Works one
        # (``Ledger.work_lock``: no object per op; held for a few bytecodes per Work,
        # once for a whole burst by ``settle_all``, never while taking another).
        self._lock = lock if lock is not None else threading.Lock()
        # Whoever waits, in one list: asyncio futures of awaiting tasks (any loop), and
        # the other kinds (``OTHER_WAITERS``: a trio task, a blocked ``wait()``, a done callback).
        self._waiters: list[Any] | None = None
        # Set by device backends: makes a stream wait for the op (``wait_stream``).
        self._stream_hook: Callable[[Any], None] | None = None
        # The backend queue that finishes it (``attach``); None once settled.
        self._completion: Completion | None = None

    # ------------------------------------------------------------------ settle
    def _settle(self, state: int, value: Any, wake: Wakeups) -> bool:
        """:func:`settle_all` for this Work alone; False if it was already settled."""
        return settle_all((self,), state, value, wake) == 1

    def _fan_out(self, state: int, value: Any) -> None:
        """A batch writes its outcome into its members here (:class:`BatchWork`)."""

    def _run_callback(self, fn: Callable[[Work], Any]) -> None:
        try:
            fn(self)
        except Exception as exc:  # noqa: BLE001 - a user callback must not break the settling thread
            loop = running_loop()
            if loop is not None:
                loop.call_exception_handler(
                    {"message": "exception in Work done callback", "exception": exc}
                )
            else:
                threading.excepthook(
                    threading.ExceptHookArgs((type(exc), exc, exc.__traceback__, None))
                )

    # ------------------------------------------------------------ backend side
    def attach(self, completion: Completion) -> None:
        """The backend queue that finishes this Work (called by a backend at submit, any
        thread; see ``completion.py``). A Work that someone already waits on (an op held
        back and submitted later) is handed to the queue's completion thread at once."""
        # No lock: the completion is written before the waiters are read, and every
        # waiter reads it after registering, so one of the two sides always checks.
        if self._state != _PENDING:
            return
        self._completion = completion
        if self._waiters is not None:
            self._check(True)

    def _check(self, waiting: bool) -> None:
        """A pending Work: settle it here if it finished; if someone is ``waiting`` and
        it has not, have the backend's completion thread watch for it."""
        completion = self._completion
        if completion is None:
            return
        completion.settle_finished()
        if waiting and self._state == _PENDING:
            completion.watch_unfinished()

    # ------------------------------------------------------------------ public
    def done(self) -> bool:
        """True once the operation finished, successfully or not."""
        if self._state == _PENDING:
            completion = self._completion
            if completion is not None:
                completion.settle_finished()  # settles it here if it finished unseen
        return self._state != _PENDING

    def exception(self) -> BaseException | None:
        """The failure, or None on success. Raises ``InvalidStateError`` while pending."""
        if self._state == _PENDING:
            self._check(False)
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
        self._check(False)
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
        loop: Any = running_loop() or trio_token()
        if self._take(Callback(loop, fn)):
            self._check(True)
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
            blocked = Blocked()
            if self._take(blocked):
                self._check(True)
                if not blocked.wait(timeout):
                    raise TimeoutError(f"{self!r} not done after {timeout} s")
        return self.result()

    def _take(self, waiter: Any) -> bool:
        """Add ``waiter`` while the Work is pending (True); False once it settled. The
        waiter is made by the caller: no frame of ours runs while the lock is held."""
        with self._lock:
            if self._state != _PENDING:
                return False
            if self._waiters is None:
                self._waiters = [waiter]
            else:
                self._waiters.append(waiter)
            return True

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
        # Not a generator itself: a waiting task drives its asyncio future directly,
        # and settling the Work gives that future the Work's outcome (``resolve_future``),
        # so waking a task costs no frame of ours (an abort wakes thousands).
        known = self._completion
        if known is not None and self._state == _PENDING:
            self._check(True)  # settled here if it already finished; else the backend watches it
        if self._state == _PENDING:
            loop = running_loop()
            if loop is None:  # not asyncio: trio (anything else raises there)
                return self._trio_wait(known).__await__()
            fut = loop.create_future()
            with self._lock:  # ``_take`` inlined: this is every awaited op's path
                pending = self._state == _PENDING
                if pending:
                    if self._waiters is None:
                        self._waiters = []
                    self._waiters.append(fut)
                    late = known is None and self._completion is not None
            if pending:
                if late:  # attached between the check above and the registration
                    self._check(True)
                return fut.__await__()
        return _ready(self)

    async def _trio_wait(self, known: Any) -> Any:
        import trio

        waiter = TrioWaiter(trio.lowlevel.current_task(), trio.lowlevel.current_trio_token())
        if self._take(waiter):
            if known is None and self._completion is not None:  # attached before the registration
                self._check(True)

            def abort(_: Any) -> Any:
                # Cancelling the wait cancels only the wait (a later wake finds it gone).
                waiter.task = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        return self.result()

    def __repr__(self) -> str:
        state = ("pending", "done", "failed")[self._state]
        return f"<Work {self.op} seq={self.seq} {state}>"


class BatchWork(Work):
    """The one pending entry of a coalesced batch; its members are :class:`MemberWork` s.

    It holds the batch's place in the ledger's ``pending`` (under its first member's
    seq) and its one deadline, and whoever waits on a pending member waits on it.
    Settling it writes the outcome into every member still pending, under the lock
    the members share, before anyone is woken: success into all of them; a failure
    into the first pending member as it is and into the others as ``clone(error)``
    (each Work raises its own exception object). A member whose backend op failed
    is settled on its own first (the ledger then aborts, which settles the batch).
    Backends that run part of the batch attach their completions through its members
    (:class:`~.completion.Completions` keeps them all).
    """

    __slots__ = ("members", "remaining", "_parts", "_clone")

    _fans_out = True

    def __init__(
        self,
        seq: int,
        clone: Callable[[BaseException], BaseException],
        lock: threading.Lock | None = None,
    ) -> None:
        super().__init__("coalesced", seq, lock=lock)
        self.members: list[MemberWork] = []
        #: Members whose success has not been reported yet (set when the batch is issued).
        self.remaining = 0
        self._parts = Completions()  # shared with every member
        self._clone = clone

    def attach(self, completion: Completion) -> None:
        """Several backends (or queues) may run parts of one batch: each one is kept."""
        if self._state != _PENDING:
            return
        self._parts.add(completion)
        self._completion = self._parts
        if self._waiters is not None:
            self._check(True)

    def _fan_out(self, state: int, value: Any) -> None:
        """Write the batch's outcome into its pending members (caller holds the lock)."""
        first = True
        for member in self.members:
            if member._state != _PENDING:
                continue
            if state == _FAILED:
                member._value = value if first else self._clone(value)
                first = False
            member._state = state
            member._keep = None
            member._completion = None
        self._parts = Completions()


class MemberWork(Work):
    """A member of a coalesced batch: its own seq, op and result, the rest its batch's.

    Light: no lock, pending entry, deadline or waiters of its own. Waiting on a
    pending member (``await``, ``wait()``, ``add_done_callback``) waits on its
    :class:`BatchWork`, which writes the member's outcome before waking anyone.
    """

    __slots__ = ("_batch",)

    def __init__(self, op: str, seq: int, value: Any, keep: Any, batch: BatchWork) -> None:
        # Work.__init__ without a lock of its own (the batch's is shared).
        self.op = op
        self.seq = seq
        self._state = _PENDING
        self._value = value
        self._keep = keep
        self._lock = batch._lock
        self._waiters = None
        self._stream_hook = None
        self._completion = batch._parts
        self._batch = batch

    def attach(self, completion: Completion) -> None:
        self._batch.attach(completion)

    def add_done_callback(self, fn: Callable[[Work], Any]) -> None:
        if self._state == _PENDING:
            self._batch.add_done_callback(lambda _batch: fn(self))
        else:
            super().add_done_callback(fn)

    def wait(self, timeout: float | None = None) -> Any:
        if self._state == _PENDING:
            try:
                self._batch.wait(timeout)
            except Exception:  # noqa: BLE001 - the batch failed: this member's own outcome is below
                if self._state == _PENDING:
                    raise  # the wait timed out
        return self.result()

    def __await__(self) -> Generator[Any, None, Any]:
        if self._state == _PENDING:
            with contextlib.suppress(
                Exception
            ):  # the batch failed: this member's own outcome is below
                yield from self._batch.__await__()
        return self.result()


def settle_all(
    works: Sequence[Work],
    state: int,
    value: Any,
    wake: Wakeups,
    make: Callable[[], Any] | None = None,
    into: list[Work] | None = None,
) -> int:
    """The one way Works finish (any thread; only the ledger calls it): each of ``works``
    still pending takes ``state`` and ``value`` (or ``make()``, one per Work: an abort
    gives each its own exception; a success with None keeps the result known at issue).
    Returns how many it settled (the others had settled already); ``into`` (if given)
    gets those Works.

    One pass under the lock the Works share (``Ledger.work_lock``; a Work with a lock
    of its own is settled on its own): a burst of a thousand (an abort) takes it once,
    not a thousand times. Then their waiters go to ``wake``, and what they let go of
    (kept tensors, replaced results) to ``wake.later`` if it is collecting.
    """
    settled = 0
    woken: list[tuple[Work, list[Any]]] = []
    alone: list[Work] | None = None
    later = wake.later
    lock = works[0]._lock
    with lock:
        for work in works:
            if work._state != _PENDING:
                continue
            if work._lock is not lock:
                if alone is None:
                    alone = []
                alone.append(work)
                continue
            v = value if make is None else make()
            if work._fans_out:  # a batch: its members first, before anyone is woken
                work._fan_out(state, v)
            work._state = state
            if later is not None:  # a burst (an abort): freed after its waiters ran
                later.append(work._value)
                later.append(work._keep)
            if state == _FAILED or v is not None:
                work._value = v
            work._keep = work._completion = None
            if work._waiters is not None:
                woken.append((work, work._waiters))
                work._waiters = None
            settled += 1
            if into is not None:
                into.append(work)
    running = wake.running
    for work, waiters in woken:
        v, resolve = work._value, None
        for fut in waiters:
            if type(fut) in OTHER_WAITERS:
                fut.notify(work, wake)
                continue
            loop = fut.get_loop()
            if loop is running:  # this thread's loop: the future only schedules its task
                try:
                    if state == _FAILED:
                        fut.set_exception(v)
                    else:
                        fut.set_result(v)
                except asyncio.InvalidStateError:  # a cancelled wait
                    pass
                continue
            if resolve is None:
                resolve = (fail_future, v) if state == _FAILED else (succeed_future, v)
            wake.add(loop, resolve_future, (fut, resolve))
    if alone is not None:
        for work in alone:
            settled += settle_all((work,), state, value, wake, make, into)
    return settled


def _ready(work: Work) -> Generator[Any, None, Any]:
    """``await`` of a settled Work: its result at once."""
    return work.result()
    yield  # pragma: no cover - unreachable: it makes this a generator


class Bundle:
    """Several member Works that one backend operation settles together.

    A flattened coalesced batch is one collective standing for many ops: the backend
    reports its outcome once, for the bundle; on success ``finish`` (copying the
    flat result back into the members' tensors) runs before the members settle.
    ``keep`` holds the flat buffers until then.
    """

    __slots__ = ("works", "op", "seq", "finish", "keep")

    def __init__(
        self,
        works: Sequence[Work],
        op: str,
        finish: Callable[[], object] | None = None,
        keep: Any = None,
    ) -> None:
        self.works = works
        self.op = op
        self.seq = works[0].seq
        self.finish = finish
        self.keep = keep

    def attach(self, completion: Completion) -> None:
        """Attach ``completion`` to every member (``Work.attach``); members of one batch share it."""
        works = self.works
        batch = getattr(works[0], "_batch", None)
        if batch is not None and works is batch.members:  # a whole coalesced batch, handed on as is
            batch.attach(completion)
            return
        batch = None
        for work in works:
            if type(work) is MemberWork:
                if work._batch is not batch:
                    batch = work._batch
                    batch.attach(completion)
            else:
                work.attach(completion)

    def __repr__(self) -> str:
        return f"<Bundle {self.op} seqs={[w.seq for w in self.works]}>"
