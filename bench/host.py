"""Pure host cost: back-to-back small all_reduces at world size 1 (no network).

    python -m bench.host [--ops 2000] [--rounds 15] [--loop asyncio|uvloop] [--json PATH]

One process, one Gloo group of one rank (``init_process_group`` on a HashStore);
asynccoll wraps that group's Gloo backend (``ac.wrap``), so every mode runs the same
transport and only the Python path differs. Modes, alternating round by round in
a shuffled order, ``--ops`` all_reduces of 8 floats each:

  asynccoll       ``works = [comm.all_reduce(t) ...]``, then ``await`` each
  torch           ``works = [dist.all_reduce(t, async_op=True) ...]``, then ``wait()`` each
  floor           the floor bridge (``_common.FloorBridge``: one waiter thread, one
                  ``call_soon_threadsafe`` per op): issue all, then await each
  asynccoll_seq   ``await comm.all_reduce(t)``, one op at a time
  torch_seq       ``dist.all_reduce(t, async_op=True).wait()``, one op at a time
  floor_seq       ``await floor.all_reduce(t)``, one op at a time

Reported per op: median and p10 over rounds of (round wall time / ops), the issue
part alone (the list comprehension), and the process CPU time. The goal (issue
20): asynccoll <= 1.5 x torch per op, issued back to back.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from bench._common import FloorBridge, machine, median, orders, pct, run_loop, write_json

MODES = ("asynccoll", "torch", "floor", "asynccoll_seq", "torch_seq", "floor_seq")


def measure(ops: int, rounds: int, loop: str) -> dict[str, Any]:
    """Run every mode ``rounds`` times in this process; per-op figures in microseconds."""

    async def main() -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        import asynccoll as ac

        torch.set_num_threads(1)
        store = dist.HashStore()
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("torch/", store), rank=0, world_size=1
        )
        comm = ac.wrap(dist.group.WORLD._get_backend(torch.device("cpu")), timeout=60.0)
        floor = FloorBridge(loop)
        ts = [torch.zeros(8) for _ in range(ops)]
        walls: dict[str, list[float]] = {m: [] for m in MODES}
        issues: dict[str, list[float]] = {m: [] for m in MODES}
        cpus: dict[str, list[float]] = {m: [] for m in MODES}
        pc, cpu = time.perf_counter, time.process_time

        async def run(mode: str) -> tuple[float, float, float]:
            c0, t0 = cpu(), pc()
            if mode == "asynccoll":
                works: list[Any] = [comm.all_reduce(t) for t in ts]
                t1 = pc()
                for w in works:
                    await w
            elif mode == "torch":
                works = [dist.all_reduce(t, async_op=True) for t in ts]
                t1 = pc()
                for w in works:
                    w.wait()
            elif mode == "floor":
                works = [floor.all_reduce(t) for t in ts]
                t1 = pc()
                for w in works:
                    await w
            elif mode == "asynccoll_seq":
                for t in ts:
                    await comm.all_reduce(t)
                t1 = pc()
            elif mode == "torch_seq":
                for t in ts:
                    dist.all_reduce(t, async_op=True).wait()
                t1 = pc()
            else:
                for t in ts:
                    await floor.all_reduce(t)
                t1 = pc()
            t2 = pc()
            return (t2 - t0) / ops, (t1 - t0) / ops, (cpu() - c0) / ops

        try:
            for m in MODES:  # warm-up
                await run(m)
            for order in orders(MODES, rounds, seed=11):
                for m in order:
                    wall, issue, c = await run(m)
                    walls[m].append(wall)
                    issues[m].append(issue)
                    cpus[m].append(c)
        finally:
            floor.close()
            await comm.close()
            dist.destroy_process_group()
        out: dict[str, Any] = {}
        for m in MODES:
            out[m] = {
                "us_per_op": median(walls[m]) * 1e6,
                "p10_us_per_op": pct(walls[m], 0.1) * 1e6,
                "issue_us_per_op": median(issues[m]) * 1e6,
                "cpu_us_per_op": median(cpus[m]) * 1e6,
            }
        for m, ref in (
            ("asynccoll", "torch"),
            ("floor", "torch"),
            ("asynccoll_seq", "torch_seq"),
            ("floor_seq", "torch_seq"),
            ("asynccoll", "floor"),
        ):
            out[f"{m}/{ref}"] = out[m]["us_per_op"] / out[ref]["us_per_op"]
            out[f"{m}/{ref}_p10"] = out[m]["p10_us_per_op"] / out[ref]["p10_us_per_op"]
        return out

    before = machine()
    res = run_loop(loop, main)
    return {
        "ops": ops,
        "rounds": rounds,
        "loop": loop,
        "machine": before,
        "machine_after": machine(),
        **res,
    }


def table(res: dict[str, Any]) -> str:
    lines = [
        f"world size 1, {res['ops']} x all_reduce(8 floats), {res['rounds']} rounds, loop {res['loop']}, "
        f"load {res['machine']['loadavg'][0]:.2f}"
    ]
    lines.append(f"  {'mode':<14} {'us/op':>8} {'p10':>8} {'issue':>8} {'cpu':>8}")
    for m in MODES:
        r = res[m]
        lines.append(
            f"  {m:<14} {r['us_per_op']:>8.1f} {r['p10_us_per_op']:>8.1f} {r['issue_us_per_op']:>8.1f} "
            f"{r['cpu_us_per_op']:>8.1f}"
        )
    for key in ("asynccoll/torch", "floor/torch", "asynccoll_seq/torch_seq", "floor_seq/torch_seq"):
        lines.append(f"  {key:<24} {res[key]:.3f} (p10 {res[key + '_p10']:.3f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    ap.add_argument("--json", default="bench/results/host.json")
    args = ap.parse_args(argv)
    res = measure(args.ops, args.rounds, args.loop)
    print(table(res))
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
