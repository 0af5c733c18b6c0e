"""Where each communicator's keys live on a shared store: one namespace per group.

A communicator's namespace comes from what its members agree on (world size, name,
and the group's generation on the store), never from a count per rank number: a
smaller group made on the world's store, a creation that failed or was cancelled,
and subgroups alive beside the world group leave every other creation alone.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import anyio
import pytest
import torch
import torch.distributed as dist

import asynccoll as ac
from asynccoll._bootstrap import build, rendezvous
from asynccoll.testing import RankContext, run_ranks
from tests.support.backends import gather

pytestmark = pytest.mark.timeout(120)


async def _sum(comm: Any, value: float) -> float:
    t = torch.full((2,), value)
    await comm.all_reduce(t)
    return float(t[0])


async def smaller_group_first(ctx: RankContext) -> float:
    """Ranks 0 and 1 of a 3-rank job make a 2-rank communicator on the job's store,
    then all three make the world's."""
    if ctx.rank < 2:
        pair = await ac.init("gloo", rank=ctx.rank, world_size=2, store=ctx.store, timeout=20)
        assert await _sum(pair, 1.0) == 2.0
        await pair.close()
    world = await ac.init("gloo", rank=ctx.rank, world_size=3, store=ctx.store, timeout=10)
    out = await _sum(world, float(ctx.rank + 1))
    await world.close()
    return out


def test_a_smaller_group_on_the_store_leaves_the_world_creation_alone() -> None:
    # Counted per rank number, the pair moved counters 0 and 1 only: the world's
    # ranks then met in different namespaces (a hang until CollectiveTimeout).
    assert run_ranks(smaller_group_first, world_size=3, backend=None, timeout=90) == [6.0] * 3


async def retry_after_timeout(ctx: RankContext) -> tuple[str, float]:
    """Rank 0's first init gives up (timeout) before rank 1 arrives; both then init."""
    kw: dict[str, Any] = dict(rank=ctx.rank, world_size=2, store=ctx.store)
    first = "none"
    if ctx.rank == 0:
        try:
            await ac.init("gloo", timeout=0.5, **kw)
        except ac.CollectiveTimeout:
            first = "timeout"
    else:
        await anyio.sleep(2.0)
    comm = await ac.init("gloo", timeout=10, **kw)
    out = await _sum(comm, 1.0)
    await comm.close()
    return first, out


def test_an_init_that_timed_out_does_not_poison_the_retry() -> None:
    results = run_ranks(retry_after_timeout, world_size=2, backend=None, timeout=90)
    assert results == [("timeout", 2.0), ("none", 2.0)]


async def retry_after_cancel(ctx: RankContext) -> tuple[bool, float]:
    """Rank 0's first init is cancelled (a cancel scope) while it waits for rank 1."""
    kw: dict[str, Any] = dict(rank=ctx.rank, world_size=2, store=ctx.store)
    cancelled = False
    if ctx.rank == 0:
        with anyio.move_on_after(0.5) as scope:
            await ac.init("gloo", timeout=20, **kw)
        cancelled = scope.cancelled_caught
    else:
        await anyio.sleep(2.0)
    comm = await ac.init("gloo", timeout=10, **kw)
    out = await _sum(comm, 1.0)
    await comm.close()
    return cancelled, out


def test_a_cancelled_init_does_not_poison_the_retry() -> None:
    results = run_ranks(retry_after_cancel, world_size=2, backend=None, timeout=90)
    assert results == [(True, 2.0), (False, 2.0)]


async def peer_gives_up(ctx: RankContext) -> tuple[str, float, float]:
    """Rank 0's creation fails after it took its namespace; rank 1 waits there."""
    kw: dict[str, Any] = dict(rank=ctx.rank, world_size=2, store=ctx.store)
    if ctx.rank == 0:
        real = build.agree_options

        async def refuse(*args: Any, **kwargs: Any) -> None:
            await anyio.sleep(0.5)  # rank 1 is waiting by now
            raise ac.InvalidArgument("refused by the test")

        build.agree_options = refuse  # type: ignore[assignment]
        try:
            with pytest.raises(ac.InvalidArgument):
                await ac.init("gloo", timeout=8, **kw)
        finally:
            build.agree_options = real
        seen, took = "refused", 0.0
    else:
        start = time.monotonic()
        try:
            await ac.init("gloo", timeout=8, **kw)
            seen = "made"
        except ac.CollectiveMismatch as exc:
            seen = f"mismatch {sorted(exc.details)} {'refused by the test' in str(exc)}"
        except ac.CollectiveTimeout:
            seen = "timeout"
        took = time.monotonic() - start
    comm = await ac.init("gloo", timeout=10, **kw)  # the retry meets in a new namespace
    out = await _sum(comm, 1.0)
    await comm.close()
    return seen, took, out


def test_a_peer_that_gave_up_its_creation_is_named_at_once() -> None:
    (r0, _, out0), (r1, took, out1) = run_ranks(
        peer_gives_up, world_size=2, backend=None, timeout=90
    )
    assert r0 == "refused"
    assert r1 == "mismatch [0] True", r1  # was: a wait until the timeout (8 s)
    assert took < 5.0
    assert out0 == out1 == 2.0


async def overlapping_groups(ctx: RankContext) -> list[float]:
    """On one store at once: the world (3 ranks), two overlapping subgroups split from
    it, and a named 2-rank group of processes 1 and 2 made with ``ac.init``."""
    world = await ac.init("gloo", rank=ctx.rank, world_size=3, store=ctx.store, timeout=20)
    low = await world.split([[0, 1]])
    high = await world.split([[1, 2]])
    pair = None
    if ctx.rank > 0:
        pair = await ac.init(
            "gloo", rank=ctx.rank - 1, world_size=2, store=ctx.store, timeout=20, name="pair"
        )
    comms = [c for c in (world, low, high, pair) if c is not None]
    scale = [10**i for i, c in enumerate((world, low, high, pair)) if c is not None]
    ts = [torch.full((1,), float(s * (ctx.rank + 1))) for s in scale]
    for w in [c.all_reduce(t) for c, t in zip(comms, ts)]:
        await w
    await gather(*(c.close for c in comms))
    return [float(t[0]) for t in ts]


def test_overlapping_groups_and_the_world_alive_at_once_on_one_store() -> None:
    r0, r1, r2 = run_ranks(overlapping_groups, world_size=3, backend=None, timeout=90)
    assert r0 == [6.0, 30.0]  # world, low {0, 1}
    assert r1 == [6.0, 30.0, 500.0, 5000.0]  # world, low, high {1, 2}, pair {1, 2}
    assert r2 == [6.0, 500.0, 5000.0]


def test_two_processes_claiming_one_rank_is_a_mismatch_naming_it() -> None:
    """Two groups of one world size and name created on one store at the same time:
    the second claimant of a rank number says so instead of pairing silently."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    rdv = rendezvous.Rendezvous(store, rank=1, world_size=2)
    errors: list[BaseException] = []

    def first() -> None:  # claims rank 1, then waits for rank 0's verdict (never comes)
        try:
            anyio.run(rendezvous.agree_options, rdv, "ns/", {"backend": "gloo"}, 2.0)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    thread = threading.Thread(target=first)
    thread.start()
    end = time.monotonic() + 10
    while time.monotonic() < end and not dist.PrefixStore("ns/", store).check(["opts/1"]):
        time.sleep(0.01)
    with pytest.raises(ac.CollectiveMismatch) as info:
        anyio.run(rendezvous.agree_options, rdv, "ns/", {"backend": "gloo"}, 2.0)
    thread.join(10)
    assert info.value.details == {1: "claimed twice"}
    assert "rank 1 is claimed by another process" in str(info.value)
    assert len(errors) == 1 and isinstance(errors[0], ac.CollectiveTimeout)
