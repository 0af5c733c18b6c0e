"""Core benchmark: asynccoll on Gloo against torch.distributed Gloo, same machine, same run.

    python -m bench [--quick] [--json bench/results/core.json] [--loop asyncio|uvloop]

Two ranks are spawned on this machine. Each rank builds an asynccoll communicator
and a torch.distributed Gloo group (``init_process_group``, the classic way) on one
TCPStore, then alternates the two op by op (A B A B ...) so drift and noise hit both
alike. Reported:

* per-op latency of ``await comm.all_reduce(t)`` vs ``dist.all_reduce(t,
  async_op=True).wait()``, sizes 8 B to 64 MB, the two alternating op by op:
  the median per-op latency of each, and their ratio asynccoll / torch;
* event-loop lag while 1000 small all_reduces are in flight: a heartbeat task
  asks to wake every 1 ms and records how late it wakes (p50/p99/max), with
  asynccoll's awaitable Works vs the blocking ``work.wait()`` pattern.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

SIZES = [8, 64, 512, 4096, 32768, 262144, 2 << 20, 16 << 20, 64 << 20]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _iters(nbytes: int, quick: bool) -> int:
    base = 2000 if nbytes <= 32768 else max(15, int(2e9 // max(nbytes, 1) // 40))
    return max(5, base // (8 if quick else 1))


async def _latency(comm: Any, dist: Any, quick: bool) -> list[dict[str, Any]]:
    """Per-op samples, the two APIs alternating op by op (drift and noise hit both alike)."""
    import torch

    rows = []
    pc = time.perf_counter
    for nbytes in SIZES:
        t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        n = _iters(nbytes, quick)
        for _ in range(max(2, n // 10)):  # warm-up both paths
            await comm.all_reduce(t)
            dist.all_reduce(t, async_op=True).wait()
        ours, theirs = [], []
        for _ in range(n):
            t0 = pc()
            dist.all_reduce(t, async_op=True).wait()
            t1 = pc()
            await comm.all_reduce(t)
            t2 = pc()
            theirs.append(t1 - t0)
            ours.append(t2 - t1)
        a, b = statistics.median(ours), statistics.median(theirs)
        a10, b10 = _pct(ours, 0.1), _pct(theirs, 0.1)
        rows.append(
            {
                "bytes": nbytes, "iters": n, "asynccoll_us": a * 1e6, "torch_us": b * 1e6, "ratio": a / b,
                # p10: the latency without the machine's noise, closest to the intrinsic cost
                "asynccoll_p10_us": a10 * 1e6, "torch_p10_us": b10 * 1e6, "ratio_p10": a10 / b10,
                "asynccoll_mean_us": statistics.fmean(ours) * 1e6, "torch_mean_us": statistics.fmean(theirs) * 1e6,
            }
        )
    return rows


async def _heartbeat(stop: asyncio.Event, lags: list[float], period: float = 1e-3) -> None:
    clock = time.perf_counter  # (uvloop's loop.time() has 1 ms resolution)
    while not stop.is_set():
        t0 = clock()
        await asyncio.sleep(period)
        lags.append(max(0.0, clock() - t0 - period))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _loop_lag(comm: Any, dist: Any, n_ops: int = 1000) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    # "idle": the heartbeat alone, no collectives: the machine's own scheduling noise
    # (on a small shared VM its p99 alone can be several ms).
    for name in ("idle", "asynccoll", "torch_wait"):
        tensors = [torch.ones(2) for _ in range(n_ops)]  # before the heartbeat: ms of work
        await comm.barrier()
        stop, lags = asyncio.Event(), []
        hb = asyncio.create_task(_heartbeat(stop, lags))
        await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        if name == "idle":
            await asyncio.sleep(0.3)
        elif name == "asynccoll":
            works = []
            for t in tensors:
                works.append(comm.all_reduce(t))
                await asyncio.sleep(0)  # issued as a busy app would: other tasks run in between
            for w in works:  # (gather() would wrap each Work in a Task: ~10 ms of loop time)
                await w
        else:
            works = []
            for t in tensors:
                works.append(dist.all_reduce(t, async_op=True))
                await asyncio.sleep(0)
            for w in works:
                w.wait()  # the blocking pattern: the loop is stuck here
        wall = time.perf_counter() - t0
        await asyncio.sleep(0.005)
        stop.set()
        await hb
        if name != "idle":
            assert all(float(t[0]) == comm.world_size for t in tensors)
        out[name] = {
            "wall_ms": wall * 1e3,
            "ticks": len(lags),
            "lag_p50_ms": _pct(lags, 0.5) * 1e3,
            "lag_p99_ms": _pct(lags, 0.99) * 1e3,
            "lag_max_ms": max(lags, default=0.0) * 1e3,
        }
    return out


async def _rank_main(rank: int, world_size: int, port: int, quick: bool) -> dict[str, Any]:
    import torch.distributed as dist

    import asynccoll as ac

    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("torch/", store), rank=rank, world_size=world_size)
    comm = await ac.init("gloo", rank=rank, world_size=world_size, store=dist.PrefixStore("ac/", store))
    try:
        latency = await _latency(comm, dist, quick)
        lag = await _loop_lag(comm, dist, 300 if quick else 1000)
    finally:
        await comm.close()
        dist.destroy_process_group()
    return {"latency": latency, "loop_lag": lag}


def _rank(rank: int, world_size: int, port: int, quick: bool, loop: str, conn: Any) -> None:
    try:
        if loop == "uvloop":
            import uvloop

            result = uvloop.run(_rank_main(rank, world_size, port, quick))
        else:
            result = asyncio.run(_rank_main(rank, world_size, port, quick))
        conn.send(("ok", result))
    except BaseException as exc:  # report, then exit non-zero
        import traceback

        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from exc


def run(quick: bool = False, loop: str = "asyncio", world_size: int = 2) -> dict[str, Any]:
    """Spawn the ranks, run the benchmark, return rank 0's results."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    pipes, procs = [], []
    for r in range(world_size):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank, args=(r, world_size, port, quick, loop, child), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    results = []
    try:
        for conn in pipes:
            if not conn.poll(1800):
                raise TimeoutError("benchmark rank did not finish in 30 minutes")
            status, payload = conn.recv()
            if status != "ok":
                raise RuntimeError(f"benchmark rank failed:\n{payload}")
            results.append(payload)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return {"loop": loop, "world_size": world_size, **results[0]}


def _table(res: dict[str, Any]) -> str:
    lines = [f"all_reduce latency, world size {res['world_size']}, loop {res['loop']} (median per op, alternating)"]
    lines.append(
        f"{'bytes':>10} {'asynccoll us':>13} {'torch us':>10} {'ratio':>7}   "
        f"{'p10 asynccoll':>13} {'p10 torch':>10} {'ratio':>7}"
    )
    for row in res["latency"]:
        lines.append(
            f"{row['bytes']:>10} {row['asynccoll_us']:>13.1f} {row['torch_us']:>10.1f} {row['ratio']:>7.3f}   "
            f"{row['asynccoll_p10_us']:>13.1f} {row['torch_p10_us']:>10.1f} {row['ratio_p10']:>7.3f}"
        )
    lines.append("")
    lines.append("event-loop lag while small all_reduces are in flight (heartbeat every 1 ms)")
    lines.append(f"{'pattern':>12} {'wall ms':>9} {'ticks':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for name, row in res["loop_lag"].items():
        lines.append(
            f"{name:>12} {row['wall_ms']:>9.1f} {row['ticks']:>6} {row['lag_p50_ms']:>8.3f} "
            f"{row['lag_p99_ms']:>8.3f} {row['lag_max_ms']:>8.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    ap.add_argument("--json", default="bench/results/core.json", help="where to write the results")
    args = ap.parse_args(argv)
    res = run(quick=args.quick, loop=args.loop)
    print(_table(res))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
