"""The chaos soak's random op mix: one operation per step, the same on every rank, checked
against what it must be at the world size of the moment (``bench/_chaos_ranks.py`` runs it)."""

from __future__ import annotations

import random
from typing import Any


def value(k: int, r: int) -> float:
    """What world rank ``r`` contributes at step ``k``."""
    return float((k * 7 + r) % 97 + 1)


async def run_op(comm: Any, k: int, rng: random.Random, deadline: float, check: list[str]) -> None:
    """One random operation of step ``k`` (the same on every rank), checked."""
    import torch

    import asynccoll as ac

    ws, r = comm.world_size, comm.rank
    vals = [value(k, q) for q in range(ws)]
    kind = rng.choice(
        [
            "all_reduce",
            "all_reduce_max",
            "broadcast",
            "reduce",
            "all_gather",
            "reduce_scatter",
            "all_to_all",
            "gather",
            "scatter",
            "barrier",
            "ring",
            "batch",
            "mixed_batch",
            "object",
            "big_object",
            "bcast_object",
            "big",
        ]
    )
    root = rng.randrange(ws)
    dtype = rng.choice([torch.float32, torch.float64, torch.int64])
    n = rng.choice([1, 7, 256])

    def full(size: int, v: float) -> Any:
        return torch.full((size,), v, dtype=dtype)

    def expect(ok: bool, what: str) -> None:
        if not ok:
            check.append(f"step {k} {kind} on rank {r} of {ws}: {what}")

    if kind == "all_reduce":
        t = full(n, vals[r])
        await comm.all_reduce(t, timeout=deadline)
        expect(bool((t == sum(vals)).all()), f"sum {t[0].item()} != {sum(vals)}")
    elif kind == "all_reduce_max":
        t = full(n, vals[r])
        await comm.all_reduce(t, ac.ReduceOp.MAX, timeout=deadline)
        expect(bool((t == max(vals)).all()), "max")
    elif kind == "broadcast":
        t = full(n, vals[r])
        await comm.broadcast(t, root, timeout=deadline)
        expect(bool((t == vals[root]).all()), "broadcast")
    elif kind == "reduce":
        t = full(n, vals[r])
        await comm.reduce(t, root, timeout=deadline)
        if r == root:
            expect(bool((t == sum(vals)).all()), "reduce")
    elif kind == "all_gather":
        out = torch.zeros(n * ws, dtype=dtype)
        await comm.all_gather(out, full(n, vals[r]), timeout=deadline)
        expect(out.tolist() == [v for v in vals for _ in range(n)], "all_gather")
    elif kind == "reduce_scatter":
        out = torch.zeros(n, dtype=dtype)
        await comm.reduce_scatter(out, full(n * ws, vals[r]), timeout=deadline)
        expect(bool((out == sum(vals)).all()), "reduce_scatter")
    elif kind == "all_to_all":
        inp = torch.tensor([vals[r] * 100 + i for i in range(ws)], dtype=torch.float64)
        out = torch.zeros(ws, dtype=torch.float64)
        await comm.all_to_all(out, inp, timeout=deadline)
        expect(out.tolist() == [vals[q] * 100 + r for q in range(ws)], "all_to_all")
    elif kind == "gather":
        out = torch.zeros(n * ws, dtype=dtype) if r == root else None
        await comm.gather(full(n, vals[r]), root, out, timeout=deadline)
        if out is not None:
            expect(out.tolist() == [v for v in vals for _ in range(n)], "gather")
    elif kind == "scatter":
        out = torch.zeros(n, dtype=dtype)
        inp = torch.cat([full(n, v) for v in vals]) if r == root else None
        await comm.scatter(out, root, inp, timeout=deadline)
        expect(bool((out == vals[r]).all()), "scatter")
    elif kind == "barrier":
        await comm.barrier(timeout=deadline)
    elif kind == "ring":
        got = torch.zeros(3, dtype=dtype)
        send = comm.send(full(3, vals[r]), (r + 1) % ws, timeout=deadline)
        recv = comm.recv(got, (r - 1) % ws, timeout=deadline)
        await send
        await recv
        expect(bool((got == vals[(r - 1) % ws]).all()), "ring")
    elif kind == "batch":
        ts = [full(n, vals[r]), torch.full((5,), vals[r], dtype=torch.float64), full(2, vals[r])]
        async with comm.coalescing():
            for t in ts:
                comm.all_reduce(t, timeout=deadline)
        expect(all(bool((t == sum(vals)).all()) for t in ts), "coalesced batch")
    elif kind == "mixed_batch":  # one batch of several kinds, dtypes and ops (one group each)
        total = torch.full((n,), vals[r], dtype=torch.float32)
        top = torch.full((3,), int(vals[r]), dtype=torch.int64)
        from_root = full(4, vals[r])
        gathered = torch.zeros(2 * ws, dtype=torch.float64)
        async with comm.coalescing():
            comm.all_reduce(total, timeout=deadline)
            comm.all_reduce(top, ac.ReduceOp.MAX, timeout=deadline)
            comm.broadcast(from_root, root, timeout=deadline)
            comm.all_gather(
                gathered, torch.full((2,), vals[r], dtype=torch.float64), timeout=deadline
            )
        expect(bool((total == sum(vals)).all()), "mixed batch: all_reduce")
        expect(bool((top == int(max(vals))).all()), "mixed batch: all_reduce MAX")
        expect(bool((from_root == vals[root]).all()), "mixed batch: broadcast")
        expect(gathered.tolist() == [v for v in vals for _ in range(2)], "mixed batch: all_gather")
    elif kind == "object":
        got = await comm.all_gather_object({"r": r, "k": k}, timeout=deadline)
        expect(got == [{"r": q, "k": k} for q in range(ws)], "all_gather_object")
    elif kind == "big_object":  # larger than one store value should be (it never is one)
        blob = bytes([int(vals[r])]) * (300_000 + r)
        got = await comm.all_gather_object({"r": r, "blob": blob}, timeout=deadline)
        want = [{"r": q, "blob": bytes([int(vals[q])]) * (300_000 + q)} for q in range(ws)]
        expect(got == want, "all_gather_object of 300 kB each")
    elif kind == "bcast_object":
        got = await comm.broadcast_object(
            ("x", k, root) if r == root else None, root, timeout=deadline
        )
        expect(got == ("x", k, root), "broadcast_object")
    elif kind == "big":
        t = torch.full((1 << 18,), vals[r])
        await comm.all_reduce(t, timeout=deadline)
        expect(bool((t == sum(vals)).all()), "1 MB all_reduce")
