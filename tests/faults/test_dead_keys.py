"""Store keys of ranks that die and never close: the survivors' shrink retires them.

A killed rank never runs ``close()``; whatever it wrote on the store (its liveness
service's listing, its records under each communicator's namespace) must be
deleted by the survivors, or a long-running job's store grows with every fault.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import asynccoll as ac
from asynccoll._faults.service import Service, root_of
from asynccoll.testing import RankContext, crash, crash_later, run_ranks

pytestmark = pytest.mark.timeout(150)


async def _services_ended() -> None:
    """This process's liveness services unlist themselves as they end."""
    for _ in range(200):
        if Service.threads() == 0:
            return
        await asyncio.sleep(0.025)


async def _barrier(store: Any, name: str, n: int) -> None:
    store.add(name, 1)
    deadline = time.monotonic() + 30
    while int(store.add(name, 0)) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def _warmed_up(ctx: RankContext) -> dict[str, Any]:
    """Every once-per-store key exists and no liveness service runs, on every rank: what
    the store holds now is the baseline to count against. ``ac.init``'s keywords."""
    store = ctx.store
    kw: dict[str, Any] = {"world_size": ctx.world_size, "store": store, "timeout": 30}
    warm = await ac.init("gloo", rank=ctx.rank, **kw)  # once-per-store keys exist from here on
    await warm.close()
    await _services_ended()
    for name in ("b/start", "b/end"):  # the barriers' own keys exist before the count
        store.add(name, 0)
    await _barrier(store, "b/warm", ctx.world_size)
    return kw


async def _counted_then_init(ctx: RankContext) -> tuple[list[str], ac.Communicator]:
    """After the warm-up, the store's keys as every rank starts (the baseline), then a
    Gloo communicator of every rank."""
    kw = await _warmed_up(ctx)
    before = sorted(root_of(ctx.store).list_keys())
    await _barrier(ctx.store, "b/start", ctx.world_size)
    return before, await ac.init("gloo", rank=ctx.rank, **kw)


async def kill_shrink_generations(ctx: RankContext) -> dict[str, Any]:
    """5 ranks; in each of three generations the highest rank is SIGKILLed and the
    survivors shrink. Rank 0 counts the whole store's keys at each generation start."""
    store = ctx.store
    root = root_of(store)
    kw = await _warmed_up(ctx)
    before = root.num_keys()
    before_keys = sorted(root.list_keys())
    await _barrier(store, "b/start", ctx.world_size)  # everyone counted before any key is made
    comm = await ac.init("gloo", rank=ctx.rank, heartbeat=0.2, **kw)
    counts = []
    while True:
        await comm.all_reduce(torch.ones(4))
        counts.append(root.num_keys())
        if comm.world_size == 2:
            break
        if comm.rank == comm.world_size - 1:
            crash_later(0.2, how="sigkill")
            await asyncio.sleep(30)
        with pytest.raises(ac.PeerFailure):
            while True:
                await comm.all_reduce(torch.ones(1024))
        comm = await comm.shrink()  # the aborted one is dropped, as users do
    await comm.close()
    await _services_ended()
    await _barrier(store, "b/end", 2)
    return {
        "before": before,
        "counts": counts,
        "after": root.num_keys(),
        "left": sorted(set(root.list_keys()) - set(before_keys)),
    }


def test_killed_ranks_leave_no_keys_across_shrink_generations() -> None:
    """Each killed process left its liveness service's listing (``asynccoll/services/<n>``)
    on the store for good: 3 keys more after three kill-shrink generations (8 -> 12)."""
    results = run_ranks(
        kill_shrink_generations, world_size=5, backend=None, timeout=120, lost=(2, 3, 4)
    )
    for res in results[:2]:
        assert res["left"] == [] and res["after"] == res["before"], res
    counts = results[0]["counts"]  # keys at each generation start (5, 4, 3 and 2 ranks)
    assert counts == sorted(counts, reverse=True), counts


async def death_during_a_shrink(ctx: RankContext) -> dict[str, Any]:
    """4 ranks: rank 3 is SIGKILLed; rank 2 is SIGKILLed as the others begin their shrink,
    whose first build (with rank 2) they give up and build again without it."""
    store = ctx.store
    root = root_of(store)
    before, comm = await _counted_then_init(ctx)
    await comm.all_reduce(torch.ones(4))
    if comm.rank == 3:
        crash_later(0.2, how="sigkill")
        await asyncio.sleep(30)
    with pytest.raises(ac.PeerFailure):
        while True:
            await comm.all_reduce(torch.ones(1024))
    if comm.rank == 2:
        crash("sigkill")
    new = await comm.shrink()
    await new.all_reduce(torch.ones(4))
    size = new.world_size
    await new.close()
    await _services_ended()
    await _barrier(store, "b/end", 2)
    return {"size": size, "left": sorted(set(root.list_keys()) - set(before))}


def test_a_shrink_build_given_up_for_a_dead_survivor_leaves_no_keys() -> None:
    """The creation the survivors gave up (each one's options, the give-up mark, Gloo's
    addresses) stayed for good under the old communicator's namespace."""
    results = run_ranks(death_during_a_shrink, world_size=4, backend=None, timeout=120, lost=(2, 3))
    for res in results[:2]:
        assert res["size"] == 2 and res["left"] == [], "\n".join(res["left"])


async def keys_around_a_grow_death(ctx: RankContext, member_dies: bool) -> dict[str, Any]:
    """The keys a grow that a participant died in leaves on the store, once the others are
    done (the group shrank, or grew again, and closed)."""
    from tests.support import elastic_ranks as er

    store = ctx.store
    root = root_of(store)
    for name in ("b/start", "b/end"):
        store.add(name, 0)
    await _barrier(store, "b/warm", ctx.world_size)
    before = sorted(root.list_keys())
    await _barrier(store, "b/start", ctx.world_size)
    if member_dies:
        res = await er.member_dies_in_grow(ctx)
    else:
        res = await er.joiner_dies_in_grow(ctx)
    await _services_ended()
    await _barrier(store, "b/end", ctx.world_size - 1)
    return {"res": res, "left": sorted(set(root.list_keys()) - set(before))}


#: What a grow that a participant died in may leave, once the others are done: the
#: store's own keys (the services counter, the server's identity), the generation of each
#: group (world size and name) created on it (one key per group for good, as after any
#: ``ac.init``), the group's waiting room (its counters, and the tickets' ``admit`` marks
#: within the window its scan keeps) and the scenario's own barrier keys.
_MAY_STAY = re.compile(
    r"(^asynccoll/(services|store)$|(^|/)asynccoll/gen/w\d+-g$"
    r"|/asynccoll/group/g/(admit/\d+|expired|generations|resolved|tickets)$|/before-shrink/\d$)"
)


@pytest.mark.parametrize("member_dies", [False, True], ids=["joiner", "member"])
def test_a_grow_that_a_participant_died_in_leaves_no_keys_of_it(member_dies: bool) -> None:
    """The grow's plan, outcome, marks and watch, the old communicator's keys (after the
    survivors' shrink) and the dead process's service listing: all stayed for good
    (11 keys stayed for good when the joiner died, 40 when a member did); and the keys of
    the grown communicator whose creation the death broke (each live rank's options, the
    count of those that left it, the mark that it was given up)."""
    results = run_ranks(
        keys_around_a_grow_death,
        world_size=4 if member_dies else 3,
        backend=None,
        timeout=120,
        lost=(2,),
        args=(member_dies,),
    )
    for res in results:
        if res is not None:
            assert [k for k in res["left"] if not _MAY_STAY.search(k)] == [], res["left"]


def _pairs(world_size: int) -> list[list[int]]:
    """Consecutive pairs, the last rank alone if odd (as the chaos soak splits)."""
    return [list(range(i, min(i + 2, world_size))) for i in range(0, world_size, 2)]


async def kill_pair_members(ctx: RankContext) -> dict[str, Any]:
    """4 ranks split into pairs; twice a member of a pair is SIGKILLed while its partner
    runs world ops. The survivors recover as the chaos soak does: the partner aborts its
    pair, the world shrinks, the old pairs close and the new world splits again."""
    store = ctx.store
    root = root_of(store)
    before, comm = await _counted_then_init(ctx)
    counts = []
    while True:
        pair = await comm.split(_pairs(comm.world_size))
        assert pair is not None
        await pair.all_reduce(torch.ones(4))
        await comm.all_reduce(torch.ones(4))
        counts.append(root.num_keys())
        if comm.world_size == 2:
            break
        victim = 3 if comm.world_size == 4 else 1  # rank 2's partner, then rank 0's
        if comm.rank == victim:
            crash_later(0.2, how="sigkill")
            await asyncio.sleep(30)
        with pytest.raises(ac.PeerFailure):
            while True:
                await comm.all_reduce(torch.ones(1024))
        pair.abort("the world failed")  # its partner may be the dead rank: it never hears
        new = await comm.shrink()
        await comm.close()
        comm = new
        await pair.close()
    await pair.close()
    await comm.close()
    await _services_ended()
    await _barrier(store, "b/end", 2)
    return {"counts": counts, "left": sorted(set(root.list_keys()) - set(before))}


def test_killed_pair_members_leave_no_keys_of_their_subgroups() -> None:
    """The survivor of a pair whose partner was killed closes the pair (aborted, the
    partner never heard of), and nobody deleted the pair's keys: 9 keys per such pair
    stayed for good (its ``proc``, ``bye``, ``gloo`` addresses, ``created``, ...)."""
    results = run_ranks(kill_pair_members, world_size=4, backend=None, timeout=120, lost=(1, 3))
    for res in (results[0], results[2]):
        assert res["left"] == [], "\n".join(res["left"])


async def death_after_stating_split_lists(ctx: RankContext) -> dict[str, Any]:
    """3 ranks split into [[0, 1], [2]]; rank 2 dies right after writing its lists in the
    split's agreement (written here as ``split.agree`` does), so it never counts itself
    out of the agreement. The survivors split, find the death, shrink and close."""
    store = ctx.store
    root = root_of(store)
    before, comm = await _counted_then_init(ctx)
    lists = [[0, 1], [2]]
    if comm.rank == 2:
        status = {"groups": lists, "problem": None, "state": "ok"}
        dist.PrefixStore(comm._splitter.prefix, store).set("split/0/2", json.dumps(status))
        os.kill(os.getpid(), signal.SIGKILL)
    pair = await comm.split(lists)
    assert pair is not None
    await pair.all_reduce(torch.ones(4))
    with pytest.raises(ac.PeerFailure):
        await comm.all_reduce(torch.ones(4))
    new = await comm.shrink()
    await comm.close()
    await pair.close()
    await new.close()
    await _services_ended()
    await _barrier(store, "b/end", 2)
    return {"left": sorted(set(root.list_keys()) - set(before))}


def test_a_death_in_a_split_agreement_leaves_no_agreement_keys() -> None:
    """The survivors count themselves out of the agreement, the dead rank never does:
    its lists, the survivors' and the count stayed for good (``split/0/<r>``,
    ``split/0/read``). The split's communicator deletes them with its own keys."""
    results = run_ranks(
        death_after_stating_split_lists, world_size=3, backend=None, timeout=120, lost=(2,)
    )
    for res in results[:2]:
        assert res["left"] == [], "\n".join(res["left"])


async def joiners_come_and_go(ctx: RankContext) -> dict[str, Any]:
    """2 members look at the room while rank 2 joins 12 times refused (another backend)
    and 6 times timed out, then joins for good and the group grows to 3."""
    store = ctx.store
    if ctx.rank == 2:
        for _ in range(12):
            with pytest.raises(ac.InvalidArgument):
                await ac.join("auto", store=store, name="g", timeout=30)
        for _ in range(6):
            with pytest.raises(ac.CollectiveTimeout):
                await ac.join("gloo", store=store, name="g", timeout=0.1)
        store.set("joiner/ready", "1")
        comm = await ac.join("gloo", store=store, name="g", timeout=30)
    else:
        comm = await ac.init("gloo", rank=ctx.rank, world_size=2, store=store, name="g")
        while True:
            n = await comm.waiting()
            ready = torch.tensor([int(store.check(["joiner/ready"]))])
            await comm.all_reduce(ready, ac.ReduceOp.MIN)  # every member decides alike
            if n and ready.item():
                break
            await asyncio.sleep(0.01)
        comm = await comm.grow(3)
    await comm.all_reduce(torch.ones(1))
    await comm.close()
    await _barrier(store, "b/end", 3)
    keys = store.list_keys()  # (this run's: other tests share the worker's store)
    return {
        kind: sorted(k for k in keys if f"/group/g/{kind}/" in k) for kind in ("admit", "ticket")
    }


def test_joiners_that_come_and_go_leave_a_bounded_number_of_room_keys() -> None:
    """Each ticket's ``admit`` mark stayed for good, and so did the record of each ticket
    not admitted: 19 marks and 18 records after 19 joins."""
    results = run_ranks(joiners_come_and_go, world_size=3, backend=None, timeout=120)
    for res in results:
        assert len(res["admit"]) <= 10 and len(res["ticket"]) <= 10, res


async def excluded_by_name(ctx: RankContext) -> dict[str, Any]:
    """3 ranks; rank 2 is SIGKILLed while nothing is pending, and the others shrink it
    out by name (``shrink([2])``, as a caller that learned of the death elsewhere does: a
    subgroup's failure) before their world communicator noticed anything."""
    store = ctx.store
    root = root_of(store)
    before, comm = await _counted_then_init(ctx)
    await comm.all_reduce(torch.ones(4))
    await _barrier(store, "b/reduced", 3)
    if comm.rank == 2:
        crash("sigkill")
    await asyncio.sleep(0.5)  # its process is gone
    assert comm.failed_ranks == ()  # nothing told this communicator
    new = await comm.shrink([2])
    await new.all_reduce(torch.ones(4))
    await comm.close()
    await new.close()
    await _services_ended()
    await _barrier(store, "b/end", 2)
    left = set(root.list_keys()) - set(before)
    return {"left": sorted(k for k in left if not k.endswith("b/reduced"))}  # (the test's own)


def test_a_rank_excluded_by_name_after_its_death_leaves_no_keys() -> None:
    """Only the excluded ranks the communicator knew had failed were probed for
    ``forget``: a dead rank excluded by name never counted itself out, and the whole
    communicator's keys stayed for good (one such communicator in the 10-minute chaos
    soak J: 28 keys)."""
    results = run_ranks(excluded_by_name, world_size=3, backend=None, timeout=120, lost=(2,))
    for res in results[:2]:
        assert res["left"] == [], "\n".join(res["left"])
