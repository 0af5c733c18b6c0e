"""A receive from any source: ``dist.recv(t)`` / ``dist.irecv(t)`` without ``src`` on the
process group (c10d's ``recv_anysource`` and ``Work._source_rank()``), and the
communicator's ``recv_any`` beneath it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import asynccoll as ac
from asynccoll.testing import run_ranks
from tests.support.backends import auto_on_one_host

pytestmark = pytest.mark.timeout(120)


async def any_source_through_dist(ctx: Any) -> dict[str, Any]:
    """Rank 0 receives two tensors from each peer without naming it; each holds its sender's rank."""
    dist.init_process_group("asynccoll", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size)
    try:
        got: dict[str, Any] = {"recv": [], "irecv": []}
        if ctx.rank == 0:
            for _ in range(ctx.world_size - 1):
                t = torch.full((4,), -1.0)
                sender = dist.recv(t)
                got["recv"].append((sender, t.tolist()))
                t = torch.full((4,), -1.0)
                work = dist.irecv(t)
                assert work is not None
                work.wait()
                got["irecv"].append((work._source_rank(), t.tolist()))
        else:
            dist.send(torch.full((4,), float(ctx.rank)), dst=0)
            dist.send(torch.full((4,), float(ctx.rank)), dst=0)
        dist.barrier()
        comm = dist.group.WORLD.comm  # type: ignore[union-attr]
        got["ops"] = [e["op"] for e in comm.flight_record() if e["op"] in ("send", "recv")]
        return got
    finally:
        dist.destroy_process_group()


@auto_on_one_host(3)
def test_recv_without_a_source_reports_the_sender() -> None:
    res = run_ranks(any_source_through_dist, world_size=3, backend=None, timeout=90)
    got = res[0]
    received = got["recv"] + got["irecv"]  # in whichever order the sends arrived
    assert sorted(sender for sender, _ in received) == [1, 1, 2, 2], got
    for sender, values in received:
        assert values == [float(sender)] * 4
    assert got["ops"] == ["recv"] * 4
    assert res[1]["ops"] == res[2]["ops"] == ["send"] * 2


async def recv_any(comm: ac.Communicator) -> dict[str, Any]:
    """The communicator's own receive from any source: the Work's result is the sender's rank."""
    got: dict[str, Any] = {}
    if comm.rank == 0:
        senders = []
        for _ in range(comm.world_size - 1):
            t = torch.zeros(2, dtype=torch.int64)
            sender = await comm.recv_any(t)
            assert t.tolist() == [sender * 10] * 2
            senders.append(sender)
        got["senders"] = sorted(senders)
        with pytest.raises(ac.InvalidArgument, match="coalescing"):
            async with comm.coalescing():
                comm.recv_any(torch.zeros(1))
        got["record"] = comm.flight_record()[-1]["op"]
    else:
        await comm.send(torch.full((2,), comm.rank * 10, dtype=torch.int64), 0)
    await comm.barrier()
    return got


def test_comm_recv_any_returns_the_senders_rank() -> None:
    res = run_ranks(recv_any, world_size=3, timeout=90)
    assert res[0]["senders"] == [1, 2]
    assert res[0]["record"] == "recv"


async def refused_under_fingerprint(ctx: Any) -> str:
    comm = await ac.init(
        "gloo", rank=ctx.rank, world_size=ctx.world_size, store=ctx.store, check="fingerprint"
    )
    try:
        with pytest.raises(ac.InvalidArgument, match="fingerprint"):
            comm.recv_any(torch.zeros(1))
        await comm.barrier()  # nothing was issued: the ranks still agree
        return comm.state
    finally:
        await comm.close()


def test_recv_any_is_refused_under_the_fingerprint_check() -> None:
    assert run_ranks(refused_under_fingerprint, world_size=2, backend=None, timeout=60) == [
        "ok",
        "ok",
    ]
