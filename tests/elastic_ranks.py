"""Rank functions for tests/test_elastic.py (run_ranks needs them importable)."""

from __future__ import annotations

import anyio
import torch

import asynccoll as ac
from asynccoll.testing import RankContext


async def members_wait_then_grow(ctx: RankContext, members: int) -> dict:
    if ctx.rank >= members:
        comm = await ac.join("gloo", store=ctx.store, name="g", timeout=30)
        state = await comm.broadcast_state(None, src=0)
    else:
        old = await ac.init("gloo", rank=ctx.rank, world_size=members, store=ctx.store, name="g", timeout=30)
        counts = []
        while True:
            n = await old.waiting()
            counts.append(n)
            if n == ctx.world_size - members:
                break
            await anyio.sleep(0.01)
        comm = await old.grow(old.world_size + n)
        assert old.state == "closed"
        state = await comm.broadcast_state({"w": torch.arange(6.0).reshape(2, 3), "step": 7}, src=0)
    t = torch.ones(3) * (comm.rank + 1)
    await comm.all_reduce(t)
    out = {"rank": comm.rank, "size": comm.world_size, "name": comm.name, "sum": t.tolist(),
           "w": state["w"].tolist(), "step": state["step"]}
    await comm.close()
    return out
