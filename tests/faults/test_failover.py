"""Failover on real processes: deaths of one and two ranks (exit, SIGKILL, SIGTERM) on
3 and 4 ranks, a death inside a coalesced batch, a death during shrink itself, a
briefly paused peer next to a dead one, and the process-wide liveness service's threads.

Every test has a hard deadline (run_ranks' timeout and the suite's per-test
timeout); lost ranks are killed by the kit. No timing assertions: how fast is
measured in bench/faults.py.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time

import pytest
import torch

import asynccoll as ac
from asynccoll._faults.service import Service
from asynccoll.testing import RankContext, crash, crash_later, freeze, run_ranks


async def _churn(comm: ac.Communicator, seconds: float = 30.0) -> None:
    """Small all-reduces until a failure surfaces or ``seconds`` pass."""
    t = torch.ones(1024)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await comm.all_reduce(t)


async def deaths_then_shrink(comm: ac.Communicator, victims: list[int], how: str) -> dict:
    """``victims`` die together mid-collective; survivors name them, shrink, all-reduce."""
    await comm.barrier()
    if comm.rank in victims:
        crash_later(0.2, how=how)
        await _churn(comm)
        return {}
    with pytest.raises(ac.PeerFailure) as info:
        await _churn(comm)
    named = list(info.value.ranks)
    new = await comm.shrink()
    t = torch.full((4,), float(comm.rank + 1))
    await new.all_reduce(t)
    res = {
        "named": named,
        "failed": list(comm.failed_ranks),
        "new": [new.rank, new.world_size],
        "sum": float(t[0]),
    }
    await new.close()
    return res


@pytest.mark.parametrize(
    "world, victims, how",
    [
        (3, [2], "exit"),
        (3, [1], "sigkill"),
        (3, [2], "sigterm"),
        (4, [1], "sigterm"),
        (4, [2, 3], "exit"),
        (4, [1, 3], "sigkill"),
        (3, [1, 2], "sigterm"),
    ],
)
def test_deaths_are_named_exactly_and_survivors_recover(
    world: int, victims: list[int], how: str
) -> None:
    results = run_ranks(
        deaths_then_shrink,
        world_size=world,
        backend="gloo",
        timeout=90,
        args=(victims, how),
        lost=victims,
    )
    survivors = [r for r in range(world) if r not in victims]
    expected_sum = float(sum(r + 1 for r in survivors))
    for new_rank, r in enumerate(survivors):
        res = results[r]
        # Exact: never a live rank, never empty. Two deaths a few ms apart may be
        # named one at a time (the later one was still alive at the census).
        assert res["named"] and set(res["named"]) <= set(victims), res
        if len(victims) == 1:
            assert res["named"] == victims and res["failed"] == victims, res
        assert res["new"] == [new_rank, len(survivors)], res
        assert res["sum"] == expected_sum, res


async def death_in_coalesced_batch(comm: ac.Communicator) -> dict:
    await comm.barrier()
    if comm.rank == 2:
        crash_later(0.2, how="sigkill")
    tensors = [torch.ones(256) for _ in range(6)]
    end = time.monotonic() + 30
    group = None
    try:
        while time.monotonic() < end:
            async with comm.coalescing() as group:
                for t in tensors:
                    comm.all_reduce(t)
    except ac.PeerFailure as exc:
        named = list(exc.ranks)
    assert group is not None
    members = await asyncio.gather(*group.works, return_exceptions=True)
    assert all(isinstance(m, ac.CommAborted) for m in members), members
    new = await comm.shrink()
    t = torch.ones(3)
    await new.all_reduce(t)
    await new.close()
    return {"named": named, "sum": float(t[0]), "size": new.world_size}


def test_death_during_a_coalesced_batch() -> None:
    results = run_ranks(
        death_in_coalesced_batch, world_size=3, backend="gloo", timeout=90, lost=(2,)
    )
    assert results[0] == results[1] == {"named": [2], "sum": 2.0, "size": 2}


async def death_during_shrink(comm: ac.Communicator) -> dict:
    """Rank 3 dies; rank 2 dies too, after the census named rank 3 and the others
    started to build the 3-rank communicator that would wait for it."""
    await comm.barrier()
    if comm.rank == 3:
        crash_later(0.2, how="exit")
    with pytest.raises(ac.PeerFailure) as info:
        await _churn(comm)
    if comm.rank == 2:
        crash("sigkill")
    new = await comm.shrink()
    t = torch.full((2,), float(comm.rank + 1))
    await new.all_reduce(t)
    res = {"named": list(info.value.ranks), "new": [new.rank, new.world_size], "sum": float(t[0])}
    await new.close()
    return res


def test_death_during_shrink_itself() -> None:
    results = run_ranks(death_during_shrink, world_size=4, backend="gloo", timeout=90, lost=(2, 3))
    assert results[0] == {"named": [3], "new": [0, 2], "sum": 3.0}
    assert results[1] == {"named": [3], "new": [1, 2], "sum": 3.0}


async def paused_next_to_dead(comm: ac.Communicator) -> list:
    """Rank 1 dies while rank 2 is stopped (SIGSTOP); rank 2 resumes within the
    census bound: the census names rank 1 only. (A peer frozen for longer than the
    bound counts as failed, as heartbeat detection has it.)"""
    pids = await comm.all_gather_object(os.getpid())
    if comm.rank == 1:
        crash_later(0.2, how="exit")
        await asyncio.sleep(30)
    if comm.rank == 2:
        freeze()  # until rank 0 resumes it
        for _ in range(200):  # rank 0's abort reaches this rank as news
            if comm.state == "aborted":
                break
            await asyncio.sleep(0.05)
        return [comm.state]
    await asyncio.sleep(0.6)  # rank 1 is dead, rank 2 stopped
    assert comm._liveness is not None
    loop = asyncio.get_running_loop()
    census = loop.run_in_executor(None, comm._liveness.census)
    await asyncio.sleep(0.3)  # less than the bound (3 x 0.25 s)
    os.kill(pids[2], signal.SIGCONT)
    named = list(await census)
    comm.abort("done")
    return named


def test_census_does_not_name_a_briefly_paused_peer() -> None:
    results = run_ranks(paused_next_to_dead, world_size=3, backend="gloo", timeout=60, lost=(1,))
    assert results[0] == [1]
    assert results[2] == ["aborted"]


def _service_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("asynccoll-liveness"))


async def dropped_comm_stops_beating(ctx: RankContext) -> dict:
    """Two communicators share one beater and one pulse; a communicator dropped
    without close() stops beating once collected, and the threads end with the last."""
    before = _service_threads()
    kw = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "store": ctx.store,
        "timeout": 60,
        "heartbeat": 0.05,
    }
    a = await ac.init("gloo", **kw)
    b = await ac.init("gloo", **kw)
    during = _service_threads()
    await a.all_reduce(torch.ones(2))
    store = a._store
    key = f"hb/{ctx.rank}"
    await asyncio.sleep(0.3)
    moving = [int(store.add(key, 0))]
    await asyncio.sleep(0.3)
    moving.append(int(store.add(key, 0)))
    await b.close()
    await asyncio.sleep(0.1)  # the peer's b is closed too before a disappears
    del a, b
    gc.collect()
    await asyncio.sleep(0.3)  # the service notices within one of its waits
    stopped = [int(store.add(key, 0))]
    await asyncio.sleep(0.5)
    stopped.append(int(store.add(key, 0)))
    return {
        "before": before,
        "during": during,
        "after": _service_threads(),
        "moving": moving[1] > moving[0],
        "stopped": stopped[1] == stopped[0],
        "services": Service.threads(),
    }


def test_dropped_communicator_stops_beating_and_threads_end() -> None:
    for res in run_ranks(dropped_comm_stops_beating, world_size=2, backend=None, timeout=60):
        assert res["before"] == [], res
        assert res["during"] == ["asynccoll-liveness", "asynccoll-liveness-pulse"], res
        assert res["moving"] and res["stopped"], res
        assert res["after"] == [] and res["services"] == 0, res


async def shrink_reuses_the_census(comm: ac.Communicator) -> dict:
    """After a death, every survivor shrinks on the census record: no agreement round."""
    import asynccoll._faults.shrink as shrink_mod

    def no_agreement(*args: object) -> set:
        raise AssertionError(
            "shrink ran an agreement round although the census recorded the failure"
        )

    shrink_mod.agree = no_agreement  # type: ignore[assignment]
    await comm.barrier()
    if comm.rank == 2:
        crash_later(0.2, how="sigkill")
    with pytest.raises(ac.PeerFailure):
        await _churn(comm)
    assert comm._liveness is not None
    record = list(comm._liveness.record() or ())  # (the shrink deletes it with the old keys)
    new = await comm.shrink()
    t = torch.ones(2)
    await new.all_reduce(t)
    await new.close()
    return {"record": record, "sum": float(t[0])}


def test_shrink_after_a_death_runs_no_agreement_round() -> None:
    results = run_ranks(
        shrink_reuses_the_census, world_size=3, backend="gloo", timeout=60, lost=(2,)
    )
    assert results[0] == results[1] == {"record": [2], "sum": 2.0}


async def aborted_comms_leave_no_keys(ctx: RankContext) -> dict:
    """4 ranks: rank 3 dies (the others wait in an object collective), the survivors
    shrink (the old communicator is dropped, never closed); then rank 2 dies and the
    survivors close the aborted communicator without shrinking. Afterwards the run's store holds what it held before (creation counters)."""
    store = ctx.store
    kw: dict = {"world_size": ctx.world_size, "store": store, "timeout": 30}

    async def services_ended() -> None:  # this process's liveness service unlists itself as it ends
        for _ in range(200):
            if Service.threads() == 0:
                return
            await asyncio.sleep(0.025)

    async def barrier(
        name: str, n: int
    ) -> None:  # on the run's store (no key left behind: counted out)
        store.add(name, 1)
        deadline = time.monotonic() + 20
        while int(store.add(name, 0)) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    warm = await ac.init("gloo", rank=ctx.rank, **kw)  # once-per-store keys (creation counters)
    await warm.close()
    await services_ended()
    await barrier("b1", 4)
    before = sorted(k for k in store.list_keys() if k not in ("b1", "b2", "b3"))
    await barrier("b2", 4)  # everyone counted before anyone creates a key
    comm = await ac.init("gloo", rank=ctx.rank, **kw)
    await comm.barrier()
    if ctx.rank == 3:
        crash_later(0.2, how="sigkill")
        await asyncio.sleep(30)
    with pytest.raises(ac.PeerFailure):  # the others' keys of this object collective stay
        await comm.all_gather_object(ctx.rank)
    comm = await comm.shrink()  # the aborted one is dropped, as users do
    await comm.barrier()
    if ctx.rank == 2:
        crash_later(0.2, how="sigkill")
    with pytest.raises(ac.PeerFailure):
        await _churn(comm)
    await comm.close()
    await services_ended()
    await barrier("b3", 2)  # the two survivors
    return {
        "before": before,
        "after": sorted(k for k in store.list_keys() if k not in ("b1", "b2", "b3")),
    }


def test_aborted_and_shrunk_communicators_leave_no_keys() -> None:
    """Every communicator that was aborted by a death (then shrunk, or closed) left all
    its keys in the store forever: 23 per 3-rank communicator, one leak per fault."""
    results = run_ranks(
        aborted_comms_leave_no_keys, world_size=4, backend=None, timeout=90, lost=(2, 3)
    )
    for res in results[:2]:
        assert res["after"] == res["before"], sorted(set(res["after"]) - set(res["before"]))


async def _shrink_while_a_survivor_stays_away(comm: ac.Communicator) -> str:
    """Rank 2 dies; rank 0 shrinks at once (the census recorded rank 2: no agreement round)
    and builds the 2-rank group; rank 1 is alive but never shrinks, so the build times out."""
    if comm.rank == 2:
        os._exit(0)
    try:
        await comm.all_reduce(torch.ones(1))
    except ac.CommAborted:
        pass
    if comm.rank == 1:
        await asyncio.sleep(8)
        return "away"
    try:
        await comm.shrink()
    except ac.AsyncCollError as exc:
        return f"typed {type(exc).__name__}"
    except BaseException as exc:  # noqa: BLE001 - what leaks is the finding
        return f"untyped {type(exc).__name__}: {exc!r}"
    return "shrank"


@pytest.mark.timeout(90)
def test_a_shrink_whose_build_times_out_raises_collective_timeout() -> None:
    """Typed, not wrapped in the ExceptionGroup of the task group that races the build
    against the watch for dead survivors (found by the chaos soak)."""
    results = run_ranks(
        _shrink_while_a_survivor_stays_away, world_size=3, timeout=60, init_timeout=5, lost=(2,)
    )
    assert results[0] == "typed CollectiveTimeout", results
