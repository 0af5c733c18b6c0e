"""The ledger: the one owner of a communicator's issued operations.

It holds what the communicator, coalescing, shrink and diagnostics all need —
the state machine (ok / aborted / closed), the lock that orders issuing against
abort and close, sequence numbers (allocation and give-back), the pending Works,
their deadlines — and it is the ONE sink through which backends report outcomes:

* ``succeed(target)`` / ``succeed_all(targets)`` — the operation completed;
* ``fail(target, exc)`` — it failed (``exc`` already in the contract's family);
  the transport is then suspect and the communicator aborts;
* ``abort(cause)`` — every pending Work fails with ``CommAborted``.

A target is a :class:`Work`, or a :class:`Bundle` of Works that one backend op
stands for (a flattened coalesced batch). Backends never touch Work internals.

Invariants:

* A Work is in ``pending`` from ``reserve`` until it settles (or is discarded).
* Once the state leaves ``ok`` no success is ever reported (Gloo marks works of
  an aborted group completed; that is never a success).
* The state is ``aborted`` before any waiter can see the error that aborted it.
* Wake-ups of a burst are delivered once per event loop (``Wakeups``).
"""

from __future__ import annotations

import contextvars
import enum
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from .._base.deadlines import DeadlineClient, DeadlineService
from .._base.errors import AsyncCollError, CollectiveTimeout, CommAborted, CommClosed, PeerFailure
from .._base.recorder import FlightRecorder, now
from .work import _DONE, _FAILED, Bundle, Wakeups, Work

Target = Work | Bundle


class State(str, enum.Enum):
    """A communicator's state; the value is what ``comm.state`` reads."""

    OK = "ok"
    ABORTED = "aborted"
    CLOSED = "closed"


_OK, _ABORTED, _CLOSED = State.OK, State.ABORTED, State.CLOSED


def clone_error(error: BaseException) -> BaseException:
    """A fresh exception like ``error`` for one more Work (a raised exception
    accumulates a traceback per raise; Works must not share one)."""
    exc: BaseException
    if isinstance(error, PeerFailure):
        exc = PeerFailure(str(error), error.ranks)
    elif isinstance(error, CollectiveTimeout):
        exc = CollectiveTimeout(str(error), error.seq, error.op)
    else:
        try:
            exc = type(error)(*error.args)
        except Exception:  # noqa: BLE001 - an exception type with an unusual constructor: wrap it
            exc = CommAborted(str(error))
    exc.__cause__ = error.__cause__
    return exc


def abort_error(error: BaseException) -> CommAborted:
    """The error a pending Work gets when the communicator aborts because of ``error``."""
    exc: CommAborted
    if isinstance(error, PeerFailure):
        exc = PeerFailure(str(error), error.ranks)
        exc.__cause__ = error.__cause__
    elif isinstance(error, CommAborted):
        exc = CommAborted(str(error))
        exc.__cause__ = error.__cause__
    else:
        exc = CommAborted(f"communicator aborted: {error}")
        exc.__cause__ = error
    return exc


class Ledger:
    """Issued operations of one communicator (see the module docstring).

    ``on_abort(error)`` runs once, after the Works failed, on the thread that
    aborted: the communicator stops its backends and tells its peers there. It
    must not hold the communicator strongly (a bound method through a weakref).
    """

    def __init__(
        self,
        rank: int,
        *,
        deadlines: DeadlineService,
        on_abort: Callable[[BaseException], None],
        recorder: FlightRecorder | None = None,
    ) -> None:
        self.rank = rank
        #: Orders issuing against abort/close: an op is in ``pending`` before abort
        #: takes its snapshot, or sees the new state and raises.
        self.lock = threading.Lock()
        self.state = _OK
        self.closing = False
        self.error: BaseException | None = None
        self._seq = 0
        self.pending: dict[int, Work] = {}
        self._on_abort = on_abort
        self._deadlines: DeadlineClient = deadlines.client(self)
        #: The coalescing batch open in the current task, if any (``coalescing.py``).
        self.batch: contextvars.ContextVar[Any] = contextvars.ContextVar("asynccoll_batch", default=None)
        #: The flight recorder: every op's issue and outcome (``comm.flight_record()``,
        #: the trace files of ``_diag``).
        self.recorder = self._recorder = recorder if recorder is not None else FlightRecorder()

    @property
    def last_seq(self) -> int:
        """The seq of the last op reserved (0 before the first)."""
        return self._seq

    # ------------------------------------------------------------------ issue
    def unusable(self) -> AsyncCollError:
        """The error for a call on a communicator that is not ``ok`` (or is closing)."""
        if self.state is _ABORTED:
            exc = CommAborted(f"communicator is aborted: {self.error}")
            exc.__cause__ = self.error
            return exc
        return CommClosed("communicator is closed" if self.state is _CLOSED else "communicator is closing")

    def reserve(self, op: str, value: Any = None, keep: Any = None) -> Work:
        """The next seq's pending Work. Caller holds ``lock``; raises if unusable."""
        if self.state is not _OK or self.closing:
            raise self.unusable()
        seq = self._seq = self._seq + 1
        work = Work(op, seq, value, keep)
        self.pending[seq] = work
        return work

    def issued(self, work: Work, spec: Any, batch: int | None = None, root: int = -1) -> None:
        """Record ``work`` in the flight recorder (caller holds ``lock``)."""
        self._recorder.issued(work.seq, work.op, spec, now(), batch, root)

    def commit(self, work: Work, timeout: float, deadline: float | None = None) -> None:
        """The backend took ``work``: its deadline starts (caller holds ``lock``)."""
        self._deadlines.add(work.seq, timeout, deadline)

    def commit_all(self, works: Sequence[Work], timeout: float) -> None:
        """One deadline, the same instant, for every member of a batch."""
        deadline = time.monotonic() + timeout
        add = self._deadlines.add
        for work in works:
            add(work.seq, timeout, deadline)

    def discard(self, works: Sequence[Work]) -> None:
        """Forget Works that were never issued (refused, or a failed coalescing body).

        Their seqs are given back when nothing else took one after them, so the next
        op's seq is the same on every rank that runs the same program. Caller holds
        ``lock``. The Works are not settled here.
        """
        if not works:
            return
        for work in works:
            self.pending.pop(work.seq, None)
        first, last = works[0].seq, works[-1].seq
        if self._seq == last and last - first + 1 == len(works):
            self._seq = first - 1
            self._recorder.discard(first)  # the seqs will be reused

    def fail_unissued(self, works: Sequence[Work], exc: BaseException) -> None:
        """Settle discarded Works with ``exc`` without aborting anything."""
        wake = Wakeups()
        for work in works:
            work._settle(_FAILED, exc, wake)
        wake.deliver()

    # ----------------------------------------------------------------- settle
    def is_live(self, seq: int) -> bool:
        return seq in self.pending

    def succeed(self, target: Target, value: Any = None) -> None:
        """``target`` completed (any thread)."""
        if self.state is not _OK:
            return  # aborted: its Works already failed; a late "success" is not one
        wake = Wakeups()
        self._succeed(target, value, wake)
        wake.deliver()

    def succeed_all(self, targets: Iterable[Target]) -> None:
        """Several targets completed: their waiters are woken once per loop."""
        if self.state is not _OK:
            return
        wake = Wakeups()
        for target in targets:
            self._succeed(target, None, wake)
        wake.deliver()

    def _succeed(self, target: Target, value: Any, wake: Wakeups) -> None:
        if type(target) is Work:
            self.pending.pop(target.seq, None)
            if target._settle(_DONE, value, wake):
                self._recorder.ended(target.seq, "done", now())
            return
        assert isinstance(target, Bundle)
        if target.finish is not None:
            try:
                target.finish()
            except Exception as err:  # noqa: BLE001 - a failed copy-back fails the batch
                failure = CommAborted(f"coalesced {target.op} (seq {target.seq}): copy-back failed: {err}")
                failure.__cause__ = err
                self.fail(target, failure)
                return
        target.keep = None
        # Last to first: callers await first to last, so the first wake-up finds
        # every member done.
        for work in reversed(target.works):
            self._succeed(work, None, wake)

    def fail(self, target: Target, exc: BaseException) -> None:
        """``target`` failed (any thread): it raises ``exc``; the communicator aborts."""
        works = [target] if type(target) is Work else list(target.works)  # type: ignore[union-attr]
        with self.lock:
            first = self.state is _OK
            if first:
                self.state = _ABORTED  # before any waiter can see the error
                self.error = exc if isinstance(exc, CommAborted) else abort_error(exc)
            for work in works:
                self.pending.pop(work.seq, None)
            others = list(self.pending.values()) if first else []
            if first:
                self.pending.clear()
        wake = Wakeups()
        failed = self._recorder.failed
        for i, work in enumerate(works):
            err = exc if i == 0 else clone_error(exc)
            if work._settle(_FAILED, err, wake):
                failed(work.seq, err, now())
        error = self.error if first else None
        if error is not None:
            self._fail_pending(others, error, wake)
        wake.deliver()
        if error is not None:
            self._on_abort(error)

    def expired(self, seq: int) -> None:
        """The deadline service's report: ``seq`` is past its deadline."""
        work = self.pending.get(seq)
        if work is not None:
            self.fail(
                work,
                CollectiveTimeout(
                    f"{work.op} (seq {seq}) on rank {self.rank} did not complete within its deadline",
                    seq=seq, op=work.op,
                ),
            )

    def abort(self, cause: BaseException) -> bool:
        """Fail every pending Work with ``CommAborted`` (caused by ``cause``).

        Returns True if this call aborted (False: not ``ok`` any more). Runs
        ``on_abort`` before returning.
        """
        error = cause if isinstance(cause, CommAborted) else abort_error(cause)
        with self.lock:
            if self.state is not _OK:
                return False
            self.state = _ABORTED
            self.error = error
            pending = list(self.pending.values())
            self.pending.clear()
        wake = Wakeups()
        self._fail_pending(pending, error, wake)
        wake.deliver()
        self._on_abort(error)
        return True

    def _fail_pending(self, works: list[Work], error: BaseException, wake: Wakeups) -> None:
        failed = self._recorder.failed
        for work in works:
            err = abort_error(error)
            if work._settle(_FAILED, err, wake):
                failed(work.seq, err, now())

    # ------------------------------------------------------------------ close
    def begin_close(self) -> bool:
        """Refuse new ops from now on; False if already closing or closed."""
        with self.lock:
            if self.state is _CLOSED or self.closing:
                return False
            self.closing = True
            return True

    def end_close(self) -> None:
        with self.lock:
            self.state = _CLOSED
        self._deadlines.close()

    def release(self) -> None:
        """Stop using the deadline service (abort, close, garbage collection)."""
        self._deadlines.close()
