"""torch.distributed on a communicator: the process group's collectives, its c10d Works,
the ``"asynccoll"`` backend name, DDP on it, and the faults it reports."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import asynccoll as ac
from asynccoll.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------ collectives
async def collectives(comm: ac.Communicator) -> dict[str, Any]:
    pg = ac.process_group(comm)
    r, n = comm.rank, comm.world_size
    out: dict[str, Any] = {"name": pg.name(), "rank": pg.rank(), "size": pg.size()}

    t = torch.full((8,), float(r + 1))
    dist.all_reduce(t, group=pg)
    out["all_reduce"] = t.tolist()

    t = torch.full((3,), float(r + 1))
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg, async_op=True)
    fut = work.get_future()
    assert work.wait() is True
    assert work.is_completed() and work.is_success() and work.exception() is None
    out["max"] = t.tolist()
    out["future"] = [x.tolist() for x in fut.wait()]
    assert work.result()[0] is t

    chunks = [torch.empty(2) for _ in range(n)]
    dist.all_gather(chunks, torch.full((2,), float(r)), group=pg)
    out["all_gather"] = [c.tolist() for c in chunks]

    flat = torch.empty(2 * n)
    dist.all_gather_single(flat, torch.full((2,), float(r)), group=pg)
    out["all_gather_into_tensor"] = flat.tolist()

    got = torch.empty(2)
    dist.reduce_scatter(got, [torch.full((2,), float(i + r)) for i in range(n)], group=pg)
    out["reduce_scatter"] = got.tolist()

    got = torch.empty(2)
    dist.reduce_scatter_single(got, torch.arange(2.0 * n) + r, group=pg)
    out["reduce_scatter_tensor"] = got.tolist()

    t = torch.full((2,), float(r))
    dist.broadcast(t, group_src=1, group=pg)
    out["broadcast"] = t.tolist()

    t = torch.full((2,), float(r + 1))
    dist.reduce(t, group_dst=0, group=pg)
    out["reduce"] = t.tolist() if r == 0 else None

    into = [torch.empty(1) for _ in range(n)] if r == 0 else None
    dist.gather(torch.tensor([float(r * 10)]), into, group_dst=0, group=pg)
    out["gather"] = [x.item() for x in into] if into is not None else None

    t = torch.empty(1)
    dist.scatter(
        t,
        [torch.tensor([float(i * 7)]) for i in range(n)] if r == 1 else None,
        group_src=1,
        group=pg,
    )
    out["scatter"] = t.item()

    t = torch.empty(n)
    dist.all_to_all_single(t, torch.arange(float(n)) + 10 * r, group=pg)
    out["all_to_all_single"] = t.tolist()

    outs = [torch.empty(1) for _ in range(n)]
    dist.all_to_all(outs, [torch.tensor([float(10 * r + i)]) for i in range(n)], group=pg)
    out["all_to_all"] = [x.item() for x in outs]

    t = torch.tensor([float(r)])
    if r == 0:
        dist.send(torch.tensor([42.0]), group_dst=1, group=pg)
    elif r == 1:
        pg.recv(
            [t], 0, 0
        ).wait()  # dist.recv returns the sender's global rank: the group is not torch's world
    out["p2p"] = t.item()

    dist.barrier(group=pg)

    # One issue order: an op issued through the group takes the next seq after the
    # communicator's own awaitable call, and both show in its flight record.
    own = comm.all_reduce(torch.ones(1))
    t = torch.ones(4)
    work = dist.all_reduce(t, group=pg, async_op=True)
    await own
    work.wait()
    record = comm.flight_record()
    out["last_two"] = [(e["op"], e["shape"], e["state"]) for e in record[-2:]]
    out["seq_follows"] = record[-1]["seq"] == own.seq + 1
    return out


def test_collectives_through_the_process_group() -> None:
    res = run_ranks(collectives, world_size=2, timeout=60)
    for r, got in enumerate(res):
        assert got["name"] == "asynccoll" and got["rank"] == r and got["size"] == 2
        assert got["all_reduce"] == [3.0] * 8
        assert got["max"] == [2.0] * 3 and got["future"] == [[2.0] * 3]
        assert got["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert got["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        # input chunk i on rank q holds i + q: chunk r summed is 2r + 1
        assert got["reduce_scatter"] == [2.0 * r + 1] * 2
        assert got["reduce_scatter_tensor"] == [4.0 * r + 1, 4.0 * r + 3]
        assert got["broadcast"] == [1.0, 1.0]
        assert got["scatter"] == 7.0 * r
        assert got["all_to_all_single"] == [float(r), 10.0 + r]
        assert got["all_to_all"] == [float(r), 10.0 + r]
        assert got["last_two"] == [("all_reduce", [1], "done"), ("all_reduce", [4], "done")]
        assert got["seq_follows"]
    assert res[0]["reduce"] == [3.0, 3.0] and res[0]["gather"] == [0.0, 10.0]
    assert res[1]["p2p"] == 42.0
