"""``comm.split(groups)``: subgroups as communicators of their own (Gloo, real processes).

What is pinned: ranks renumbered in list order, None for a rank in no list, the
parent's options kept, bad lists an ``InvalidArgument`` on every rank (the parent
stays usable), independence both ways (abort, close, shrink), and a dead peer
reported by every group that contains it, each in its own numbering.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import anyio
import pytest
import torch
import torch.distributed as dist

import asynccoll as ac
from asynccoll.testing import crash, run_ranks

pytestmark = pytest.mark.timeout(150)


async def _sum(comm: Any, value: float, timeout: float | None = None) -> float:
    t = torch.full((2,), value)
    await comm.all_reduce(t, timeout=timeout)
    return float(t[0])


async def renumbered(comm: Any) -> Any:
    sub = await comm.split([[2, 0], [1]])  # list order, not rank order
    if sub is None:
        return None
    out = (
        sub.rank,
        sub.world_size,
        sub.backend,
        sub.timeout == comm.timeout,
        await _sum(sub, comm.rank + 1.0),
    )
    gathered = await sub.all_gather_object(comm.rank)
    none = await comm.split([[0, 1]])  # rank 2 is in no list
    if none is not None:
        await none.close()
    await sub.close()
    return (*out, gathered, none is None, await _sum(comm, 1.0))


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_split_renumbers_in_list_order_and_keeps_the_options(loop: str) -> None:
    r0, r1, r2 = run_ranks(renumbered, world_size=3, timeout=90, loop=loop)
    assert r0 == (1, 2, "gloo", True, 4.0, [2, 0], False, 3.0)
    assert r1 == (0, 1, "gloo", True, 2.0, [1], False, 3.0)
    assert r2 == (0, 2, "gloo", True, 4.0, [2, 0], True, 3.0)


async def checked_subgroup(ctx: Any, trace: str) -> str:
    comm = await ac.init(
        "gloo",
        rank=ctx.rank,
        world_size=2,
        store=ctx.store,
        timeout=23,
        check="fingerprint",
        trace_dir=trace,
    )
    sub = await comm.split([[0, 1]])
    assert sub is not None and sub.timeout == 23
    # Different collectives at one point: the subgroup kept the parent's check.
    t = torch.ones(2 if ctx.rank == 0 else 3)
    try:
        await sub.all_reduce(t, timeout=10)
        seen = "done"
    except ac.CollectiveMismatch:
        seen = "mismatch"
    await sub.close()
    assert await _sum(comm, 1.0) == 2.0
    await comm.close()
    return seen


def test_a_subgroup_keeps_the_fingerprint_check_and_trace_dir(tmp_path: Any) -> None:
    results = run_ranks(
        checked_subgroup, world_size=2, backend=None, timeout=90, args=(str(tmp_path),)
    )
    assert results == ["mismatch", "mismatch"]
    # The subgroup's flight records, written at its mismatch (the parent writes only a
    # timeline at close): ``<comm>.rank<R>.flight.json``, one communicator's.
    flights = [n for n in os.listdir(tmp_path) if n.endswith(".flight.json")]
    assert sorted(n.split(".", 1)[1] for n in flights) == ["rank0.flight.json", "rank1.flight.json"]
    assert len({n.split(".", 1)[0] for n in flights}) == 1


BAD = [
    ("overlap", lambda rank: [[0, 1], [1, 2]]),
    ("outside", lambda rank: [[0, 3]]),
    ("differ", lambda rank: [[0, 1]] if rank == 0 else [[0, 2]]),
    ("empty", lambda rank: [[0], []]),
    ("not ranks", lambda rank: [["0"]]),
    ("one rank's type", lambda rank: [[0, 1]] if rank != 2 else "01"),
]


async def bad_lists(comm: Any) -> list[str]:
    out = []
    for name, lists in BAD:
        try:
            sub = await comm.split(lists(comm.rank), timeout=20)
        except ac.InvalidArgument as exc:
            out.append(f"{name}: invalid ({'rank' in str(exc)})")
        else:
            out.append(f"{name}: made {sub}")
        assert await _sum(comm, 1.0) == 3.0  # the parent stays usable
    return out


def test_bad_lists_are_invalid_argument_on_every_rank() -> None:
    results = run_ranks(bad_lists, world_size=3, timeout=120)
    expected = [f"{name}: invalid (True)" for name, _ in BAD]
    assert results == [expected] * 3, results


async def independence(comm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    a = await comm.split([[0, 1], [2]])
    b = await comm.split([[1, 2], [0]])
    assert a is not None and b is not None
    # A subgroup aborted: the parent and its sibling go on.
    a.abort("the test aborts a")
    out["parent after sub abort"] = await _sum(comm, 1.0)
    out["sibling after sub abort"] = await _sum(b, 1.0)
    rebuilt = await a.shrink(exclude=[])  # the aborted subgroup rebuilt: the parent goes on
    out["parent after sub shrink"] = await _sum(comm, 1.0)
    await a.close()
    out["parent after sub close"] = await _sum(comm, 1.0)
    out["rebuilt sub"] = await _sum(rebuilt, 1.0)
    await rebuilt.close()
    # The parent closed: its subgroups go on, and can split again.
    c = await b.split([list(range(b.world_size))])
    assert c is not None
    await comm.close()
    out["sub after parent close"] = await _sum(b, 1.0)
    # The subgroup shrunk (planned, healthy): its own split goes on.
    if b.world_size == 2 and b.rank == 0:  # its rank 1 is left out (its b aborts)
        shrunk = await b.shrink(exclude=[1])
        out["shrunk"] = (shrunk.world_size, await _sum(shrunk, 1.0))
        await shrunk.close()
    out["split of a shrunk sub"] = await _sum(c, 1.0)
    await c.close()
    await b.close()
    return out


def test_subgroups_and_their_parent_are_independent() -> None:
    r0, r1, r2 = run_ranks(independence, world_size=3, timeout=90)
    for r in (r0, r1, r2):
        assert r["parent after sub abort"] == r["parent after sub shrink"] == 3.0
        assert r["parent after sub close"] == 3.0
    assert [r["rebuilt sub"] for r in (r0, r1, r2)] == [2.0, 2.0, 1.0]
    assert r0["sibling after sub abort"] == 1.0 and r1["sibling after sub abort"] == 2.0
    assert r0["sub after parent close"] == 1.0 and r2["sub after parent close"] == 2.0
    assert r1["shrunk"] == (1, 1.0) and "shrunk" not in r2
    assert r0["split of a shrunk sub"] == 1.0 and r1["split of a shrunk sub"] == 2.0


async def parent_aborted(comm: Any) -> dict[str, Any]:
    sub = await comm.split([[0, 1]])
    assert sub is not None
    comm.abort("the test aborts the parent")
    out: dict[str, Any] = {"sub after parent abort": await _sum(sub, 1.0)}
    shrunk = await comm.shrink(exclude=[])  # the parent rebuilt: the subgroup goes on
    out["shrunk parent"] = await _sum(shrunk, 1.0)
    out["sub after parent shrink"] = await _sum(sub, 1.0)
    try:
        await comm.split([[0, 1]])
    except ac.CommAborted:
        out["split of an aborted parent"] = "CommAborted"
    await sub.close()
    await shrunk.close()
    return out


def test_a_subgroup_outlives_its_parent_aborted_and_shrunk() -> None:
    results = run_ranks(parent_aborted, world_size=2, timeout=90)
    assert (
        results
        == [
            {
                "sub after parent abort": 2.0,
                "shrunk parent": 2.0,
                "sub after parent shrink": 2.0,
                "split of an aborted parent": "CommAborted",
            }
        ]
        * 2
    )


async def peer_dies(comm: Any) -> dict[str, Any]:
    sub = await comm.split([[1, 2]])
    assert await _sum(comm, 1.0) == 3.0
    if comm.rank == 2:
        crash()
    await anyio.sleep(0.5)  # rank 2 is gone
    out: dict[str, Any] = {}
    for name, group in (("world", comm), ("sub", sub)):
        if group is None:
            continue
        try:
            await _sum(group, 1.0, timeout=20)
            out[name] = "done"
        except ac.PeerFailure as exc:
            out[name] = exc.ranks
    return out


def test_a_dead_peer_is_reported_by_every_group_that_contains_it() -> None:
    r0, r1, _ = run_ranks(peer_dies, world_size=3, timeout=90, lost=(2,))
    assert r0 == {"world": (2,)}
    assert r1 == {"world": (2,), "sub": (1,)}  # rank 2 is rank 1 of the subgroup


async def peer_dies_before_split(comm: Any) -> Any:
    assert await _sum(comm, 1.0) == 3.0
    if comm.rank == 2:
        crash()
    start = time.monotonic()
    try:
        await comm.split([[0, 1], [2]], timeout=30)
        return "made"
    except ac.PeerFailure as exc:
        return exc.ranks, time.monotonic() - start < 10


def test_a_peer_dead_before_a_split_is_a_peer_failure_not_a_wait() -> None:
    r0, r1, _ = run_ranks(peer_dies_before_split, world_size=3, timeout=90, lost=(2,))
    assert r0 == r1 == ((2,), True)  # was: CollectiveTimeout after 30 s


def test_split_of_a_wrapped_group_is_invalid_argument() -> None:
    store = dist.HashStore()
    pg = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=10))
    comm = ac.wrap(pg)
    with pytest.raises(ac.InvalidArgument, match="split needs"):
        anyio.run(comm.split, [[0]])


def _factories(rank: int, subgroup: Any) -> Any:
    """Backends as ``init`` makes them, except a subgroup's Gloo on world rank ``rank``:
    ``subgroup(build)`` runs in its place, on the creation's thread (the world and
    shrunk groups have 3 ranks)."""
    from asynccoll._bootstrap.build import Factories, build_gloo

    def gloo(store: Any, new_rank: int, world_size: int, timeout: float) -> Any:
        if world_size == 2:
            return subgroup(lambda: build_gloo(store, new_rank, world_size, timeout))
        return build_gloo(store, new_rank, world_size, timeout)

    return Factories(gloo=gloo)


async def member_dies_in_connect(ctx: Any) -> Any:
    from asynccoll._bootstrap.init import init_with

    def dies(build: Any) -> Any:
        if ctx.rank == 2:
            crash()  # inside the subgroup's creation, before its Gloo connect
        return build()

    comm = await init_with(
        _factories(ctx.rank, dies), "gloo", rank=ctx.rank, world_size=3, store=ctx.store, timeout=20
    )
    assert await _sum(comm, 1.0) == 3.0
    start = time.monotonic()
    try:
        sub = await comm.split([[0, 2], [1]])
        out: Any = ("made", sub.world_size if sub is not None else None)
    except ac.PeerFailure as exc:
        out = ("PeerFailure", exc.ranks)
    except ac.AsyncCollError as exc:
        out = (type(exc).__name__, str(exc)[:200])
    return out, time.monotonic() - start


def test_a_member_that_dies_in_the_subgroups_connect_ends_the_split_at_once() -> None:
    (r0, took0), (r1, _), _ = run_ranks(
        member_dies_in_connect, world_size=3, backend=None, timeout=90, lost=(2,)
    )
    assert r0 == ("PeerFailure", (2,)), r0  # was: CollectiveTimeout after the 20 s timeout
    assert took0 < 5.0, took0
    assert r1 == ("made", 1)


async def parent_aborted_in_agreement(ctx: Any) -> Any:
    comm = await ac.init("gloo", rank=ctx.rank, world_size=2, store=ctx.store, timeout=20)
    assert await _sum(comm, 1.0) == 2.0
    if ctx.rank == 1:  # never calls split: rank 0 waits in the agreement
        while not ctx.store.check(["done"]):
            await anyio.sleep(0.05)
        comm.abort()
        await comm.close()
        return None
    start = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_abort_later, comm, 0.5)
        try:
            await comm.split([[0, 1]])
            out = "made"
        except ac.AsyncCollError as exc:
            out = type(exc).__name__
    took = time.monotonic() - start
    ctx.store.set("done", "1")
    await comm.close()
    return out, took


async def _abort_later(comm: Any, delay: float) -> None:
    await anyio.sleep(delay)
    comm.abort("the test aborts the parent")


def test_an_abort_of_the_parent_ends_a_split_in_its_agreement() -> None:
    (out, took), _ = run_ranks(parent_aborted_in_agreement, world_size=2, backend=None, timeout=90)
    assert out == "CommAborted", out  # was: CollectiveTimeout after the 20 s timeout
    assert took < 3.0, took


async def parent_aborted_in_connect(ctx: Any) -> Any:
    from asynccoll._bootstrap.init import init_with

    def slow(build: Any) -> Any:
        if ctx.rank == 1:  # rank 0 waits in its Gloo connect meanwhile
            time.sleep(30)  # (the thread outlives the split: the process exits under it)
        return build()

    comm = await init_with(
        _factories(ctx.rank, slow), "gloo", rank=ctx.rank, world_size=3, store=ctx.store, timeout=20
    )
    assert await _sum(comm, 1.0) == 3.0
    start = time.monotonic()
    async with anyio.create_task_group() as tg:
        if ctx.rank == 0:
            tg.start_soon(_abort_later, comm, 1.0)
        try:
            await comm.split([[0, 1], [2]])
            out = "made"
        except ac.AsyncCollError as exc:
            out = type(exc).__name__
    took = time.monotonic() - start
    await comm.close()
    return out, took


def test_an_abort_of_the_parent_ends_a_split_in_its_subgroups_connect() -> None:
    """Rank 0 aborts its parent while it waits in the subgroup's Gloo connect for rank 1;
    rank 1 (slow to build) hears the abort as news: both end at once."""
    (out0, took0), (out1, took1), _ = run_ranks(
        parent_aborted_in_connect, world_size=3, backend=None, timeout=90
    )
    assert (out0, out1) == ("CommAborted", "CommAborted")  # were: after the 20 s timeout
    assert took0 < 4.0 and took1 < 4.0, (took0, took1)
