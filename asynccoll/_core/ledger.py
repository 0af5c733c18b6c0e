"""The ledger: the one owner of a communicator's issued operations.

It holds what the communicator, coalescing, shrink and diagnostics all need —
the state machine (ok / aborted / closed), the lock that orders issuing against
abort and close, sequence numbers (allocation and give-back), the pending Works,
their deadlines — and it is the ONE sink through which backends report outcomes:

* ``succeed(target)`` / ``succeed_all(targets)`` — the operation completed;
* ``fail(target, exc)`` — it failed (``exc`` already in the contract's family);
  the transport is then suspect and the communicator aborts;
* ``abort(cause)`` — every pending Work fails with ``CommAborted``; an op that
  finished before the abort, unseen, keeps its outcome (``_settle_finished``).
  ``fail`` fails the rest of what is pending: nothing after a failure succeeds.

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
import functools
import operator
import threading
from typing import Any, Callable, Iterable, Sequence

from .._base.deadlines import DeadlineClient, DeadlineService
from .._base.errors import (
    AsyncCollError,
    CollectiveMismatch,
    CollectiveTimeout,
    CommAborted,
    CommClosed,
    PeerFailure,
    is_abort_error,
)
from .._base.recorder import FlightRecorder, now, outcome
from .backend import Target
from .work import _DONE, _FAILED, BatchWork, Bundle, MemberWork, Wakeups, Work, settle_all

_completion_of = operator.attrgetter("_completion")


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
    elif isinstance(error, CollectiveMismatch):  # each member: what the ranks issued
        exc = CollectiveMismatch(str(error), error.seq, error.details, error.fields)
    else:
        try:
            exc = type(error)(*error.args)
        except Exception:  # noqa: BLE001 - an exception type with an unusual constructor: wrap it
            exc = CommAborted(str(error))
    exc.__cause__ = error.__cause__
    return exc


def abort_error(error: BaseException) -> CommAborted:
    """The error a pending Work gets when the communicator aborts because of ``error``."""
    return abort_errors(error)()


def abort_errors(error: BaseException) -> Callable[[], CommAborted]:
    """A maker of :func:`abort_error` s of ``error``: the message is formatted once,
    and each call returns a fresh exception (one per Work, see :func:`clone_error`)."""
    cause: BaseException | None
    if isinstance(error, PeerFailure):
        text, ranks, cause = str(error), error.ranks, error.__cause__

        def make() -> CommAborted:
            exc = PeerFailure(text, ranks)
            exc.__cause__ = cause
            return exc

        return make
    if is_abort_error(error):
        text, cause = str(error), error.__cause__
    else:
        text, cause = f"communicator aborted: {error}", error
    if cause is None:  # ``comm.abort()``: no frame of ours per Work (an abort fails thousands)
        return functools.partial(CommAborted, text)

    def make_aborted() -> CommAborted:
        exc = CommAborted(text)
        exc.__cause__ = cause
        return exc

    return make_aborted


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
        #: The lock of every Work issued here (``Work._lock``): held for a few bytecodes
        #: per Work (``settle_all`` holds it once for a whole burst), never while taking
        #: another lock (so it may be taken while ``lock`` is held).
        self.work_lock = threading.Lock()
        self.state = _OK
        self.closing = False
        self.error: BaseException | None = None
        self._seq = 0
        self.pending: dict[int, Work] = {}
        self._on_abort = on_abort
        self._deadlines: DeadlineClient = deadlines.client(self)
        #: The coalescing batch open in the current task, if any (``coalescing.py``).
        self.batch: contextvars.ContextVar[Any] = contextvars.ContextVar(
            "asynccoll_batch", default=None
        )
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
            error = self.error
            # A peer's death stays one for the calls after it: a PeerFailure (a
            # CommAborted) naming the same ranks, so that ``except ac.PeerFailure:
            # shrink()`` also catches the call that the failure's news beat.
            if isinstance(error, PeerFailure):
                exc: CommAborted = PeerFailure(f"communicator is aborted: {error}", error.ranks)
            else:
                exc = CommAborted(f"communicator is aborted: {error}")
            exc.__cause__ = error
            return exc
        return CommClosed(
            "communicator is closed" if self.state is _CLOSED else "communicator is closing"
        )

    def reserve(self, op: str, value: Any = None, keep: Any = None, spec: Any = None) -> Work:
        """The next seq's pending Work, recorded as issued if ``spec`` is given (else see
        :meth:`issued`). Caller holds ``lock``; raises if unusable."""
        if self.state is not _OK or self.closing:
            raise self.unusable()
        seq = self._seq = self._seq + 1
        work = Work(op, seq, value, keep, self.work_lock)
        self.pending[seq] = work
        if spec is not None:
            self._recorder.issued(seq, op, spec, now())
        return work

    def issued(self, work: Work, spec: Any, batch: int | None = None, root: int = -1) -> None:
        """Record ``work`` in the flight recorder (caller holds ``lock``)."""
        self._recorder.issued(work.seq, work.op, spec, now(), batch, root)

    def commit(self, work: Work, timeout: float, deadline: float | None = None) -> None:
        """The backend took ``work``: its deadline starts (caller holds ``lock``)."""
        self._deadlines.add(work.seq, timeout, deadline)

    def reserve_member(self, op: str, value: Any, keep: Any, batch: BatchWork | None) -> MemberWork:
        """The next seq's Work as a member of a coalesced batch (``batch``; None: the
        first member, which opens the batch's one pending entry). Takes ``lock``.
        Recorded when the batch is issued (:meth:`commit_all`)."""
        with self.lock:
            if self.state is not _OK or self.closing:
                raise self.unusable()
            seq = self._seq = self._seq + 1
            if batch is None:
                batch = BatchWork(seq, abort_error, self.work_lock)
                self.pending[seq] = batch
            work = MemberWork(op, seq, value, keep, batch)
            batch.members.append(work)
        return work

    def commit_all(self, works: Sequence[Work], specs: Sequence[Any], timeout: float) -> None:
        """A coalesced batch (``works`` running ``specs``) is issued (caller holds
        ``lock``): its members are recorded, its ONE deadline starts."""
        batch = works[0]._batch  # type: ignore[attr-defined]
        batch.remaining = len(batch.members)
        self._recorder.issued_batch(works, specs, now(), batch.seq)
        self._deadlines.add(batch.seq, timeout)

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
        """Settle discarded Works with ``exc`` without aborting anything (and the
        batches of discarded members: whoever waits on a member waits there)."""
        wake = Wakeups()
        for work in works:
            work._settle(_FAILED, exc, wake)
        for batch in {id(w._batch): w._batch for w in works if type(w) is MemberWork}.values():
            batch._settle(_FAILED, exc, wake)
        wake.deliver()

    # ----------------------------------------------------------------- settle
    def is_live(self, seq: int) -> bool:
        return seq in self.pending

    def succeed(self, target: Target, value: Any = None) -> None:
        """``target`` completed (any thread)."""
        self.succeed_all((target,), value)

    def succeed_all(self, targets: Iterable[Target], value: Any = None) -> None:
        """Several targets completed: their waiters are woken once per loop. ``value``:
        their result where it is known only now (an object collective's); None keeps
        the one known at issue (an in-place op's tensor)."""
        if self.state is not _OK:
            return  # aborted: its Works already failed; a late "success" is not one
        wake = Wakeups()
        done: list[int] = []
        run: list[Work] = []  # consecutive plain Works: settled in one pass, in order
        for target in targets:
            if type(target) is Work:
                run.append(target)
                continue
            if run:
                self._succeed_run(run, value, wake, done)
                run = []
            self._succeed(target, value, wake, done)
        if run:
            self._succeed_run(run, value, wake, done)
        self._recorder.ended_all(done, "done", now())
        wake.deliver()

    def _succeed_run(self, works: list[Work], value: Any, wake: Wakeups, done: list[int]) -> None:
        """Plain Works that completed: settled in one pass (``settle_all``); the seqs of
        those it settled go to ``done``."""
        if len(works) == 1:  # one op (an awaited one, most often): no lists
            self._succeed(works[0], value, wake, done)
            return
        pop = self.pending.pop
        for work in works:
            pop(work.seq, None)
        settled: list[Work] = []
        settle_all(works, _DONE, value, wake, None, settled)
        done.extend([w.seq for w in settled])

    def _succeed(self, target: Target, value: Any, wake: Wakeups, done: list[int]) -> None:
        """Settle ``target``'s Works; the seqs of those it settled go to ``done`` (recorded
        by the caller, in one call for a burst)."""
        kind = type(target)
        if kind is Work:
            self.pending.pop(target.seq, None)
            if target._settle(_DONE, value, wake):  # type: ignore[union-attr]
                done.append(target.seq)
            return
        if kind is MemberWork:
            self._members_done(target._batch, 1, wake, done)  # type: ignore[union-attr]
            return
        assert isinstance(target, Bundle)
        if target.finish is not None:
            try:
                target.finish()
            except Exception as err:  # noqa: BLE001 - a failed copy-back fails the batch
                failure = CommAborted(
                    f"coalesced {target.op} (seq {target.seq}): copy-back failed: {err}"
                )
                failure.__cause__ = err
                self.fail(target, failure)
                return
        target.keep = None
        works = target.works
        batch = getattr(works[0], "_batch", None)
        if batch is not None and (
            works is batch.members  # a whole coalesced batch, handed on as is
            or all(type(w) is MemberWork and w._batch is batch for w in works)
        ):
            self._members_done(batch, len(works), wake, done)  # the common case: one count for all
            return
        for work in reversed(works):
            self._succeed(work, None, wake, done)

    def _members_done(self, batch: BatchWork, n: int, wake: Wakeups, done: list[int]) -> None:
        """``n`` members of ``batch`` succeeded; the last report settles the batch."""
        with batch._lock:
            batch.remaining -= n
            last = batch.remaining <= 0
        if last:
            self.pending.pop(batch.seq, None)
            if batch._settle(_DONE, None, wake):
                done.extend([m.seq for m in batch.members])

    def fail(self, target: Target, exc: BaseException) -> None:
        """``target`` failed (any thread): it raises ``exc``; the communicator aborts."""
        works = [target] if isinstance(target, Work) else list(target.works)
        with self.lock:
            first = self.state is _OK
            if first:
                self.state = _ABORTED  # before any waiter can see the error
                self.error = exc if is_abort_error(exc) else abort_error(exc)
            for work in works:
                if (
                    type(work) is not MemberWork
                ):  # a member's seq may name its batch's entry: that stays
                    self.pending.pop(work.seq, None)
            others = list(self.pending.values()) if first else []
            if first:
                self.pending.clear()
        wake = Wakeups()
        failed = self._recorder.failed
        for i, work in enumerate(works):
            err = exc if i == 0 else clone_error(exc)
            if work._settle(_FAILED, err, wake):
                if type(work) is BatchWork:
                    self._members_failed(work)
                else:
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
        if work is None or work.done():  # done() settles an op that finished unseen
            return
        named: Work = work
        if type(work) is BatchWork:  # the batch's first pending member is the one that timed out
            named = next((m for m in work.members if not m.done()), work)
        self.fail(
            work,
            CollectiveTimeout(
                f"{named.op} (seq {named.seq}) on rank {self.rank} did not complete within its deadline",
                seq=named.seq,
                op=named.op,
            ),
        )

    def abort(self, cause: BaseException) -> bool:
        """Fail every pending Work with ``CommAborted`` (caused by ``cause``).

        Returns True if this call aborted (False: not ``ok`` any more). Runs
        ``on_abort`` before returning.
        """
        error = cause if is_abort_error(cause) else abort_error(cause)
        if self.state is _OK:
            self._settle_finished()
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

    def _settle_finished(self) -> None:
        """Before an abort fails what is pending: let the ops that already finished,
        unseen (a backend settles a Work when someone asks, ``completion.py``), settle
        as they ended. Once per backend queue: each settles its finished head, in
        issue order, up to its first failure. Not for ``fail``: what a queue finished
        after an op that failed is not trusted (the transport is suspect)."""
        with self.lock:
            # A copy first, in one C call: a completion thread pops settled Works
            # without the lock, and a thread switch inside the set's making (its
            # hashes, a garbage collection) let one change the dict under the
            # iteration ("dictionary changed size", seen on the 16-core GPU host).
            works = list(self.pending.values())
        queues = set(map(_completion_of, works))
        for queue in queues:
            if queue is not None:
                queue.settle_finished()

    def _fail_pending(self, works: list[Work], error: BaseException, wake: Wakeups) -> None:
        """Fail every one of ``works`` with its own ``abort_error(error)``: the hot loop
        of an abort (a thousand waiters), so the message and the recorded outcome are
        made once for all."""
        if not works:
            return
        make = abort_errors(error)
        if wake.later is None:
            wake.later = []  # kept tensors are freed after the waiters ran (``Wakeups``)
        settled: list[Work] = []
        settle_all(works, _FAILED, None, wake, make, settled)
        seqs: list[int] = []
        append = seqs.append
        for work in settled:  # recorded by this pass only if it settled them (else: by whoever did)
            if work._fans_out:  # a coalesced batch: each member has its own error
                self._members_failed(work)  # type: ignore[arg-type]
            else:
                append(work.seq)
        state, text = outcome(make())
        self._recorder.ended_all(seqs, state, now(), text)

    def _members_failed(self, batch: BatchWork) -> None:
        """Record how each member of a failed batch ended (its own error, from the fan-out)."""
        failed, t = self._recorder.failed, now()
        for member in batch.members:
            failed(member.seq, member._value, t)

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
