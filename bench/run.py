"""Core benchmark: asynccoll vs the floor bridge vs torch.distributed, Gloo, one run.

    python -m bench [--loop asyncio|uvloop|trio] [--quick] [--json PATH] [--no-plot]

Two ranks are spawned on this machine. Each builds an asynccoll communicator and a
torch.distributed Gloo group (``init_process_group``) on one TCPStore, and a *floor*
bridge (``bench/_common.py``: one waiter thread calling ``work.wait()`` then
``loop.call_soon_threadsafe(fut.set_result, None)``) over the torch group. The
three are measured side by side in the same processes, alternating op by op in a
shuffled order (the same on both ranks) so drift and noise hit all alike:

1. latency of one all_reduce (8 B .. 32 KB, and a few sizes up to 16 MB):
   ``await comm.all_reduce(t)`` | ``await floor(dist.all_reduce(t, group=g, async_op=True))``
   | ``dist.all_reduce(t, async_op=True).wait()``; median and p10 per op; ratios
   asynccoll/floor, floor/torch, asynccoll/torch;
2. pipelined throughput: 1000 small all_reduces issued back to back, then all
   awaited (torch: issue all, then ``wait()`` each); median over rounds;
3. event-loop lag p99 while 1000 small all_reduces are in flight: a 1 ms
   heartbeat task (perf_counter), with an idle baseline in the same run.

By default (``--groups shared``) the three run on ONE Gloo group: asynccoll wraps the
default group's Gloo backend (``ac.wrap``; the same backend code as ``ac.init``), so
only the Python path differs. Measured here, separate groups differ by more than the
Python path (each group's threads and sockets are in their own state: per-size
medians swung 0.7-3x between groups on this loaded machine); ``--groups own`` runs
asynccoll from ``ac.init`` with the floor on a ``new_group()`` for comparison.

Progress goes to stderr; the tables to stdout; JSON and PNG plots to bench/results/.
On trio, if asynccoll cannot be awaited yet, its column says so and the rest runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench._common import (
    FloorBridge,
    Runtime,
    machine,
    median,
    orders,
    pct,
    progress,
    run_loop,
    spawn,
    store_server,
)

SMALL = [8, 64, 512, 4096, 32768]
LARGE = [262144, 2 << 20, 16 << 20]
MODES = ("asynccoll", "floor", "torch")
SKIP_TRIO = "skipped: asynccoll does not support trio yet"


PARTS = ("latency", "throughput", "loop_lag")


class Config:
    """What to run; ``quick`` and ``smoke`` shrink everything. ``sizes``, ``parts``
    (a subset of ``PARTS``) and the counts can be set for a focused run (``bench.perf``)."""

    def __init__(
        self,
        quick: bool = False,
        smoke: bool = False,
        groups: str = "shared",
        *,
        sizes: list[int] | None = None,
        parts: tuple[str, ...] = PARTS,
        small_iters: int | None = None,
        tput_rounds: int | None = None,
    ) -> None:
        self.quick, self.smoke = quick or smoke, smoke
        self.groups = groups
        self.parts = parts
        self.small_iters = small_iters or (40 if smoke else (400 if quick else 2000))
        self.passes = 1 if smoke else (2 if quick else 4)
        self.sizes = sizes or ([8, 4096] if smoke else SMALL + ([LARGE[0]] if quick else LARGE))
        self.tput_ops = 100 if smoke else (300 if quick else 1000)
        self.tput_rounds = tput_rounds or (1 if smoke else (3 if quick else 9))
        self.lag_ops = 100 if smoke else (300 if quick else 1000)
        self.lag_rounds = 1 if smoke else (2 if quick else 3)

    def iters(self, nbytes: int) -> int:
        if nbytes <= 32768:
            return self.small_iters
        if self.smoke:
            return 3
        base = max(24, int(1.5e8 // nbytes))  # ~150 MB moved per mode
        return max(6, base // (4 if self.quick else 1))

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items()}


class Ctx:
    """One rank's handles: asynccoll (None where unusable), torch, the floor bridge."""

    def __init__(self, rank: int, comm: Any, dist: Any, floor: FloorBridge, rt: Runtime) -> None:
        self.rank, self.comm, self.dist, self.floor, self.rt = rank, comm, dist, floor, rt
        self.modes = MODES if comm is not None else ("floor", "torch")

    def op(self, mode: str) -> Callable[[Any], Any]:
        dist, comm, floor = self.dist, self.comm, self.floor

        async def asynccoll(t: Any) -> None:
            await comm.all_reduce(t)

        async def floor_op(t: Any) -> None:
            await floor.all_reduce(t)

        async def torch_op(t: Any) -> None:
            dist.all_reduce(t, async_op=True).wait()

        return {"asynccoll": asynccoll, "floor": floor_op, "torch": torch_op}[mode]

    def say(self, msg: str) -> None:
        if self.rank == 0:
            progress(msg)


def _rotations(modes: tuple[str, ...], i: int) -> tuple[str, ...]:
    k = i % len(modes)
    return modes[k:] + modes[:k]


async def latency(ctx: Ctx, cfg: Config) -> list[dict[str, Any]]:
    """Per-op latency, the modes alternating op by op in a shuffled order.

    The sweep runs in ``cfg.passes`` passes over all sizes, so a burst of load from
    elsewhere on the machine lands on a slice of every size rather than on a whole
    size; the spread of the per-pass ac/floor ratio is reported alongside.
    """
    import torch

    pc = time.perf_counter
    ops = {m: ctx.op(m) for m in ctx.modes}
    tensors = {
        nbytes: torch.zeros(max(1, nbytes // 4), dtype=torch.float32) for nbytes in cfg.sizes
    }
    samples: dict[int, dict[str, list[float]]] = {
        nb: {m: [] for m in ctx.modes} for nb in cfg.sizes
    }
    per_pass: dict[int, list[float]] = {nb: [] for nb in cfg.sizes}
    for p in range(cfg.passes):
        for nbytes in cfg.sizes:
            t = tensors[nbytes]
            n = max(1, cfg.iters(nbytes) // cfg.passes)
            ctx.dist.barrier()
            for i in range(max(3, n // 10)):  # warm-up every path
                for m in _rotations(ctx.modes, i):
                    await ops[m](t)
            got: dict[str, list[float]] = {m: [] for m in ctx.modes}
            for order in orders(ctx.modes, n, seed=nbytes * 31 + p):
                for m in order:
                    fn = ops[m]
                    t0 = pc()
                    await fn(t)
                    got[m].append(pc() - t0)
            for m in ctx.modes:
                samples[nbytes][m].extend(got[m])
            if "asynccoll" in got:
                per_pass[nbytes].append(median(got["asynccoll"]) / median(got["floor"]))
            ctx.say(
                f"latency pass {p + 1}/{cfg.passes} {nbytes:>9} B x{n}: "
                + ", ".join(f"{m} {median(got[m]) * 1e6:.1f} us" for m in ctx.modes)
            )
    rows = []
    for nbytes in cfg.sizes:
        row: dict[str, Any] = {"bytes": nbytes, "iters": len(samples[nbytes]["floor"])}
        for m in MODES:
            s = samples[nbytes].get(m)
            row[f"{m}_us"] = median(s) * 1e6 if s else None
            row[f"{m}_p10_us"] = pct(s, 0.1) * 1e6 if s else None
        _ratios(row)
        row["ac/floor_per_pass"] = per_pass[nbytes]
        rows.append(row)
        ctx.say(f"latency {nbytes:>9} B x{row['iters']}: " + _row_text(row))
    return rows


def _ratios(row: dict[str, Any]) -> None:
    for suffix in ("", "_p10"):
        a, f, t = (row[f"{m}{suffix}_us"] for m in MODES)
        row[f"ac/floor{suffix}"] = a / f if a and f else None
        row[f"floor/torch{suffix}"] = f / t if f and t else None
        row[f"ac/torch{suffix}"] = a / t if a and t else None


def _row_text(row: dict[str, Any]) -> str:
    a, f, t = (row[f"{m}_us"] for m in MODES)
    ac = f"asynccoll {a:.1f} us" if a else "asynccoll -"
    ratio = f", ac/floor {row['ac/floor']:.3f}, ac/torch {row['ac/torch']:.3f}" if a else ""
    return f"{ac}, floor {f:.1f} us, torch {t:.1f} us{ratio}"


async def throughput(ctx: Ctx, cfg: Config) -> dict[str, Any]:
    """``n`` small all_reduces issued back to back, then awaited together."""
    import torch

    n = cfg.tput_ops
    tensors = [torch.zeros(2) for _ in range(n)]
    dist, comm, floor = ctx.dist, ctx.comm, ctx.floor
    pc = time.perf_counter

    async def asynccoll() -> None:
        works = [comm.all_reduce(t) for t in tensors]
        for w in works:
            await w

    async def floor_op() -> None:
        futs = [floor.all_reduce(t) for t in tensors]
        for f in futs:
            await f

    async def torch_op() -> None:
        works = [dist.all_reduce(t, async_op=True) for t in tensors]
        for w in works:
            w.wait()

    fns = {"asynccoll": asynccoll, "floor": floor_op, "torch": torch_op}
    samples: dict[str, list[float]] = {m: [] for m in ctx.modes}
    for r in range(cfg.tput_rounds + 1):  # round 0: warm-up
        for m in _rotations(ctx.modes, r):
            dist.barrier()
            t0 = pc()
            await fns[m]()
            if r:
                samples[m].append(pc() - t0)
    out: dict[str, Any] = {"ops": n, "rounds": cfg.tput_rounds}
    for m in MODES:
        s = samples.get(m)
        out[m] = (
            {"median_ms": median(s) * 1e3, "min_ms": min(s) * 1e3, "ops_per_s": n / median(s)}
            if s
            else None
        )
    if out["asynccoll"]:
        out["ac_vs_torch"] = out["asynccoll"]["ops_per_s"] / out["torch"]["ops_per_s"]
        out["ac_vs_floor"] = out["asynccoll"]["ops_per_s"] / out["floor"]["ops_per_s"]
    out["floor_vs_torch"] = out["floor"]["ops_per_s"] / out["torch"]["ops_per_s"]
    ctx.say(
        "throughput "
        + ", ".join(f"{m} {out[m]['median_ms']:.1f} ms" for m in ctx.modes)
        + f" per {n} ops"
    )
    return out


async def loop_lag(ctx: Ctx, cfg: Config) -> dict[str, Any]:
    """Heartbeat lag while ``n`` small all_reduces are in flight (issued one per loop turn,
    as a busy app would), against an idle baseline measured in the same run."""
    import torch

    n = cfg.lag_ops
    dist, comm, floor, rt = ctx.dist, ctx.comm, ctx.floor, ctx.rt
    modes = ("idle", *(["asynccoll"] if comm is not None else []), "floor", "torch_wait")
    lags: dict[str, list[float]] = {m: [] for m in modes}
    p99s: dict[str, list[float]] = {m: [] for m in modes}
    walls: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(cfg.lag_rounds):
        for mode in _rotations(modes, r):
            tensors = [torch.ones(2) for _ in range(n)]  # before the heartbeat starts

            async def body(mode: str = mode, tensors: list[Any] = tensors) -> None:
                if mode == "idle":
                    await rt.sleep(0.3 if not cfg.smoke else 0.05)
                    return
                works = []
                for t in tensors:
                    if mode == "asynccoll":
                        works.append(comm.all_reduce(t))
                    elif mode == "floor":
                        works.append(floor.all_reduce(t))
                    else:
                        works.append(dist.all_reduce(t, async_op=True))
                    await rt.sleep(0)
                for w in works:
                    if mode == "torch_wait":
                        w.wait()  # the blocking pattern: the loop is stuck here
                    else:
                        await w

            dist.barrier()
            wall, lag = await rt.with_heartbeat(body)
            if mode != "idle":
                assert all(float(t[0]) == 2.0 for t in tensors), f"{mode}: wrong sums"
            lags[mode].extend(lag)
            p99s[mode].append(pct(lag, 0.99))
            walls[mode].append(wall)
    out: dict[str, Any] = {"ops": n, "rounds": cfg.lag_rounds}
    for m in modes:
        out[m] = {
            "wall_ms": median(walls[m]) * 1e3,
            "ticks": len(lags[m]),
            "lag_p50_ms": pct(lags[m], 0.5) * 1e3,
            "lag_p99_ms": pct(lags[m], 0.99) * 1e3,
            "lag_p99_round_median_ms": median(p99s[m]) * 1e3,
            "lag_max_ms": max(lags[m], default=0.0) * 1e3,
        }
        ctx.say(
            f"loop lag {m:>10}: p99 {out[m]['lag_p99_ms']:.3f} ms, max {out[m]['lag_max_ms']:.3f} ms"
        )
    if comm is None:
        out["asynccoll"] = None
    return out


async def _asynccoll_usable(comm: Any, loop: str) -> bool:
    """Whether a Work can be awaited on this loop (trio support is being added)."""
    import torch

    t = torch.zeros(2)
    work = comm.all_reduce(t)
    try:
        await work
        return True
    except Exception as exc:  # noqa: BLE001 - any failure to await means: not supported here
        work.wait(60)  # the op was issued on every rank; let it finish
        progress(f"asynccoll under {loop}: {type(exc).__name__}: {exc}")
        return False


async def _init(ac: Any, rank: int, world_size: int, store: Any, loop: str) -> Any:
    """``ac.init`` on this loop; on trio, if that is not supported yet (it fails at once,
    alike on every rank), on a private asyncio loop in a helper thread."""
    try:
        return await ac.init("gloo", rank=rank, world_size=world_size, store=store)
    except RuntimeError as exc:
        if loop != "trio":
            raise
        progress(f"ac.init under trio: {exc}; initialising on an asyncio loop in a thread")
    import asyncio
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:

        async def build() -> Any:
            return await ac.init("gloo", rank=rank, world_size=world_size, store=store)

        init = pool.submit(asyncio.run, build())
        while not init.done():
            await Runtime(loop).sleep(0.01)
        return init.result()


def _rank(rank: int, world_size: int, port: int, cfg: Config, loop: str) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        import asynccoll as ac

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("torch/", store), rank=rank, world_size=world_size
        )
        rt = Runtime(loop)
        if cfg.groups == "shared":  # one Gloo group under all three modes
            comm = ac.wrap(dist.group.WORLD._get_backend(torch.device("cpu")), timeout=60.0)
            floor_group = None
        else:  # a Gloo group of its own for each mode
            comm = await _init(ac, rank, world_size, dist.PrefixStore("ac/", store), loop)
            floor_group = dist.new_group(backend="gloo")
        usable = await _asynccoll_usable(comm, loop)
        floor = FloorBridge(loop, floor_group)
        ctx = Ctx(rank, comm if usable else None, dist, floor, rt)
        res: dict[str, Any] = {"asynccoll_supported": usable}
        try:
            ctx.say(f"ranks up ({loop}); {', '.join(cfg.parts)}: modes {', '.join(ctx.modes)}")
            if "latency" in cfg.parts:
                res["latency"] = await latency(ctx, cfg)
            if "throughput" in cfg.parts:
                res["throughput"] = await throughput(ctx, cfg)
            if "loop_lag" in cfg.parts:
                res["loop_lag"] = await loop_lag(ctx, cfg)
        finally:
            floor.close()
            dist.barrier()
            try:
                await comm.close()
            except RuntimeError:  # a loop asynccoll does not support yet: abort is loop-free
                comm.abort("benchmark done (this loop cannot await asynccoll)")
            dist.destroy_process_group()
        return res

    return run_loop(loop, main)


def run(cfg: Config, loop: str = "asyncio", world_size: int = 2) -> dict[str, Any]:
    """Spawn the ranks, run the benchmark, return rank 0's results."""
    before = machine()
    server = store_server()
    results = spawn(_rank, (world_size, server.port, cfg, loop), world_size)
    del server
    return {
        "loop": loop,
        "world_size": world_size,
        "cpus": os.cpu_count(),
        "machine": before,
        "machine_after": machine(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": cfg.as_dict(),
        **results[0],
    }


def _f(x: float | None, fmt: str = ".1f") -> str:
    return format(x, fmt) if x is not None else "-"


def tables(res: dict[str, Any]) -> str:
    """The results as text tables."""
    head = (
        f"all_reduce latency, Gloo, world size {res['world_size']}, loop {res['loop']}, "
        f"groups {res['config']['groups']}, "
        f"{res['cpus']} CPUs (rank 0, per op, modes alternating op by op)"
    )
    out = [head]
    if not res.get("asynccoll_supported", True):
        out.append(f"asynccoll column: {SKIP_TRIO}")
    for suffix, title in (("", "median"), ("_p10", "p10")):
        out.append(f"\n{title}:")
        spread = " ac/floor per pass (min-max)" if not suffix else ""
        out.append(
            f"{'bytes':>9} {'asynccoll us':>12} {'floor us':>9} {'torch us':>9} "
            f"{'ac/floor':>9} {'floor/torch':>11} {'ac/torch':>9}{spread}"
        )
        for row in res.get("latency", []):
            a, f, t = (row[f"{m}{suffix}_us"] for m in MODES)
            passes = row.get("ac/floor_per_pass") or []
            extra = f"   {min(passes):.3f}-{max(passes):.3f}" if passes and not suffix else ""
            out.append(
                f"{row['bytes']:>9} {_f(a):>12} {_f(f):>9} {_f(t):>9} {_f(row['ac/floor' + suffix], '.3f'):>9} "
                f"{_f(row['floor/torch' + suffix], '.3f'):>11} {_f(row['ac/torch' + suffix], '.3f'):>9}{extra}"
            )
    if "throughput" not in res or "loop_lag" not in res:
        return "\n".join(out)
    tp = res["throughput"]
    out.append(
        f"\npipelined: {tp['ops']} x all_reduce(8 B) issued back to back, then awaited "
        f"(median of {tp['rounds']} rounds)"
    )
    out.append(f"{'mode':>10} {'ms':>9} {'ops/s':>9}")
    for m in MODES:
        if tp[m] is None:
            out.append(f"{m:>10} {SKIP_TRIO}")
            continue
        out.append(f"{m:>10} {tp[m]['median_ms']:>9.1f} {tp[m]['ops_per_s']:>9.0f}")
    if tp.get("ac_vs_torch") is not None:
        out.append(
            f"throughput asynccoll/torch {tp['ac_vs_torch']:.3f}x, asynccoll/floor {tp['ac_vs_floor']:.3f}x, "
            f"floor/torch {tp['floor_vs_torch']:.3f}x (higher is better)"
        )
    lag = res["loop_lag"]
    out.append(
        f"\nevent-loop lag, {lag['ops']} x all_reduce(8 B) in flight, 1 ms heartbeat, "
        f"{lag['rounds']} round(s) pooled"
    )
    out.append(
        f"{'pattern':>10} {'wall ms':>9} {'ticks':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}"
    )
    for name in ("idle", "asynccoll", "floor", "torch_wait"):
        row = lag.get(name)
        if row is None:
            out.append(f"{name:>10} {SKIP_TRIO}")
            continue
        out.append(
            f"{name:>10} {row['wall_ms']:>9.1f} {row['ticks']:>6} {row['lag_p50_ms']:>8.3f} "
            f"{row['lag_p99_ms']:>8.3f} {row['lag_max_ms']:>8.3f}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a quick look)")
    ap.add_argument(
        "--smoke", action="store_true", help="a few iterations only (does it still run?)"
    )
    ap.add_argument("--loop", choices=("asyncio", "uvloop", "trio"), default="asyncio")
    ap.add_argument(
        "--groups",
        choices=("shared", "own"),
        default="shared",
        help="shared: the three modes run on ONE Gloo group (asynccoll through ac.wrap() of the default "
        "group's Gloo backend), so only the Python path differs; own: asynccoll from ac.init(), the floor "
        "on a new_group(), torch on the default group (per-group transport state then differs too)",
    )
    ap.add_argument(
        "--json", default=None, help="results file (default bench/results/core_<loop>.json)"
    )
    ap.add_argument("--no-plot", action="store_true", help="do not draw the PNG plots")
    args = ap.parse_args(argv)
    if args.loop == "trio":
        try:
            import trio  # noqa: F401
        except ImportError:
            print("--loop trio: trio is not installed", file=sys.stderr)
            return 2
    res = run(Config(quick=args.quick, smoke=args.smoke, groups=args.groups), loop=args.loop)
    print(tables(res))
    suffix = "" if args.groups == "shared" else "_own"
    path = Path(args.json or f"bench/results/core_{args.loop}{suffix}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {path}")
    if not args.no_plot:
        from bench.plot import plot_core

        for png in plot_core(res, path.with_suffix("")):
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
