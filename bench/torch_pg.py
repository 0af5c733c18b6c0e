"""torch.distributed on asynccoll against torch's own Gloo group, in the same run.

    python -m bench.torch_pg [--rounds 5] [--ops 300] [--steps 20] [--smoke] [--json PATH]

Two ranks (``asynccoll.testing.run_ranks``); each builds torch's default Gloo group
and an asynccoll communicator on the same store, and its process group
(``asynccoll.process_group(comm)``). Run in a plain thread (no event loop), as a
torchrun script would:

A. ``dist.all_reduce(t, group=...)`` of 8 floats, synchronous: per-op time, the two
   groups alternating round by round; the median over rounds of each round's mean.
B. A DDP training step (forward, backward, SGD step) of a small MLP: DDP on the
   asynccoll group against DDP on torch's group, alternating round by round.

Prints the medians and the ratios (asynccoll / torch) with ``/proc/loadavg``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import asynccoll as ac
from asynccoll.testing import run_ranks


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


def _all_reduce_round(group: Any, ops: int) -> float:
    t = torch.ones(8)
    start = time.perf_counter()
    for _ in range(ops):
        dist.all_reduce(t, group=group)
    return (time.perf_counter() - start) / ops


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def _ddp_round(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> float:
    x, y = torch.randn(64, 256), torch.randn(64, 10)
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return (time.perf_counter() - start) / steps


def _measure(pg: Any, rounds: int, ops: int, steps: int) -> dict[str, Any]:
    gloo = dist.group.WORLD
    for group in (gloo, pg):  # warm-up: connections, allocator
        _all_reduce_round(group, 20)
    ar: dict[str, list[float]] = {"torch": [], "asynccoll": []}
    for _ in range(rounds):
        ar["torch"].append(_all_reduce_round(gloo, ops))
        ar["asynccoll"].append(_all_reduce_round(pg, ops))
    ddp = {"torch": DDP(_model()), "asynccoll": DDP(_model(), process_group=pg)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in ddp.items()}
    for k in ddp:
        _ddp_round(ddp[k], opts[k], 3)
    step: dict[str, list[float]] = {"torch": [], "asynccoll": []}
    for _ in range(rounds):
        for k in ("torch", "asynccoll"):
            step[k].append(_ddp_round(ddp[k], opts[k], steps))
    return {"all_reduce": ar, "ddp_step": step}


async def _rank(ctx: Any, rounds: int, ops: int, steps: int) -> dict[str, Any]:
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("torch/", ctx.store),
        rank=ctx.rank,
        world_size=ctx.world_size,
    )
    comm = await ac.init(
        "gloo", rank=ctx.rank, world_size=ctx.world_size, store=dist.PrefixStore("ac/", ctx.store)
    )
    try:
        pg = ac.process_group(comm)
        return await asyncio.to_thread(_measure, pg, rounds, ops, steps)
    finally:
        await comm.close()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="a few iterations: it runs")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.ops, args.steps = 2, 10, 2
    load_before = _loadavg()
    res = run_ranks(
        _rank, world_size=2, backend=None, timeout=600, args=(args.rounds, args.ops, args.steps)
    )[0]
    out: dict[str, Any] = {"loadavg_before": load_before, "loadavg_after": _loadavg()}
    for what in ("all_reduce", "ddp_step"):
        med = {k: statistics.median(v) for k, v in res[what].items()}
        out[what] = {
            "torch_ms": med["torch"] * 1e3,
            "asynccoll_ms": med["asynccoll"] * 1e3,
            "ratio": med["asynccoll"] / med["torch"],
            "rounds_ms": {k: [x * 1e3 for x in v] for k, v in res[what].items()},
        }
    print(f"loadavg: {out['loadavg_before']} -> {out['loadavg_after']}")
    for what, label in (("all_reduce", "dist.all_reduce 8 floats"), ("ddp_step", "DDP step")):
        r = out[what]
        print(
            f"{label:26s} torch {r['torch_ms']:.3f} ms  asynccoll {r['asynccoll_ms']:.3f} ms"
            f"  ratio {r['ratio']:.3f}  (median of {args.rounds})"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
