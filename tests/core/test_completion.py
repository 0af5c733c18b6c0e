"""The completion queue (``_backends/common.Completer``): who settles an op, and when.

An op that finished before anyone asks is settled by the asking thread, with no
thread hop; an op someone waits on that has not finished is waited on by the
completion thread; a failure found by an asking thread is reported by the
completion thread; ops nobody asks about are settled anyway (backlog, deadline).

The unit tests drive a Completer with ops of their own (an op finishes when the
test says so) and a real Ledger as its sink; the last tests run real Gloo at world
size 1.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import asynccoll as ac
from asynccoll._backends.common import Completer
from asynccoll._base.deadlines import DeadlineService
from asynccoll._core.ledger import Ledger
from asynccoll._core.work import _PENDING


class Op:
    """An op that finishes when the test calls ``finish()`` (optionally failing)."""

    def __init__(self) -> None:
        self.finished = threading.Event()
        self.error: BaseException | None = None
        self.waited_by: set[str] = set()

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.finished.set()


def _wait(op: Op) -> None:
    op.waited_by.add(threading.current_thread().name)
    assert op.finished.wait(10), "an op the test never finished was waited on"
    if op.error is not None:
        raise op.error


def _is_done(op: Op) -> bool:
    return op.finished.is_set()


class Sink:
    """The real ledger, noting which thread reported what."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.succeeded: list[tuple[int, str]] = []
        self.failed: list[tuple[int, str]] = []

    def succeed(self, target: Any, value: Any = None) -> None:
        self.succeed_all([target])

    def succeed_all(self, targets: Any) -> None:
        targets = list(targets)
        self.succeeded += [(t.seq, threading.current_thread().name) for t in targets]
        self.ledger.succeed_all(targets)

    def fail(self, target: Any, exc: BaseException) -> None:
        self.failed.append((target.seq, threading.current_thread().name))
        self.ledger.fail(target, exc)


def _setup(
    n: int, eager: bool = False, fixups: list[Any] | None = None
) -> tuple[Completer, Sink, list[ac.Work], list[Op]]:
    ledger = Ledger(0, deadlines=DeadlineService(), on_abort=lambda _e: None)
    sink = Sink(ledger)
    completer = Completer(
        "test-completer",
        lambda: sink,
        _wait,
        _is_done,  # type: ignore[arg-type, return-value]
        lambda exc, _t: ac.CommAborted(f"failed: {exc}"),
        eager=eager,
    )
    with ledger.lock:
        works = [ledger.reserve("all_reduce", i) for i in range(n)]
    ops = [Op() for _ in range(n)]
    for i, (op, work) in enumerate(zip(ops, works)):
        completer.watch(op, work, None if fixups is None else fixups[i])
    return completer, sink, works, ops


ME = threading.current_thread().name


@pytest.mark.timeout(30)
def test_finished_ops_are_settled_by_the_asking_thread_without_waking_the_completer() -> None:
    completer, sink, works, ops = _setup(5)
    for op in ops[:3]:
        op.finish()
    assert works[2].done()  # done() settles what finished, in order, here
    assert [w.done() for w in works] == [True, True, True, False, False]
    assert works[1].result() == 1  # the value given at reserve: an in-place op's tensor
    assert {name for _, name in sink.succeeded} == {ME}
    assert completer.thread is None  # nobody waited on an unfinished op: no thread
    for op in ops[3:]:
        op.finish()
    assert works[4].wait(5) == 4
    assert all(name == ME for _, name in sink.succeeded) and len(sink.succeeded) == 5
    assert all(not op.waited_by - {ME} for op in ops)
    completer.stop()


@pytest.mark.timeout(30)
def test_an_unfinished_op_someone_awaits_is_waited_on_by_the_completion_thread() -> None:
    completer, sink, works, ops = _setup(3)

    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, ops[0].finish)
        loop.call_later(0.1, ops[1].finish)
        loop.call_later(0.1, ops[2].finish)
        return [await w for w in works]

    assert asyncio.run(main()) == [0, 1, 2]
    assert completer.thread is not None
    waiter = completer.thread.name
    assert sink.succeeded[0] == (1, waiter)  # op 0 had not finished when awaited
    assert waiter in ops[0].waited_by
    completer.stop(join_timeout=5)
    assert not completer.thread.is_alive()


@pytest.mark.timeout(30)
def test_a_failure_found_by_an_asking_thread_is_reported_by_the_completion_thread() -> None:
    completer, sink, works, ops = _setup(3)
    ops[0].finish()
    ops[1].finish(RuntimeError("peer gone"))
    ops[2].finish()
    works[2].done()  # op 0 settles here; op 1 failed: handed over, not reported here
    assert sink.succeeded == [(1, ME)]
    with pytest.raises(ac.CommAborted, match="peer gone"):
        works[1].wait(5)
    assert completer.thread is not None
    assert sink.failed == [(2, completer.thread.name)]
    assert sink.ledger.state.value == "aborted"
    assert isinstance(works[2].exception(), ac.CommAborted)  # the abort failed the rest
    completer.stop(join_timeout=5)


@pytest.mark.timeout(30)
def test_ops_nobody_asks_about_are_settled_once_they_pile_up() -> None:
    n = 3 * Completer.backlog
    completer, sink, works, ops = _setup(0)
    ledger = sink.ledger
    for i in range(n):
        with ledger.lock:
            work = ledger.reserve("all_reduce", i)
        op = Op()
        op.finish()
        completer.watch(op, work, None)
        works.append(work)
    deadline = time.monotonic() + 10
    while len(sink.succeeded) < 2 * Completer.backlog and time.monotonic() < deadline:
        time.sleep(0.01)
    assert completer.thread is not None
    settled_by_thread = [seq for seq, name in sink.succeeded if name == completer.thread.name]
    assert len(settled_by_thread) >= 2 * Completer.backlog - 1  # nobody asked: the thread did
    assert len(ledger.pending) <= Completer.backlog
    completer.stop(join_timeout=5)


@pytest.mark.timeout(30)
def test_eager_queue_waits_on_every_op_at_once() -> None:
    completer, sink, works, ops = _setup(2, eager=True)
    assert completer.thread is not None  # rung by the first op already
    ops[0].finish()
    ops[1].finish()
    deadline = time.monotonic() + 10
    while len(sink.succeeded) < 2 and time.monotonic() < deadline:  # nobody asks
        time.sleep(0.01)
    assert sink.succeeded == [(1, completer.thread.name), (2, completer.thread.name)]
    completer.stop(join_timeout=5)


@pytest.mark.timeout(30)
def test_an_eager_queue_is_waited_on_by_its_thread_only() -> None:
    """Gloo's send/recv report is_completed() once the thread's wait() returned, and a
    second wait() on them never returns: asking about them must not wait here (it did,
    and deadlocked the loop: done() after an issue reaped the recv the thread had just
    waited on)."""
    completer, sink, works, ops = _setup(3, eager=True)
    for op in ops:
        op.finish()
    for w in works:
        w.done()  # may settle nothing here; must not wait here
    assert [w.wait(5) for w in works] == [0, 1, 2]
    assert all(ME not in op.waited_by for op in ops), [op.waited_by for op in ops]
    completer.stop(join_timeout=5)


@pytest.mark.timeout(60)
def test_each_fixup_runs_once_when_threads_race_to_settle() -> None:
    n = 400
    runs = [0] * n

    def fixup(i: int) -> Any:
        def run() -> None:
            runs[i] += 1

        return run

    completer, sink, works, ops = _setup(n, fixups=[fixup(i) for i in range(n)])
    stop = threading.Event()

    def asker(offset: int) -> None:
        while not stop.is_set():
            for w in works[offset::3]:
                w.done()

    askers = [threading.Thread(target=asker, args=(k,)) for k in range(3)]
    for t in askers:
        t.start()
    try:
        for op in ops:
            op.finish()
        for w in works:
            w.wait(10)
    finally:
        stop.set()
        for t in askers:
            t.join(10)
    assert runs == [1] * n
    assert sorted(seq for seq, _ in sink.succeeded) == list(range(1, n + 1))
    completer.stop(join_timeout=5)


@pytest.mark.timeout(30)
def test_a_failed_flattened_batch_settles_its_one_pending_entry() -> None:
    """A batch's members fail through a Bundle (a flattened op that failed): the batch's
    pending entry, whose seq is its first member's, must fail too, or whoever awaits the
    batch hangs (it did: the failure popped the entry by the first member's seq)."""
    from asynccoll._base.ops import OpKind, OpSpec
    from asynccoll._core.work import Bundle

    ledger = Ledger(0, deadlines=DeadlineService(), on_abort=lambda _e: None)
    sink = Sink(ledger)
    completer = Completer(
        "test-completer",
        lambda: sink,
        _wait,
        _is_done,  # type: ignore[arg-type, return-value]
        lambda exc, _t: ac.PeerFailure(f"lost: {exc}"),
    )
    spec = OpSpec(OpKind.ALL_REDUCE, torch.ones(2))
    head = None
    members = []
    for i in range(3):
        m = ledger.reserve_member("all_reduce", i, None, head)
        head = m._batch
        members.append(m)
    with ledger.lock:
        ledger.commit_all(members, [spec] * 3, 30.0)
    op = Op()
    completer.watch(op, Bundle(list(members), "all_reduce"))
    op.finish(RuntimeError("Connection closed by peer"))

    async def main() -> list[Any]:
        return await asyncio.wait_for(asyncio.gather(*members, return_exceptions=True), 10)

    got = asyncio.run(main())
    assert all(isinstance(e, ac.CommAborted) for e in got), got
    assert head is not None and head.done() and not ledger.pending
    completer.stop(join_timeout=5)


# ------------------------------------------------------------------ real Gloo
def _alone(timeout: float) -> Any:
    return ac.init("gloo", rank=0, world_size=1, store=dist.HashStore(), timeout=timeout)


@pytest.mark.timeout(60)
def test_an_op_nobody_awaits_past_its_deadline_is_a_success_not_a_timeout() -> None:
    async def main() -> tuple[str, Any, bool]:
        async with _alone(timeout=0.3) as comm:
            t = torch.ones(3)
            work = comm.all_reduce(t)  # finishes at once; nobody looks at it
            await asyncio.sleep(1.0)  # its deadline passes
            state = comm.state
            return state, work.exception(), work.done()

    state, exc, done = asyncio.run(main())
    assert (state, exc, done) == ("ok", None, True)


@pytest.mark.timeout(60)
def test_awaiting_finished_gloo_ops_needs_no_completion_thread() -> None:
    async def main() -> tuple[bool, list[float]]:
        async with _alone(timeout=30) as comm:
            ts = [torch.full((2,), float(i)) for i in range(20)]
            works = [comm.all_reduce(t) for t in ts]
            deadline = time.monotonic() + 10
            while not works[-1].done() and time.monotonic() < deadline:  # settles here
                time.sleep(0.005)
            got = [float((await w)[0]) for w in works]
            waiter = comm._cpu_backend._waiter  # type: ignore[attr-defined]
            return waiter.thread is None, got

    no_thread, got = asyncio.run(main())
    assert got == [float(i) for i in range(20)]
    assert no_thread


@pytest.mark.timeout(60)
def test_issuing_settles_nothing_and_asking_settles_the_finished_ops_in_one_burst() -> None:
    async def main() -> tuple[bool, int, int, bool, int]:
        async with _alone(timeout=30) as comm:
            waiter = comm._cpu_backend._waiter  # type: ignore[attr-defined]
            works = []
            for i in range(20):
                works.append(comm.all_reduce(torch.full((2,), float(i))))
                deadline = time.monotonic() + 10
                while waiter._fifo and time.monotonic() < deadline:  # the op finishes (Gloo's view:
                    if waiter._fifo[-1][0].is_completed():  # nothing of ours is asked or settled)
                        break
                    time.sleep(0.0002)
            open_after_issue = sum(
                w._state == _PENDING for w in works
            )  # (done() would settle them)
            last_done = works[-1].done()  # the protocol: settles the finished head, here
            open_after_ask = sum(w._state == _PENDING for w in works)
            no_thread = waiter.thread is None
            await asyncio.gather(*works)
            return no_thread, open_after_issue, open_after_ask, last_done, len(waiter._fifo)

    no_thread, open_after_issue, open_after_ask, last_done, left = asyncio.run(main())
    assert open_after_issue == 20  # issuing has no side effect: nothing was settled
    assert last_done and open_after_ask == 0  # one question settled every finished op
    assert no_thread  # all on the asking thread
    assert left == 0


@pytest.mark.timeout(30)
def test_the_completion_thread_drops_an_op_only_after_reporting_it() -> None:
    # The backend's op (a torch Work) dies where its last reference goes; its destructor
    # took about 5 us of the completion thread's time before the wake-up when it went first.
    settled_at_drop: list[bool] = []
    ledger = Ledger(0, deadlines=DeadlineService(), on_abort=lambda _e: None)
    sink = Sink(ledger)
    completer = Completer(
        "test-completer",
        lambda: sink,
        _wait,
        _is_done,  # type: ignore[arg-type, return-value]
        lambda exc, _t: ac.CommAborted(f"failed: {exc}"),
    )
    with ledger.lock:
        work = ledger.reserve("all_reduce", 7)

    class Dying(Op):
        def __del__(self) -> None:
            settled_at_drop.append(work._state != _PENDING)

    op = Dying()
    completer.watch(op, work, None)
    finished = op.finished
    del op  # only the completer holds the op now

    async def main() -> Any:
        asyncio.get_running_loop().call_later(0.05, finished.set)
        return await work

    assert asyncio.run(main()) == 7
    assert completer.thread is not None and sink.succeeded == [(1, completer.thread.name)]
    deadline = time.monotonic() + 5
    while not settled_at_drop and time.monotonic() < deadline:
        time.sleep(0.01)
    assert settled_at_drop == [True]
    completer.stop(join_timeout=5)
