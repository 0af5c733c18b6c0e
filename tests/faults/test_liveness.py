"""Liveness: abort news never lost, a live rank never declared dead, O(1) store
requests per rank per beat.

The in-process tests run several members of one communicator in this process, on a
real store; the run_ranks tests use real processes. No timing assertions beyond
generous deadlines that catch a hang or a missed message.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import asynccoll as ac
from asynccoll._faults import news, procs
from asynccoll._faults.liveness import Liveness
from asynccoll.testing import RankContext, run_ranks
from tests.support.spies import Sets


class CountingStore(dist.Store):  # type: ignore[misc]
    """A real store (``inner``) that counts the requests made to it."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.requests = 0
        self._lock = threading.Lock()

    def _count(self) -> None:
        with self._lock:
            self.requests += 1

    def set(self, key: str, value: Any) -> None:
        self._count()
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._count()
        return bytes(self.inner.get(key))

    def add(self, key: str, value: int) -> int:
        self._count()
        return int(self.inner.add(key, value))

    def check(self, keys: list[str]) -> bool:
        self._count()
        return bool(self.inner.check(keys))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._count()
        return bytes(self.inner.compare_set(key, expected, desired))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._count()
        return list(self.inner.multi_get(keys))

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._count()
        self.inner.multi_set(keys, values)

    def delete_key(self, key: str) -> bool:
        self._count()
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())


def _server() -> Any:
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )


def test_abort_news_is_not_lost_when_close_races_the_abort() -> None:
    """A waiter woken by a timeout may close the communicator before the abort hook
    tells the peers (the ledger wakes waiters first): the goodbye is then written,
    and the abort news must still reach the other ranks."""
    server = _server()
    heard = threading.Event()
    members = [
        Liveness(
            dist.PrefixStore("c", server),
            r,
            2,
            interval=0.05,
            detect=False,
        )
        for r in range(2)
    ]
    for m in members:
        m.publish()
    members[0].start(lambda e: None)
    members[1].start(lambda e: heard.set())
    try:
        members[0].stop()  # close() ran first...
        end = time.monotonic() + 10
        while not server.check(["c/bye/0"]):
            assert time.monotonic() < end, "rank 0 never said goodbye"
            time.sleep(0.01)
        members[0].publish_abort(
            ac.CommAborted("all_reduce (seq 3) timed out")
        )  # ...then the abort hook
        assert heard.wait(10), "rank 1 never heard rank 0's abort"
    finally:
        for m in members:
            m.stop()


@pytest.mark.parametrize("woken", [True, False])
def test_abort_news_recorded_without_a_wake_goes_out_on_wake_or_at_the_next_beat(
    woken: bool,
) -> None:
    """``abort()`` on an event loop records the news and wakes the service only after the
    loop's waiters ran (``Resources.aborted``): recording wakes nobody; ``wake()`` sends it
    at once, and if it never comes the member's next beat sends it."""
    server = _server()
    heard = threading.Event()
    interval = (
        3600.0 if woken else 0.2
    )  # woken: no beat comes in the test's time, only wake() sends it
    members = [
        Liveness(
            dist.PrefixStore("c", server),
            r,
            2,
            interval=interval,
            detect=False,
        )
        for r in range(2)
    ]
    for m in members:
        m.publish()
    members[0].start(lambda e: None)
    members[1].start(lambda e: heard.set())
    try:
        svc = members[0]._service
        assert svc is not None and svc is members[1]._service  # one service per process and store
        sets = Sets(svc._wake)
        members[0].publish_abort(ac.CommAborted("aborted by the user"), wake=False)
        assert sets.n == 0, "recording the news woke the service"
        if woken:
            members[0].wake()
            assert sets.n == 1
        assert heard.wait(10), "rank 1 never heard rank 0's abort"
    finally:
        for m in members:
            m.stop()


class RecordingStore(CountingStore):
    """A :class:`CountingStore` that also records each request's method and key."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.calls: list[tuple[str, str]] = []

    def _record(self, method: str, key: str) -> None:
        with self._lock:
            self.calls.append((method, key))

    def set(self, key: str, value: Any) -> None:
        self._record("set", key)
        super().set(key, value)

    def append(self, key: str, value: Any) -> None:
        self._record("append", key)
        self._count()
        self.inner.append(key, value)

    def add(self, key: str, value: int) -> int:
        self._record("add", key)
        return super().add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._record("compare_set", key)
        return super().compare_set(key, expected, desired)

    def get(self, key: str) -> bytes:
        self._record("get", key)
        return super().get(key)


def test_a_census_only_member_starts_with_one_store_request_that_waits_for_an_answer() -> None:
    """Publishing a member is part of every communicator's creation (a subgroup's too):
    its keys are made by requests that need no answer (``set``, ``append``) and one
    that does, the namespace token, last, so every key exists once ``publish`` returns;
    ``start`` makes no request."""
    store = RecordingStore(dist.HashStore())
    member = Liveness(dist.PrefixStore("c", store), 0, 2, interval=60.0, detect=False)
    member.publish()
    member.start(lambda e: None)
    try:
        calls = [(m, k) for m, k in store.calls if k.startswith("c/")]
    finally:
        member.stop()
    answered = [(m, k) for m, k in calls if m not in ("set", "append")]
    assert answered == [("compare_set", "c/ns")], calls
    assert calls[-1] == ("compare_set", "c/ns"), calls
    assert store.inner.check(["c/aborted", "c/host", "c/ns", "c/proc/0"])
    assert bytes(store.inner.get("c/aborted")) == b""  # no news


def test_a_member_given_its_namespace_publishes_without_waiting_for_an_answer() -> None:
    """A subgroup's ranks derive their token from their parent's (``Subgroups``): its
    member's keys are made by requests that need no answer, and the creation's end
    barrier, next on the connection, is the one that waits."""
    store = RecordingStore(dist.HashStore())
    member = Liveness(dist.PrefixStore("c", store), 0, 2, interval=60.0, detect=False)
    member.publish("parent-token/split-0/1/")
    member.start(lambda e: None)
    try:
        calls = [(m, k) for m, k in store.calls if k.startswith("c/")]
    finally:
        member.stop()
    assert [(m, k) for m, k in calls if m not in ("set", "append")] == [], calls
    assert member.namespace == "parent-token/split-0/1/"
    assert store.inner.check(["c/aborted", "c/host", "c/proc/0"])


@pytest.mark.parametrize("world_size", [8, 32])
def test_a_beat_costs_a_few_store_requests_whatever_the_world_size(world_size: int) -> None:
    """Heartbeat detection watches a few neighbours: the store requests per rank and
    per beat do not grow with the number of ranks (O(n) in total, not O(n^2))."""
    store = CountingStore(dist.HashStore())
    prefix = dist.PrefixStore("c", store)
    members = [
        Liveness(prefix, r, world_size, interval=0.05, detect=True) for r in range(world_size)
    ]
    for m in members:
        m.publish()
        m.start(lambda e: None)
    try:
        time.sleep(0.5)  # past the start-up requests
        beats0 = sum(int(prefix.add(f"hb/{r}", 0)) for r in range(world_size))
        before = store.requests
        time.sleep(1.0)
        after = store.requests
        beats1 = sum(int(prefix.add(f"hb/{r}", 0)) for r in range(world_size))
    finally:
        for m in members:
            m.stop()
    beats = beats1 - beats0
    assert beats >= world_size * 5, beats  # the members did beat
    per_beat = (after - before - world_size) / beats  # (the world_size reads of this test)
    assert per_beat <= 3.0, per_beat


# ------------------------------------------------------------------ a rank that holds the GIL
def _hold_gil(seconds: float) -> float:
    """Hold the GIL for about ``seconds``: one C call (``sum`` over a ``range``) that never
    lets another thread of this process run Python."""
    per_item = 1.0
    for _ in range(3):  # the fastest of three, in this thread's CPU time: wall time taken while
        t0 = time.thread_time()  # the machine is loaded (descheduled) would make the hold shorter
        sum(range(2_000_000))
        per_item = min(per_item, max((time.thread_time() - t0) / 2_000_000, 1e-10))
    t0 = time.perf_counter()
    sum(range(int(seconds / per_item)))
    return time.perf_counter() - t0


async def gil_holder_beside_a_closer(ctx: RankContext) -> dict[str, Any]:
    """Rank 0 closes and drops its communicator while rank 1 holds the GIL for longer
    than the detection bound: rank 1 must not take rank 0 for dead."""
    comm = await ac.init(
        "gloo", rank=ctx.rank, world_size=ctx.world_size, store=ctx.store, timeout=60, heartbeat=0.2
    )
    await comm.barrier()
    if ctx.rank == 0:
        await comm.close()
        del comm
        gc.collect()
        await asyncio.sleep(4)
        return {"state": "closed"}
    held = _hold_gil(1.5)
    await asyncio.sleep(2.5)  # detection has several beats to (wrongly) decide
    state, error = comm.state, repr(comm.error)
    await comm.close()
    return {"state": state, "error": error, "held": held}


def test_a_rank_holding_the_gil_does_not_declare_a_closed_peer_dead() -> None:
    results = run_ranks(gil_holder_beside_a_closer, world_size=2, backend=None, timeout=60)
    assert results[1]["held"] > 0.6, results  # longer than the bound (3 x 0.2 s)
    assert results[1]["state"] == "ok", results


async def gil_holder(ctx: RankContext) -> dict[str, Any]:
    """Rank 1 holds the GIL three times for about a second, with moments between:
    neither it nor its peer is declared dead."""
    comm = await ac.init(
        "gloo", rank=ctx.rank, world_size=ctx.world_size, store=ctx.store, timeout=60, heartbeat=0.2
    )
    await comm.barrier()
    held = []
    if ctx.rank == 1:
        for _ in range(3):
            held.append(_hold_gil(1.2))
            await asyncio.sleep(0.005)
    else:
        await asyncio.sleep(3.5)
    await asyncio.sleep(1.5)
    state, error = comm.state, repr(comm.error)
    if state == "ok":
        t = torch.ones(2)
        await comm.all_reduce(t)
    await comm.close()
    return {"state": state, "error": error, "held": held}


def test_a_live_rank_holding_the_gil_is_not_declared_dead() -> None:
    results = run_ranks(gil_holder, world_size=2, backend=None, timeout=60)
    assert all(h > 0.6 for h in results[1]["held"]), results
    assert [r["state"] for r in results] == ["ok", "ok"], results


# ------------------------------------------------------------------ the census never waits on a key
def test_a_census_of_a_peer_that_neither_left_nor_aborted_does_not_wait_for_the_store() -> None:
    """``Roster.left`` reads the abort news only where there is some: a store ``get`` of a
    missing key blocks for the store's whole timeout (it held the process's store client
    for it: every later creation on that store waited ~60 s behind it)."""
    from asynccoll._faults.census import Roster

    server = _server()
    server.set_timeout(timedelta(seconds=5))
    store = dist.PrefixStore("c/", server)
    roster = Roster(store, 0, 2, lambda: True)
    t0 = time.monotonic()
    assert roster.left(1) is False
    assert time.monotonic() - t0 < 2.5
    store.set("aborted", "1|boom")
    assert roster.left(1) is True and roster.left(0) is False
    store.set("bye/0", "1")
    assert roster.left(0) is True


@pytest.mark.parametrize("detect", [False, True], ids=["census-only", "heartbeats"])
def test_a_member_whose_keys_were_deleted_under_it_aborts_without_waiting(detect: bool) -> None:
    """A rank counted out as dead while it was stopped (a grow's joiner frozen in it): the
    others delete the keys, and its next beat waited in multi_get for the store's timeout
    (60 s in the chaos soak), holding its process's store connection; now it aborts."""
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=8)
    )
    store = dist.PrefixStore("c", server)
    failures: list[BaseException] = []
    member = Liveness(store, 0, 2, interval=0.05, detect=detect)
    member.publish()
    member.start(failures.append)
    try:
        member.stop()  # (no beat of the service's own meanwhile; the test beats by hand)
        for key in ("aborted", "host", "hb/0", "hb/1"):
            store.delete_key(key)
        member._closed = False
        start = time.monotonic()
        assert member.tick(False)
        took = time.monotonic() - start
    finally:
        member._closed = True
    assert took < 4, f"the beat waited {took:.1f} s for deleted keys"
    assert len(failures) == 1 and isinstance(failures[0], ac.CommAborted), failures
    assert not server.check(["c/hb/0"])  # no key made again


def test_news_that_comes_between_publish_and_start_is_delivered_at_start() -> None:
    """The creation publishes a member on its thread (its pulse address is then known to
    the peers) and the communicator starts it later, on the loop: a peer's abort news
    that comes in between is kept and delivered at start, not lost."""
    member = Liveness(dist.PrefixStore("c", dist.HashStore()), 0, 2, interval=60.0, detect=False)
    member.publish()
    heard: list[BaseException] = []
    try:
        member.deliver(news.encode(1, ac.PeerFailure("rank 2 died", [2])))
        member.start(heard.append)
        assert [type(e) for e in heard] == [ac.PeerFailure], heard
        assert member.dead == (2,)
    finally:
        member.stop()


# ------------------------------------------------------------------ a gone process, and who says it failed
def _gone_peer(rank: int) -> str:
    """A ``proc/<rank>`` record of a process gone from this machine (this pid, another start)."""
    return procs.Peer(rank, procs.MACHINE, os.getpid(), "0", "", 0).encode()


def _live_peer(rank: int) -> str:
    machine, pid, started = procs.this_process()
    return procs.Peer(rank, machine, pid, started, "", 0).encode()


@pytest.mark.skipif(not procs.MACHINE, reason="no process table to read")
@pytest.mark.parametrize("why", ["silent", "said bye", "after abort news"])
def test_a_gone_peer_fails_a_pending_op_only_when_it_did_not_leave(why: str) -> None:
    """Without heartbeats, while an op is pending, a beat names a local peer whose process
    is gone (Gloo does not wake a send already writing to it). Not one that said goodbye,
    and not once abort news is written: that news is the verdict (a peer may have exited
    because of it), and the communicator fails with it, naming nobody else."""
    server = _server()
    store = dist.PrefixStore("c", server)
    store.set("proc/1", _gone_peer(1))
    store.set("proc/2", _live_peer(2))
    if why == "said bye":
        store.set("bye/1", "1")
    elif why == "after abort news":
        store.set("aborted", news.encode(2, ac.CommAborted("rank 2's all_reduce timed out")))
    failures: list[BaseException] = []
    member = Liveness(store, 0, 3, interval=0.05, detect=False)
    member.publish()
    beats: list[float] = []  # the beats that found an op pending
    member.busy = lambda: beats.append(time.monotonic()) is None
    member.start(failures.append)
    try:
        end = time.monotonic() + 10
        while not failures and len(beats) < 20 and time.monotonic() < end:
            time.sleep(0.02)
        time.sleep(0.3)  # a few more beats
    finally:
        member.stop()
    if why == "silent":
        assert [type(f) for f in failures] == [ac.PeerFailure], failures
        assert failures[0].ranks == (1,) and member.dead == (1,), failures
        assert bytes(store.get("failure")) == b"1"  # the census record: every survivor agrees
    elif why == "said bye":
        assert len(beats) >= 20 and failures == [] and member.dead == (), (beats, failures)
    else:
        assert len(failures) == 1 and not isinstance(failures[0], ac.PeerFailure), failures
        assert "rank 2's all_reduce timed out" in str(failures[0]) and member.dead == ()


@pytest.mark.skipif(not procs.MACHINE, reason="no process table to read")
def test_a_census_on_a_lost_store_names_no_peer_whose_process_is_gone() -> None:
    """Once the store is lost, its host's death is the verdict: a survivor that learned it
    aborts and may exit at once, with no store left to say goodbye on, so a process gone
    by now is no proof of a failure. (Killing the store's host beside two CPU hogs, a
    survivor named a second rank, one that had left, 2 in 16 runs.)"""
    server = _server()
    store = dist.PrefixStore("c", server)
    store.set("proc/1", _gone_peer(1))
    failures: list[BaseException] = []
    member = Liveness(store, 0, 2, interval=0.05, detect=False)
    member.publish()
    member.start(failures.append)
    try:
        assert sorted(member.peers()) == [1]  # read, as a beat with an op pending reads them
        service = member._service
        assert service is not None
        service.lose_store("the rendezvous store failed: gone", died=True)
        assert member.census() == ()
    finally:
        member.stop()
    assert member.dead == (), member.dead
    assert [type(f) for f in failures] == [ac.CommAborted], failures


@pytest.mark.skipif(not procs.MACHINE, reason="no process table to read")
def test_a_gone_peer_check_names_the_census_record_not_its_own_view() -> None:
    """Rank 2 died and the survivors' census recorded it; rank 1 dies a moment later,
    before this rank's op failed. The record is the failure every survivor names: a
    rank that named both shrank apart from the others ("survivors disagree on the
    excluded ranks"), whose shrink gives up its build with rank 1 and builds again."""
    server = _server()
    store = dist.PrefixStore("c", server)
    store.set("proc/1", _gone_peer(1))
    store.set("proc/2", _gone_peer(2))
    store.set("failure", "2")
    failures: list[BaseException] = []
    member = Liveness(store, 0, 3, interval=0.05, detect=False)
    member.publish()
    member.busy = lambda: True
    member.start(failures.append)
    try:
        end = time.monotonic() + 10
        while not failures and time.monotonic() < end:
            time.sleep(0.02)
    finally:
        member.stop()
    assert [type(f) for f in failures] == [ac.PeerFailure], failures
    assert failures[0].ranks == (2,) and member.dead == (2,), (failures, member.dead)
