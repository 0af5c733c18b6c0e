"""Groups torch makes on the ``"asynccoll"`` backend: ``dist.new_group``'s global and
group ranks, and functional collectives (``torch.distributed._functional_collectives``,
DTensor's ``full_tensor()``) running through the group's methods."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from asynccoll.testing import run_ranks
from tests.support.backends import auto_on_one_host

pytestmark = pytest.mark.timeout(120)


async def subgroup_ranks(ctx: Any) -> dict[str, Any] | None:
    """A ``new_group([1, 2])`` of three ranks: torch maps global and group ranks, and the
    ops on it name roots and senders by global rank."""
    dist.init_process_group("asynccoll", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size)
    try:
        sub = dist.new_group([1, 2])  # the default backend: asynccoll
        if ctx.rank == 0:
            return None
        assert sub is not None
        t = torch.full((2,), float(ctx.rank))
        dist.broadcast(t, src=2, group=sub)  # a global rank
        got: dict[str, Any] = {
            "backend": dist.get_backend(sub),
            "ranks": dist.get_process_group_ranks(sub),
            "group_rank": dist.get_rank(sub),
            "global_of_0": dist.get_global_rank(sub, 0),
            "group_of_2": dist.get_group_rank(sub, 2),
            "comm_rank": sub.comm.rank,
            "broadcast": t.tolist(),
        }
        if ctx.rank == 1:
            got["sender"] = dist.recv(torch.empty(1), group=sub)  # any source: a global rank
        else:
            dist.send(torch.ones(1), dst=1, group=sub)
        return got
    finally:
        dist.destroy_process_group()


@auto_on_one_host(3)
def test_new_group_maps_global_and_group_ranks() -> None:
    res = run_ranks(subgroup_ranks, world_size=3, backend=None, timeout=90)
    assert res[0] is None
    for r in (1, 2):
        got = res[r]
        assert got["backend"] == "asynccoll" and got["ranks"] == [1, 2]
        assert got["group_rank"] == got["comm_rank"] == r - 1
        assert got["global_of_0"] == 1 and got["group_of_2"] == 1
        assert got["broadcast"] == [2.0, 2.0]
    assert res[1]["sender"] == 2


async def functional(ctx: Any) -> dict[str, Any]:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("asynccoll", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size)
    try:
        r, n = ctx.rank, ctx.world_size
        pg = dist.group.WORLD
        assert pg is not None
        comm = pg.comm  # type: ignore[attr-defined]
        before = len(comm.flight_record())
        got: dict[str, Any] = {
            "all_reduce": funcol.all_reduce(torch.full((4,), r + 1.0), "sum", pg).tolist(),
            "all_gather": funcol.all_gather_tensor(torch.full((2,), float(r)), 0, pg).tolist(),
            "reduce_scatter": funcol.reduce_scatter_tensor(
                torch.arange(2.0 * n) + r, "sum", 0, pg
            ).tolist(),
            "all_to_all": funcol.all_to_all_single(
                torch.arange(float(n)) + 10 * r, None, None, pg
            ).tolist(),
            "broadcast": funcol.broadcast(torch.full((2,), float(r)), 1, pg).tolist(),
        }
        got["through_comm"] = [e["op"] for e in comm.flight_record()[before:]]
        mesh = init_device_mesh("cpu", (n,))
        full = torch.arange(8.0).reshape(4, 2)
        got["full_tensor"] = torch.equal(
            distribute_tensor(full, mesh, [Shard(0)]).full_tensor(), full
        )
        return got
    finally:
        dist.destroy_process_group()


@auto_on_one_host(2)
def test_functional_collectives_run_through_the_group() -> None:
    res = run_ranks(functional, world_size=2, backend=None, timeout=90)
    for r, got in enumerate(res):
        assert got["all_reduce"] == [3.0] * 4
        assert got["all_gather"] == [0.0, 0.0, 1.0, 1.0]
        assert got["reduce_scatter"] == [4.0 * r + 1, 4.0 * r + 3]
        assert got["all_to_all"] == [float(r), 10.0 + r]
        assert got["broadcast"] == [1.0, 1.0]
        assert got["through_comm"] == [
            "all_reduce",
            "all_gather",
            "reduce_scatter",
            "all_to_all",
            "broadcast",
        ]
        assert got["full_tensor"]


async def unequal_splits(ctx: Any) -> dict[str, Any]:
    """Rank r sends (r + j) % 3 rows of ``100 r + j`` to rank j (none between ranks 1 and 2)."""
    import torch.distributed._functional_collectives as funcol

    dist.init_process_group("asynccoll", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size)
    try:
        r, n = ctx.rank, ctx.world_size
        sizes = [(r + j) % n for j in range(n)]  # in: to j; out: from j (the same count)
        inp = torch.cat([torch.full((size, 2), 100.0 * r + j) for j, size in enumerate(sizes)])
        out = torch.full((sum(sizes), 2), -1.0)
        dist.all_to_all_single(out, inp, output_split_sizes=sizes, input_split_sizes=sizes)
        pg = dist.group.WORLD
        assert pg is not None
        functional = funcol.all_to_all_single(inp, sizes, sizes, pg)
        return {"dist": out[:, 0].tolist(), "funcol": functional[:, 1].tolist()}
    finally:
        dist.destroy_process_group()


@auto_on_one_host(3)
def test_all_to_all_single_with_unequal_splits() -> None:
    res = run_ranks(unequal_splits, world_size=3, backend=None, timeout=90)
    for r, got in enumerate(res):
        want = [100.0 * j + r for j in range(3) for _ in range((j + r) % 3)]
        assert got["dist"] == got["funcol"] == want
