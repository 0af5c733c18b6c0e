"""The ledger, the shared deadline service, completion from any loop or thread, and
what a communicator leaves behind: unit tests and real 2-rank runs."""

from __future__ import annotations

import asyncio
import gc
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from typing import Any

import anyio
import pytest
import torch

import asynccoll as ac
from asynccoll._base.deadlines import DeadlineService
from asynccoll._core.ledger import Ledger, clone_error
from asynccoll.testing import RankContext, run_ranks, skip_collective
from tests.support.backends import LOOPS
from tests.support.paths import child_env
from tests.support.spies import Sets


def test_a_cloned_error_keeps_what_the_contract_names() -> None:
    """Each Work of a failed batch gets its own copy of the error: the copies keep the
    fields the contract documents (``ranks``; ``seq``, ``op``; ``seq``, ``details``,
    ``fields``), not just the type and message."""
    mismatch = ac.CollectiveMismatch(
        "m", 7, {0: {"op": "all_reduce"}, 1: {"op": "broadcast"}}, ("op",)
    )
    cases = [
        (ac.PeerFailure("p", (2,)), ("ranks",)),
        (ac.CollectiveTimeout("t", 3, "all_reduce"), ("seq", "op")),
        (mismatch, ("seq", "details", "fields")),
    ]
    for error, names in cases:
        copy = clone_error(error)
        assert copy is not error and type(copy) is type(error) and str(copy) == str(error)
        for name in names:
            assert getattr(copy, name) == getattr(error, name), name


# ------------------------------------------------------------ deadline service
class _Target:
    def __init__(self) -> None:
        self.live: set[int] = set()
        self.fired: list[int] = []
        self.done = threading.Event()

    def is_live(self, seq: int) -> bool:
        return seq in self.live

    def expired(self, seq: int) -> None:
        self.fired.append(seq)
        self.live.discard(seq)
        if not self.live:
            self.done.set()


def test_deadline_added_while_the_timer_examines_the_heap_is_not_lost() -> None:
    """The first timer read heap[0], asked is_live(), then popped: an earlier deadline
    pushed in between was popped in place of the examined one and never fired."""
    service = DeadlineService(name="test-deadlines")
    target = _Target()
    client = service.client(target)
    injected = []

    class Racing(_Target):
        def is_live(self, seq: int) -> bool:
            if seq == 1 and not injected and time.monotonic() >= due1:  # seq 1 is due now
                injected.append(True)
                # Another thread registers an earlier deadline right now.
                t = threading.Thread(target=client.add, args=(2, 0.01, time.monotonic() - 1.0))
                t.start()
                t.join(0.2)  # blocks on the service's lock in the fixed version
            return super().is_live(seq)

    racing = Racing()
    client._target = lambda: racing  # type: ignore[method-assign,assignment]
    racing.live.update({1, 2})
    due1 = time.monotonic() + 0.05
    client.add(1, 0.05, due1)
    assert racing.done.wait(5.0), f"a deadline was lost: fired {racing.fired}"
    assert injected, "the race was not provoked"
    assert sorted(racing.fired) == [1, 2]  # each once (the first timer also fired seq 1 twice)
    client.close()


def test_deadline_service_fires_each_live_entry_once_under_concurrent_adds() -> None:
    service = DeadlineService(name="test-deadlines")
    target = _Target()
    client = service.client(target)
    n = 2000
    target.live.update(range(n))

    def add(start: int) -> None:
        for seq in range(start, n, 4):
            client.add(seq, 0.02 + (seq % 7) * 0.001)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert target.done.wait(10.0), f"{len(target.live)} deadlines never fired"
    assert sorted(target.fired) == list(range(n))
    client.close()


def test_in_order_deadlines_share_one_heap_entry_and_a_shorter_one_is_not_delayed() -> None:
    """Deadlines added in order queue in the client's FIFO (one heap entry for all);
    a shorter timeout added after them fires first, from the heap; settled entries
    do not pile up."""
    service = DeadlineService(name="test-deadlines-fifo")
    target = _Target()
    client = service.client(target)
    target.live.update(range(1, 6))
    start = time.monotonic()
    for seq in range(1, 5):
        client.add(seq, 0.4)
    assert len(service) == 1  # four deadlines, one entry in the shared heap
    client.add(5, 0.05)  # shorter: out of the FIFO's order
    assert len(service) == 2
    assert target.done.wait(5.0), f"deadlines lost: fired {target.fired}"
    assert target.fired[0] == 5 and sorted(target.fired[1:]) == [1, 2, 3, 4], target.fired
    assert time.monotonic() - start >= 0.4
    # Many ops that settle at once: the FIFO keeps only the live ones.
    target.done.clear()
    for seq in range(100, 10_100):
        client.add(seq, 60.0)  # none is live: each settled at once
    assert len(client._fifo) <= 2048, len(client._fifo)  # type: ignore[attr-defined]
    client.close()


def test_deadline_service_thread_ends_when_no_client_is_left() -> None:
    service = DeadlineService(name="test-deadlines-end")
    target = _Target()
    client = service.client(target)
    target.live.add(1)
    client.add(1, 0.01)
    assert target.done.wait(5.0)
    thread = service.thread
    assert thread is not None
    del client
    gc.collect()
    # The sleeping thread notices at its next wake-up; a close() would notify it.
    service.client(_Target()).close()
    thread.join(5.0)
    assert not thread.is_alive()


# ------------------------------------------------------------ ledger, no transport
def _ledger() -> tuple[Ledger, list[BaseException]]:
    aborted: list[BaseException] = []
    return Ledger(0, deadlines=DeadlineService(), on_abort=aborted.append), aborted


@pytest.mark.parametrize("where", ["thread", "loop"])
def test_abort_wakes_a_thousand_waiters_with_one_wakeup_per_loop(where: str) -> None:
    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        posts = []
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counting(fn: Any, *args: Any) -> Any:
            posts.append(fn)
            return call_soon_threadsafe(fn, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        ledger, aborted = _ledger()
        with ledger.lock:
            works = [ledger.reserve("all_reduce") for _ in range(1000)]

        async def waiter(w: ac.Work) -> type:
            try:
                await w
            except BaseException as exc:  # noqa: BLE001 - the type is the assertion
                return type(exc)
            return type(None)

        tasks = [asyncio.create_task(waiter(w)) for w in works]
        await asyncio.sleep(0)  # every task is parked on its Work
        if where == "thread":
            t = threading.Thread(target=ledger.abort, args=(ac.CommAborted("stop"),))
            t.start()
            t.join()
        else:
            ledger.abort(ac.CommAborted("stop"))
        kinds = await asyncio.gather(*tasks)
        assert set(kinds) == {ac.CommAborted} and len(aborted) == 1
        assert ledger.state.value == "aborted" and not ledger.pending
        return len(posts), len(kinds)

    posts, n = asyncio.run(main())
    assert n == 1000
    assert posts == (1 if where == "thread" else 0)


def test_abort_on_the_loop_hands_its_waiters_the_error_at_once_and_defers_callbacks() -> None:
    """Aborting on the loop's own thread gives the awaiting futures their error during
    the call (a future only schedules its task), so a waiter wakes on the very next
    loop iteration; a cancelled wait is left alone; done callbacks never run inline."""

    async def main() -> None:
        ledger, _ = _ledger()
        with ledger.lock:
            a, b = ledger.reserve("all_reduce"), ledger.reserve("all_reduce")

        async def waiter(w: ac.Work) -> None:
            await w

        ta, tb = asyncio.ensure_future(waiter(a)), asyncio.ensure_future(waiter(b))
        await asyncio.sleep(0)  # both tasks are parked on their Works
        tb.cancel()
        await asyncio.sleep(0)
        assert tb.cancelled() and not ta.done()
        seen: list[str] = []
        a.add_done_callback(lambda w: seen.append("callback"))
        ledger.abort(ac.CommAborted("stop"))  # settling a cancelled wait must not raise here
        assert seen == []  # never inline, even on the loop's own thread
        await asyncio.sleep(0)  # one iteration: the waiter already ran
        assert ta.done() and isinstance(ta.exception(), ac.CommAborted)
        await asyncio.sleep(0)
        assert seen == ["callback"]

    asyncio.run(main())


class _Kept:
    """Something a Work keeps alive (its tensors), watched through a weak reference."""


def test_abort_on_the_loop_drops_what_the_works_kept_once_their_waiters_ran() -> None:
    """An abort of many Works frees their kept tensors and results after it woke the
    waiters (freeing costs more than failing): on the aborting loop, behind the woken
    tasks; and nothing stays referenced one iteration later."""

    async def main() -> None:
        ledger, _ = _ledger()
        kept, values = _Kept(), _Kept()
        with ledger.lock:
            work = ledger.reserve("all_reduce", values, (kept,))
        refs = weakref.ref(kept), weakref.ref(values)
        del kept, values
        seen: list[tuple[bool, bool]] = []

        async def waiter() -> None:
            try:
                await work
            except ac.CommAborted:
                seen.append((refs[0]() is not None, refs[1]() is not None))

        task = asyncio.ensure_future(waiter())
        await asyncio.sleep(0)  # parked on its Work
        ledger.abort(ac.CommAborted("stop"))
        await asyncio.wait_for(task, 5.0)
        assert seen == [(True, True)]  # the waiter ran first
        assert work._keep is None and isinstance(work.exception(), ac.CommAborted)
        await asyncio.sleep(0)
        assert refs[0]() is None and refs[1]() is None

    asyncio.run(main())


def test_abort_off_the_loop_drops_what_the_works_kept_before_it_returns() -> None:
    async def main() -> None:
        ledger, _ = _ledger()
        kept = _Kept()
        with ledger.lock:
            work = ledger.reserve("all_reduce", None, (kept,))
        ref = weakref.ref(kept)
        del kept
        task = asyncio.ensure_future(asyncio.wait_for(asyncio.shield(_await(work)), 5.0))
        await asyncio.sleep(0)
        t = threading.Thread(target=ledger.abort, args=(ac.CommAborted("stop"),))
        t.start()
        t.join(5.0)
        assert ref() is None  # no loop of the aborting thread to defer to
        with pytest.raises(ac.CommAborted):
            await task

    asyncio.run(main())


async def _await(work: ac.Work) -> Any:
    return await work


def test_abort_fails_every_kind_of_waiting_as_settling_each_work_would() -> None:
    """The abort's bulk path takes a short cut for the common Work (one waiter on the
    aborting loop); every other kind must still be woken: two waiters, a waiter on
    another thread's loop, a blocked ``wait()``, a done callback, a cancelled wait,
    nobody waiting. Each Work raises its own exception object."""

    async def main() -> None:
        ledger, aborted = _ledger()
        with ledger.lock:
            works = [ledger.reserve("all_reduce") for _ in range(7)]
        one, two, other_loop, blocked, callback, cancelled, nobody = works
        tasks = [asyncio.ensure_future(_await(w)) for w in (one, two, two, cancelled)]
        elsewhere: list[BaseException] = []

        def run_elsewhere() -> None:
            async def wait_there() -> None:
                try:
                    await other_loop
                except ac.CommAborted as exc:
                    elsewhere.append(exc)

            asyncio.run(asyncio.wait_for(wait_there(), 5.0))

        def block() -> None:
            try:
                blocked.wait(5.0)
            except ac.CommAborted as exc:
                elsewhere.append(exc)

        threads = [threading.Thread(target=run_elsewhere), threading.Thread(target=block)]
        for t in threads:
            t.start()
        called: list[ac.Work] = []
        callback.add_done_callback(called.append)
        deadline = time.monotonic() + 5.0
        while (
            other_loop._waiters is None or blocked._waiters is None
        ) and time.monotonic() < deadline:
            await asyncio.sleep(0.001)  # the other thread's waiter and the blocked wait() are in
        await asyncio.sleep(0)
        tasks[3].cancel()
        ledger.abort(ac.CommAborted("stop"))
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5.0)
        for t in threads:
            t.join(5.0)
        assert [type(x) for x in done] == [ac.CommAborted] * 3 + [asyncio.CancelledError]
        assert len(elsewhere) == 2 and all(isinstance(e, ac.CommAborted) for e in elsewhere)
        await asyncio.sleep(0)
        assert called == [callback]
        errors = [w.exception() for w in works]
        assert all(isinstance(e, ac.CommAborted) for e in errors)
        assert len({id(e) for e in errors}) == len(works)  # each Work its own exception
        assert nobody.done() and len(aborted) == 1 and not ledger.pending

    asyncio.run(main())


def test_an_abort_takes_the_works_shared_lock_once_and_still_settles_a_work_locked_alone() -> None:
    """Settling is one pass under the lock a ledger's Works share (``settle_all``): an
    abort of a hundred takes it once, not a hundred times; a Work with a lock of its own
    among them is settled on its own, like the rest."""

    class CountingLock:
        def __init__(self) -> None:
            self.inner, self.entered = threading.Lock(), 0

        def __enter__(self) -> bool:
            self.entered += 1
            return self.inner.__enter__()

        def __exit__(self, *exc: Any) -> None:
            self.inner.__exit__(*exc)

    ledger, aborted = _ledger()
    ledger.work_lock = lock = CountingLock()  # type: ignore[assignment]
    with ledger.lock:
        works = [ledger.reserve("all_reduce") for _ in range(100)]
        alone = ac.Work("all_reduce", 101)  # a Work made with a lock of its own
        ledger.pending[alone.seq] = alone
    called: list[ac.Work] = []
    works[7].add_done_callback(called.append)  # (takes the lock once, before the abort)
    before = lock.entered
    ledger.abort(ac.CommAborted("stop"))
    assert lock.entered - before == 1
    errors = [w.exception() for w in [*works, alone]]
    assert all(isinstance(e, ac.CommAborted) for e in errors)
    assert len({id(e) for e in errors}) == len(errors)  # each Work its own exception
    assert called == [works[7]] and len(aborted) == 1 and not ledger.pending


def test_no_success_is_reported_after_abort_and_state_leads_the_error() -> None:
    ledger, _ = _ledger()
    with ledger.lock:
        a = ledger.reserve("all_reduce")
        b = ledger.reserve("broadcast")
    seen: list[str] = []
    a.add_done_callback(lambda w: seen.append(ledger.state.value))
    ledger.fail(a, ac.CollectiveTimeout("late", a.seq, a.op))
    assert seen == ["aborted"]  # the state changed before anyone saw the error
    ledger.succeed(b)  # Gloo reports force-completed works as successes
    assert isinstance(b.exception(), ac.CommAborted)
    assert isinstance(b.exception().__cause__, ac.CollectiveTimeout)
    assert isinstance(ledger.error, ac.CommAborted)


def _own_failure(kind: str, work: ac.Work) -> ac.AsyncCollError:
    if kind == "timeout":
        return ac.CollectiveTimeout("late", work.seq, work.op)
    if kind == "mismatch":
        return ac.CollectiveMismatch(
            "differs", work.seq, {0: {"op": "all_reduce"}, 1: {"op": "broadcast"}}, ["op"]
        )
    if kind == "peer":
        return ac.PeerFailure("rank 1 died", [1])
    return ac.CommAborted("the backend failed")


@pytest.mark.parametrize("kind", ["timeout", "mismatch", "peer", "aborted"])
def test_every_error_after_which_the_communicator_is_aborted_is_a_comm_aborted(kind: str) -> None:
    """ "The communicator is dead" is one ``except ac.CommAborted``: the failed op's own
    error, the other pending ops', ``comm.error`` and every later call's. A timeout or a
    mismatch is the failed op's alone; the rest get a plain CommAborted caused by it."""
    ledger, aborted = _ledger()
    with ledger.lock:
        failing = ledger.reserve("all_reduce")
        other = ledger.reserve("broadcast")
    error = _own_failure(kind, failing)
    ledger.fail(failing, error)
    assert failing.exception() is error and aborted == [ledger.error]
    seen = [failing.exception(), other.exception(), ledger.error, ledger.unusable()]
    assert all(isinstance(e, ac.CommAborted) for e in seen), seen
    if kind in ("timeout", "mismatch"):
        assert type(other.exception()) is ac.CommAborted and other.exception().__cause__ is error
        assert type(ledger.error) is ac.CommAborted and ledger.error.__cause__ is error
    elif kind == "peer":
        assert isinstance(other.exception(), ac.PeerFailure) and ledger.error is error
    else:
        assert type(other.exception()) is ac.CommAborted and ledger.error is error


def test_an_expired_deadline_and_an_abort_for_a_foreign_reason_are_comm_aborted() -> None:
    ledger, _ = _ledger()
    with ledger.lock:
        late = ledger.reserve("all_reduce")
        other = ledger.reserve("broadcast")
    ledger.expired(late.seq)
    timeout = late.exception()
    assert isinstance(timeout, ac.CollectiveTimeout) and isinstance(timeout, ac.CommAborted)
    assert isinstance(timeout, TimeoutError) and (timeout.seq, timeout.op) == (
        late.seq,
        "all_reduce",
    )
    assert type(other.exception()) is ac.CommAborted and other.exception().__cause__ is timeout
    foreign, _ = _ledger()
    with foreign.lock:
        pending = foreign.reserve("all_reduce")
    interrupt = KeyboardInterrupt()
    foreign.abort(interrupt)
    assert (
        type(pending.exception()) is ac.CommAborted and pending.exception().__cause__ is interrupt
    )
    assert isinstance(foreign.error, ac.CommAborted)


def test_discard_gives_seqs_back_only_when_nothing_came_after() -> None:
    ledger, _ = _ledger()
    with ledger.lock:
        works = [ledger.reserve("all_reduce") for _ in range(3)]
        ledger.discard(works)
        assert ledger.last_seq == 0
        first = ledger.reserve("x")
        second = ledger.reserve("y")
        ledger.discard([first])  # `second` took a later seq: a gap remains
        assert ledger.last_seq == 2 and list(ledger.pending) == [second.seq]


# ------------------------------------------------------------ real ranks
async def completion_without_issuing_loop(comm: ac.Communicator) -> dict:
    """A Work issued on this loop completes for another loop's task and for a
    blocked thread while this loop is blocked (time.sleep) or idle."""
    t = torch.ones(4)
    if comm.rank == 1:
        await anyio.sleep(0.3)  # rank 0's op stays pending meanwhile
        await comm.all_reduce(t)
        return {}
    work = comm.all_reduce(t)
    seen: dict[str, float] = {}

    def other_loop() -> None:
        async def wait() -> None:
            await work

        asyncio.run(wait())
        seen["loop"] = time.monotonic()

    def blocking() -> None:
        work.wait(20)
        seen["thread"] = time.monotonic()

    threads = [threading.Thread(target=other_loop), threading.Thread(target=blocking)]
    for th in threads:
        th.start()
    time.sleep(3.0)  # this loop is blocked: it cannot relay anything
    unblocked = time.monotonic()
    for th in threads:
        th.join(20)
    assert work.done() and work.result() is t
    return {"loop": unblocked - seen["loop"], "thread": unblocked - seen["thread"]}


@pytest.mark.parametrize("loop", LOOPS)
def test_completion_reaches_other_loops_and_threads_while_the_issuing_loop_is_blocked(
    loop: str,
) -> None:
    results = run_ranks(
        completion_without_issuing_loop, world_size=2, backend="gloo", timeout=60, loop=loop
    )
    assert results[0]["loop"] > 1.0 and results[0]["thread"] > 1.0, results[0]


async def state_when_error_is_seen(comm: ac.Communicator) -> str:
    if comm.rank == 1:
        skip_collective(comm)
        await comm.all_reduce(torch.ones(2))
        for _ in range(200):
            if comm.state == "aborted":
                break
            await anyio.sleep(0.02)
        return comm.state
    with pytest.raises(ac.CollectiveTimeout):
        await comm.all_reduce(torch.ones(2), timeout=0.5)
    return comm.state  # read at once, on the same loop turn


@pytest.mark.parametrize("loop", LOOPS)
def test_state_is_aborted_when_the_waiter_sees_the_timeout(loop: str) -> None:
    assert run_ranks(
        state_when_error_is_seen, world_size=2, backend="gloo", timeout=60, loop=loop
    ) == [
        "aborted",
        "aborted",
    ]


def _own_threads() -> set[str]:
    # The process-wide deadline thread and the test kit's executor threads are not the communicator's.
    return {
        t.name
        for t in threading.enumerate()
        if t.name.startswith("asynccoll-")
        and "deadlines" not in t.name
        and not t.name.startswith("asynccoll-rank")
    }


async def dropped_without_close(ctx: RankContext) -> dict:
    before = _own_threads()
    # timeout=2: Gloo cannot interrupt an op in flight; the thread waiting on rank 0's
    # pending op ends when Gloo's own timeout fails it.
    comm = await ac.init(
        "gloo", rank=ctx.rank, world_size=ctx.world_size, store=ctx.store, heartbeat=0, timeout=2
    )
    await comm.all_reduce(torch.ones(2))
    await comm.send(torch.ones(1), 1 - ctx.rank) if ctx.rank == 0 else await comm.recv(
        torch.ones(1), 0
    )
    during = _own_threads() - before
    pending = comm.all_reduce(torch.ones(2)) if ctx.rank == 0 else None  # rank 1 never joins
    del comm
    gc.collect()
    for _ in range(500):
        if not (_own_threads() - before):
            break
        await asyncio.sleep(0.02)
    after = _own_threads() - before
    failed = None
    if pending is not None:
        with pytest.raises(ac.CommAborted):
            await pending
        failed = type(pending.exception()).__name__
    return {"during": sorted(during), "after": sorted(after), "failed": failed}


def test_a_communicator_dropped_without_close_ends_its_threads() -> None:
    results = run_ranks(dropped_without_close, world_size=2, backend=None, timeout=60)
    for r in results:
        assert r["during"], r  # the completion threads did run
        assert r["after"] == [], r
    assert results[0]["failed"] == "CommAborted"


async def scope_exit_by_exception(ctx: RankContext) -> dict:
    class Boom(Exception):
        pass

    t0 = time.monotonic()
    if ctx.rank == 0:
        with pytest.raises(Boom):
            async with ac.init("gloo", rank=0, world_size=2, store=ctx.store, timeout=60) as comm:
                work = comm.all_reduce(torch.ones(2))  # rank 1 is not there yet
                raise Boom()
        assert isinstance(comm.error, ac.CommAborted) and "Boom" in str(comm.error)
        assert isinstance(work.exception(), ac.CommAborted)
        return {"elapsed": time.monotonic() - t0}
    comm = await ac.init("gloo", rank=1, world_size=2, store=ctx.store, timeout=60)
    await asyncio.sleep(0.5)
    # Rank 0 left by an exception: this op must fail promptly, not at its 60 s deadline.
    with pytest.raises(ac.CommAborted):
        await comm.all_reduce(torch.ones(2))
    elapsed = time.monotonic() - t0
    await comm.close()
    return {"elapsed": elapsed}


def test_leaving_the_scope_by_an_exception_aborts_and_peers_learn_it_promptly() -> None:
    results = run_ranks(scope_exit_by_exception, world_size=2, backend=None, timeout=60)
    assert results[0]["elapsed"] < 10 and results[1]["elapsed"] < 10, results


async def abort_on_the_loop(comm: ac.Communicator) -> dict:
    t0 = time.monotonic()
    if comm.rank == 1:  # joins nothing: rank 0's news must reach it
        while comm.state == "ok" and time.monotonic() - t0 < 20:
            await asyncio.sleep(0.01)
        return {"state": comm.state, "elapsed": time.monotonic() - t0}
    work = comm.all_reduce(torch.ones(2))  # rank 1 never joins
    deadlines = comm._ledger._deadlines
    clients = deadlines._service._clients
    assert comm._liveness is not None
    service = comm._liveness._service
    sets = Sets(service._wake)
    seen: dict[str, Any] = {}

    async def waiter() -> None:
        try:
            await work
        except ac.CommAborted:
            seen.update(registered=deadlines in clients, woke=sets.n)

    task = asyncio.ensure_future(waiter())
    await asyncio.sleep(0.05)  # parked on its Work
    comm.abort("stop")
    await asyncio.wait_for(task, 10)
    await asyncio.sleep(0)  # the callback queued behind the woken waiter ran
    return {**seen, "registered_after": deadlines in clients, "woke_after": sets.n}


def test_an_abort_on_the_loop_wakes_the_service_threads_after_its_waiters_ran() -> None:
    """``abort()`` on the loop: the waiter has its error before the liveness and deadline
    services are woken (a woken thread would take the GIL from the waiters); one loop
    iteration later both are, and the peer hears the news promptly."""
    results = run_ranks(abort_on_the_loop, world_size=2, backend="gloo", timeout=60)
    mine, peer = results
    assert mine["registered"] and mine["woke"] == 0, mine  # nothing woken before the waiter ran
    assert not mine["registered_after"] and mine["woke_after"] >= 1, mine
    assert peer["state"] == "aborted" and peer["elapsed"] < 15, peer


async def bounded_close(comm: ac.Communicator) -> dict:
    if comm.rank == 1:
        skip_collective(comm)
    work = comm.all_reduce(torch.ones(2))
    t0 = time.monotonic()
    await comm.close(timeout=0.5)
    return {
        "elapsed": time.monotonic() - t0,
        "state": comm.state,
        "done": work.done() or comm.rank == 1,
    }


def test_close_is_bounded_with_ops_in_flight() -> None:
    results = run_ranks(bounded_close, world_size=2, backend="gloo", timeout=60)
    assert results[0]["elapsed"] < 5 and results[0]["state"] == "closed" and results[0]["done"], (
        results
    )


_SIGINT_RANK = textwrap.dedent(
    """
    import asyncio, signal, sys, torch
    # A terminal's Ctrl-C: Python's handler even if this test runs with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from datetime import timedelta
    import torch.distributed as dist
    import asynccoll as ac

    async def main(rank, port):
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
        async with ac.init("gloo", rank=rank, world_size=2, store=store, timeout=60) as comm:
            await comm.all_reduce(torch.ones(2))
            print("ready", flush=True)
            if rank == 0:
                await comm.all_reduce(torch.ones(2))  # rank 1 never joins: a long op
            else:
                await asyncio.sleep(60)

    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
    """
)


@pytest.mark.timeout(60)
def test_ctrl_c_during_a_long_op_exits_promptly(tmp_path: Any) -> None:
    from tests.support.ports import unused_port

    port = unused_port()
    script = tmp_path / "rank.py"
    script.write_text(_SIGINT_RANK)
    env = child_env()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        t0 = time.monotonic()
        procs[0].send_signal(signal.SIGINT)
        outs = [p.communicate(timeout=20) for p in procs[:1]]
        procs[1].send_signal(signal.SIGINT)
        outs += [procs[1].communicate(timeout=20)]
        elapsed = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert elapsed < 15, elapsed
    for p, (_, err) in zip(procs, outs):
        assert "terminate called" not in err, err
        assert p.returncode != -signal.SIGABRT, err


def test_a_call_after_a_peer_failure_raises_peer_failure_naming_the_ranks() -> None:
    """The documented recipe, ``except ac.PeerFailure: comm = await comm.shrink()``, must
    catch a call made after the failure's news arrived too (the news can beat the call:
    a rank computing while a peer dies), not only the ops pending when it came.
    Before, such a call raised a plain CommAborted (test_elastic's death during
    broadcast_state failed on it in CI, 1 run in about 10)."""
    ledger, aborted = _ledger()
    with ledger.lock:
        pending = ledger.reserve("all_reduce")
    news = ac.PeerFailure("rank 1 died", [1])
    ledger.abort(news)
    assert aborted and pending.exception() is not None
    later = ledger.unusable()
    assert isinstance(later, ac.PeerFailure) and later.ranks == (1,), later
    assert later.__cause__ is news
    ledger.abort(ac.CommAborted("then someone aborted"))  # the first failure stays the reason
    assert isinstance(ledger.unusable(), ac.PeerFailure)
    timeout_ledger, _ = _ledger()
    timeout_ledger.abort(ac.CommAborted("shutting down"))
    plain = timeout_ledger.unusable()
    assert type(plain) is ac.CommAborted  # an abort that is not a peer's death stays a CommAborted


def test_an_abort_gathering_queues_survives_a_completion_popping_meanwhile() -> None:
    """An abort asks each pending Work for its completion queue while a completion
    thread pops settled Works without the lock (here: inside the queue's hash, where a
    thread switch can happen). Seen on the 16-core GPU host: "dictionary changed size
    during iteration" out of ``comm.abort()``, the Works never failed."""
    ledger, aborted = _ledger()
    with ledger.lock:
        first, second = ledger.reserve("all_reduce"), ledger.reserve("all_reduce")

    class Queue:
        def __hash__(self) -> int:
            ledger.pending.pop(second.seq, None)  # the completion thread, meanwhile
            return 0

        def settle_finished(self) -> None:
            pass

    first._completion = second._completion = Queue()  # type: ignore[assignment]
    assert ledger.abort(ac.CommAborted("stop"))
    assert isinstance(first.exception(), ac.CommAborted) and len(aborted) == 1
