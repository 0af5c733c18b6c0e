"""Benchmark ``comm.coalescing()`` on Gloo against separate ops, one flat op, and torch.

Two processes (spawned here, TCPStore rendezvous) run, in the same processes and
interleaved round by round so drift hits every mode alike:

  separate      64 x ``await comm.all_reduce(t)``, one after the other
  pipelined     64 x ``comm.all_reduce(t)`` issued, then all awaited
  coalesced     ``async with comm.coalescing(): 64 x comm.all_reduce(t)``
  flattened     one ``await comm.all_reduce(flat)`` of the same bytes (64*N floats)
  by_hand       coalescing by hand, the floor of ``coalesced``: ``torch.cat`` the 64
                tensors, one ``await comm.all_reduce``, ``torch.split_with_sizes_copy``
                back into them (the copies any coalescing of separate tensors needs)
  torch_cm      torch.distributed (``init_process_group("gloo")``):
                ``with dist._coalescing_manager(): 64 x dist.all_reduce(t)``
  torch_sep     torch.distributed: 64 x ``dist.all_reduce(t)`` (blocking)

Each sample times ``--inner`` iterations of one mode on rank 0; the table shows
per-iteration wall-time medians (and p10/p90) over ``--repeats`` samples, and the
median CPU time of rank 0's process (all its threads) per iteration, which is
less sensitive to other load on the machine. The modes run in a rotating order
(round r starts at mode r mod 7). Ratios coalesced/flattened and coalesced/torch_cm
are given for wall and CPU time. Goals (issue 20): coalesced <= 1.3x flattened,
and <= 0.8x torch's coalescing manager. Progress goes to stderr; JSON and a PNG plot to
bench/results/ (``coalescing_<loop>.json``).

    python bench/coalescing.py [--quick|--smoke] [--ops 64] [--numel 256] [--repeats 40]
                               [--loop asyncio|uvloop] [--json out.json] [--no-plot]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import QUIET_LOAD, machine, progress, quiet, spawn, store_server

MODES = ("separate", "pipelined", "coalesced", "flattened", "by_hand", "torch_cm", "torch_sep")


async def _rank_main(rank: int, ws: int, port: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import asynccoll as ac

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    comm = await ac.init(
        "gloo", rank=rank, world_size=ws, store=dist.PrefixStore("ac/", store), timeout=60
    )
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("torch/", store), rank=rank, world_size=ws
    )

    n, numel = args.ops, args.numel
    tensors = [torch.zeros(numel) for _ in range(n)]
    flat = torch.zeros(n * numel)

    # correctness once: coalesced result equals the sum
    check = [torch.full((numel,), float(rank + 1 + i)) for i in range(n)]
    async with comm.coalescing():
        for t in check:
            comm.all_reduce(t)
    expect = [sum(r + 1 + i for r in range(ws)) for i in range(n)]
    assert all(bool((t == e).all()) for t, e in zip(check, expect)), (
        "coalesced all_reduce gave wrong sums"
    )

    async def separate() -> None:
        for t in tensors:
            await comm.all_reduce(t)

    async def pipelined() -> None:
        works = [comm.all_reduce(t) for t in tensors]
        for w in works:
            await w

    async def coalesced() -> None:
        async with comm.coalescing():
            for t in tensors:
                comm.all_reduce(t)

    async def flattened() -> None:
        await comm.all_reduce(flat)

    sizes = [t.numel() for t in tensors]

    async def by_hand() -> None:
        joined = torch.cat(tensors)
        await comm.all_reduce(joined)
        torch.split_with_sizes_copy(joined, sizes, out=tensors)

    async def torch_cm() -> None:
        with dist._coalescing_manager():
            for t in tensors:
                dist.all_reduce(t)

    async def torch_sep() -> None:
        for t in tensors:
            dist.all_reduce(t)

    fns = {
        m: f
        for m, f in zip(
            MODES, (separate, pipelined, coalesced, flattened, by_hand, torch_cm, torch_sep)
        )
    }
    samples: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    for rnd in range(args.warmup + args.repeats):
        done = rnd + 1 - args.warmup
        if rank == 0 and done >= 1 and (done == 1 or done % 10 == 0 or done == args.repeats):
            progress(f"coalescing round {done}/{args.repeats} (after {args.warmup} warm-up)")
        k = rnd % len(MODES)
        for mode in MODES[k:] + MODES[:k]:
            fn = fns[mode]
            if mode.startswith("torch"):  # start each sample together, on the group it uses
                dist.barrier()
            else:
                await comm.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(args.inner):
                await fn()
            dt = (time.perf_counter() - t0) / args.inner
            dc = (time.process_time() - c0) / args.inner
            if rnd >= args.warmup:
                samples[mode].append(dt)
                cpu[mode].append(dc)
    profile = None
    if args.profile:  # where a coalesced batch's CPU goes (this rank's loop thread)
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        await comm.barrier()
        prof.enable()
        for _ in range(args.profile):
            await coalesced()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        profile = buf.getvalue()
    await comm.close()
    dist.destroy_process_group()
    return {"wall": samples, "cpu": cpu, "profile": profile}


def _rank(rank: int, ws: int, port: int, args: argparse.Namespace) -> dict[str, Any]:
    if args.loop == "uvloop":
        import uvloop

        return uvloop.run(_rank_main(rank, ws, port, args))
    return asyncio.run(_rank_main(rank, ws, port, args))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ops", type=int, default=64)
    p.add_argument("--numel", type=int, default=256)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--inner", type=int, default=5, help="iterations per timed sample")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    p.add_argument(
        "--json",
        dest="json_path",
        default=None,
        help="default bench/results/coalescing_<loop>.json",
    )
    p.add_argument("--quick", action="store_true", help="10 samples x 2 iterations")
    p.add_argument(
        "--smoke", action="store_true", help="2 samples x 1 iteration (does it still run?)"
    )
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--noisy", action="store_true", help="print verdicts even above load 1.5")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also cProfile N coalesced iterations (rank 0's loop thread) into <json>_profile.txt",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.repeats, args.warmup, args.inner = 2, 1, 1
    elif args.quick:
        args.repeats, args.warmup, args.inner = 10, 2, 2

    ws = 2
    before = machine()
    server = store_server()
    results = spawn(_rank, (ws, server.port, args), ws, limit=900.0)
    del server

    samples, cpu = results[0]["wall"], results[0]["cpu"]
    table = {}
    for mode in MODES:
        s = sorted(samples[mode])
        table[mode] = {
            "median_ms": statistics.median(s) * 1e3,
            "p10_ms": s[len(s) // 10] * 1e3,
            "p90_ms": s[(len(s) * 9) // 10] * 1e3,
            "cpu_median_ms": statistics.median(cpu[mode]) * 1e3,
            "samples": len(s),
        }
    med = {m: table[m]["median_ms"] for m in MODES}
    cpu_med = {m: table[m]["cpu_median_ms"] for m in MODES}
    ratios = {
        "coalesced/flattened": med["coalesced"] / med["flattened"],
        "by_hand/flattened": med["by_hand"] / med["flattened"],
        "coalesced/by_hand": med["coalesced"] / med["by_hand"],
        "coalesced/torch_cm": med["coalesced"] / med["torch_cm"],
        "torch_cm/flattened": med["torch_cm"] / med["flattened"],
        "separate/coalesced": med["separate"] / med["coalesced"],
        "cpu coalesced/flattened": cpu_med["coalesced"] / cpu_med["flattened"],
        "cpu coalesced/torch_cm": cpu_med["coalesced"] / cpu_med["torch_cm"],
    }
    goals = {  # issue 20
        "coalesced <= 1.3x flattened": ratios["coalesced/flattened"] <= 1.3,
        "coalesced <= 0.8x torch_cm": ratios["coalesced/torch_cm"] <= 0.8,
    }
    print(
        f"Gloo, world size {ws}, {args.ops} x all_reduce of {args.numel} float32, loop={args.loop}, "
        f"{args.repeats} samples x {args.inner} iterations (rank 0, per iteration)"
    )
    print(f"{'mode':<12}{'median ms':>12}{'p10 ms':>10}{'p90 ms':>10}{'cpu ms':>10}")
    for mode in MODES:
        row = table[mode]
        print(
            f"{mode:<12}{row['median_ms']:>12.3f}{row['p10_ms']:>10.3f}{row['p90_ms']:>10.3f}"
            f"{row['cpu_median_ms']:>10.3f}"
        )
    for k, v in ratios.items():
        print(f"{k:<24}{v:>8.2f}x")
    # The load before is the machine's own; after, it counts this bench's own ranks (as bench.perf judges).
    loaded = not quiet(before)
    for k, ok in goals.items():
        if loaded and not args.noisy:
            print(
                f"goal {k}: no verdict (load {before['loadavg'][0]:.2f} > {QUIET_LOAD}; --noisy to judge anyway)"
            )
        else:
            print(
                f"goal {k}: {'met' if ok else 'NOT met'}{' (noisy: load > 1.5)' if loaded else ''}"
            )
    path = Path(args.json_path or f"bench/results/coalescing_{args.loop}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "config": {
            "world_size": ws,
            "ops": args.ops,
            "numel": args.numel,
            "dtype": "float32",
            "repeats": args.repeats,
            "inner": args.inner,
            "loop": args.loop,
            "cpus": os.cpu_count(),
        },
        "results": table,
        "ratios": ratios,
        "goals": goals,
        "machine": before,
        "machine_after": machine(),
    }
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    if results[0]["profile"]:
        prof_path = path.with_name(path.stem + "_profile.txt")
        prof_path.write_text(results[0]["profile"])
        print(f"wrote {prof_path}")
    if not args.no_plot:
        from bench.plot import plot_coalescing

        for png in plot_coalescing(result, path.with_suffix("")):
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
