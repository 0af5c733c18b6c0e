"""Every collective x reduce op x dtype, on real processes, for every available backend.

One test body runs on Gloo (world sizes 2 and 3) and on NCCL (world size 1 on a
single GPU, skipped without one), under asyncio, uvloop and trio. Each rank checks its
own results against values computed locally, so a wrong element fails the rank
and ``run_ranks`` re-raises it here with the rank's traceback.
"""

from __future__ import annotations

import anyio
import pytest
import torch

import asynccoll as ac
from asynccoll.testing import run_ranks
from tests.support.backends import BACKENDS, LOOPS

OPS = [ac.ReduceOp.SUM, ac.ReduceOp.PROD, ac.ReduceOp.MIN, ac.ReduceOp.MAX, ac.ReduceOp.AVG]
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint8,
]


def rank_values(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Small values (no int8 overflow for PROD at world size 3), different per rank."""
    base = (torch.arange(n) % 3 + 1) * (rank + 1)
    return base.to(dtype)


def expected(op: ac.ReduceOp, ws: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    vals = torch.stack([rank_values(r, n, torch.float64) for r in range(ws)])
    if op is ac.ReduceOp.SUM:
        out = vals.sum(0)
    elif op is ac.ReduceOp.PROD:
        out = vals.prod(0)
    elif op is ac.ReduceOp.MIN:
        out = vals.min(0).values
    elif op is ac.ReduceOp.MAX:
        out = vals.max(0).values
    else:
        out = vals.sum(0) / ws
        if not dtype.is_floating_point:
            out = torch.floor(out)
    return out.to(dtype)


def close_enough(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.cpu(), want.cpu()
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if got.dtype.is_floating_point:
        ok = torch.allclose(got.double(), want.double(), rtol=1e-2, atol=1e-2)
    else:
        ok = torch.equal(got, want)
    assert ok, f"{what}: got {got.tolist()} want {want.tolist()}"


async def every_collective(comm: ac.Communicator) -> int:
    """Runs each collective with each op and dtype; returns the number of checks made."""
    r, ws, dev = comm.rank, comm.world_size, comm.device
    checks = 0
    for dtype in DTYPES:
        n = 5
        for op in OPS:
            t = rank_values(r, n, dtype).to(dev)
            res = await comm.all_reduce(t, op)
            assert res is t
            close_enough(t, expected(op, ws, n, dtype), f"all_reduce {op.name} {dtype}")
            t = rank_values(r, n, dtype).to(dev)
            await comm.reduce(t, dst=ws - 1, op=op)
            if r == ws - 1:
                close_enough(t, expected(op, ws, n, dtype), f"reduce {op.name} {dtype}")
            inp = torch.cat([rank_values(r, n, dtype)] * ws).to(dev)
            out = torch.zeros(n, dtype=dtype, device=dev)
            await comm.reduce_scatter(out, inp, op)
            close_enough(out, expected(op, ws, n, dtype), f"reduce_scatter {op.name} {dtype}")
            checks += 3
        # data movement
        src = ws - 1
        t = rank_values(r, n, dtype).to(dev)
        await comm.broadcast(t, src=src)
        close_enough(t, rank_values(src, n, dtype), f"broadcast {dtype}")
        out = torch.zeros(ws * n, dtype=dtype, device=dev)
        got = await comm.all_gather(out, rank_values(r, n, dtype).to(dev))
        assert got is out
        close_enough(
            out, torch.cat([rank_values(i, n, dtype) for i in range(ws)]), f"all_gather {dtype}"
        )
        inp = torch.cat([torch.full((2,), 10 * r + j) for j in range(ws)]).to(dtype).to(dev)
        out = torch.zeros(2 * ws, dtype=dtype, device=dev)
        await comm.all_to_all(out, inp)
        close_enough(
            out,
            torch.cat([torch.full((2,), 10 * j + r) for j in range(ws)]).to(dtype),
            f"all_to_all {dtype}",
        )
        out = torch.zeros(ws * n, dtype=dtype, device=dev) if r == 0 else None
        got = await comm.gather(rank_values(r, n, dtype).to(dev), dst=0, output=out)
        if r == 0:
            assert got is out
            close_enough(
                out, torch.cat([rank_values(i, n, dtype) for i in range(ws)]), f"gather {dtype}"
            )
        else:
            assert got is None
        full = (
            torch.cat([rank_values(i, n, dtype) for i in range(ws)]).to(dev) if r == src else None
        )
        out = torch.zeros(n, dtype=dtype, device=dev)
        await comm.scatter(out, src=src, input=full)
        close_enough(out, rank_values(r, n, dtype), f"scatter {dtype}")
        checks += 5
    # 2-D tensors and point-to-point in a ring
    m = torch.arange(6.0, device=dev).reshape(2, 3) * (r + 1)
    await comm.all_reduce(m)
    close_enough(m, torch.arange(6.0).reshape(2, 3) * sum(range(1, ws + 1)), "all_reduce 2-D")
    if ws > 1:
        nxt, prv = (r + 1) % ws, (r - 1) % ws
        buf = torch.zeros(4, device=dev)
        if r % 2 == 0:
            await comm.send(torch.full((4,), float(r), device=dev), nxt)
            await comm.recv(buf, prv)
        else:
            await comm.recv(buf, prv)
            await comm.send(torch.full((4,), float(r), device=dev), nxt)
        close_enough(buf, torch.full((4,), float(prv)), "send/recv ring")
    assert await comm.barrier() is None
    objs = await comm.all_gather_object({"rank": r, "name": f"r{r}"})
    assert objs == [{"rank": i, "name": f"r{i}"} for i in range(ws)]
    assert await comm.broadcast_object(("hello", r) if r == 0 else None, src=0) == ("hello", 0)
    return checks + 4


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("backend,world_size", BACKENDS)
def test_every_collective(backend: str, world_size: int, loop: str) -> None:
    results = run_ranks(
        every_collective, world_size=world_size, backend=backend, timeout=120, loop=loop
    )
    assert len(results) == world_size
    assert all(n == results[0] and n > 100 for n in results)


async def bool_and_half_reductions(comm: ac.Communicator) -> list[bool]:
    r, dev = comm.rank, comm.device
    t = torch.tensor([r == 0, True, False], device=dev)
    await comm.all_reduce(t, ac.ReduceOp.MAX)  # logical or
    u = torch.tensor([r == 0, True, False], device=dev)
    await comm.all_reduce(u, ac.ReduceOp.MIN)  # logical and
    return t.tolist() + u.tolist()


@pytest.mark.parametrize("backend,world_size", BACKENDS)
def test_bool_reductions(backend: str, world_size: int) -> None:
    results = run_ranks(
        bool_and_half_reductions, world_size=world_size, backend=backend, timeout=60
    )
    alone = world_size == 1
    assert results == [[True, True, False, alone, True, False]] * world_size


async def many_in_flight(comm: ac.Communicator) -> float:
    """200 Works issued at once, awaited together, each with its own expected result."""
    dev, ws = comm.device, comm.world_size
    tensors = [torch.full((16,), float(i + comm.rank), device=dev) for i in range(200)]
    works = [comm.all_reduce(t) for t in tensors]
    assert [w.seq for w in works] == list(range(works[0].seq, works[0].seq + 200))
    results = [await w for w in works]  # issued at once, awaited one by one (any loop)
    for i, (w, t, res) in enumerate(zip(works, tensors, results)):
        assert w.done() and w.exception() is None and res is t
        want = float(ws * i + sum(range(ws)))
        assert torch.all(t.cpu() == want), (i, t, want)
    return float(sum(t.sum().item() for t in tensors))


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("backend,world_size", BACKENDS)
def test_many_concurrent_works(backend: str, world_size: int, loop: str) -> None:
    results = run_ranks(
        many_in_flight, world_size=world_size, backend=backend, timeout=60, loop=loop
    )
    assert len(set(results)) == 1


async def heartbeat_while_busy(comm: ac.Communicator) -> dict[str, float]:
    """A 1 ms heartbeat keeps ticking while large all_reduces run.

    A blocking ``work.wait()`` would give it no tick at all while the ops run; the
    check is behavioural (ticks happen during the ops), not a timing bound.
    """
    ticks_during = 0
    busy = False
    stop = anyio.Event()

    async def heartbeat() -> None:
        nonlocal ticks_during
        while not stop.is_set():
            await anyio.sleep(0.001)
            ticks_during += busy

    big = torch.ones(4 << 20, device=comm.device)  # 16 MB
    with anyio.fail_after(50):
        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat)
            await anyio.sleep(0.01)
            t0 = anyio.current_time()
            busy = True
            for _ in range(4):
                await comm.all_reduce(big)
            busy = False
            op_time = (anyio.current_time() - t0) / 4
            stop.set()
    assert float(big[0]) == comm.world_size**4
    return {"op_time": op_time, "ticks_during": ticks_during}


@pytest.mark.parametrize("loop", LOOPS)
def test_loop_keeps_ticking(loop: str) -> None:
    results = run_ranks(heartbeat_while_busy, world_size=2, backend="gloo", timeout=60, loop=loop)
    for res in results:
        assert res["ticks_during"] >= 8, res
