"""GPU benchmark of asynccoll's NCCL backend at world size 1 (one GPU, one process).

    python -m bench.gpu [--json out.json] [--iters 1000] [--size 8]
    python -m bench.gpu --sim [--iters 2000]     (no GPU: host cost on the simulated GPU, bench/gpu_sim.py)

The GPU run (``make gpu-test``, ``tools/gpu_run.py``) runs the GPU tests, then this.

Measures, against torch.distributed's own NCCL group (``all_reduce(async_op=True)``):

* issue cost: host time of one ``comm.all_reduce(t)`` call (wall and calling-thread
  CPU), and process CPU per op including asynccoll's launcher/watcher threads;
* notification latency: GPU completion of the op -> the awaiting coroutine resumed,
  under asyncio and uvloop. Measured on the GPU clock: a timing event recorded on a
  probe stream that waits for the op (``work.wait_stream``), and a second timing event
  recorded on an idle stream right after the coroutine resumes;
* throughput of ``--iters`` back-to-back small all_reduces, completion awaited.

Without CUDA or nccl4py it prints ``skipped: ...`` and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _ns_per(fn: Callable[[], Any], n: int) -> tuple[float, float]:
    """(wall ns, calling-thread CPU ns) per call of ``fn``."""
    w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - w0) / n, (time.thread_time_ns() - c0) / n


# ----------------------------------------------------------------------- asynccoll
async def measure_asynccoll(iters: int, size: int, loop_name: str) -> dict[str, Any]:
    """asynccoll's NCCL backend at world size 1 under the running loop (``loop_name`` labels it)."""
    import torch.distributed as dist

    import asynccoll as ac

    dev = torch.device("cuda", torch.cuda.current_device())
    comm = await ac.init(backend="nccl", rank=0, world_size=1, store=dist.HashStore(), device=dev)
    res: dict[str, Any] = {"loop": loop_name}
    try:
        t = torch.ones(size, device=dev)
        for _ in range(50):  # warm-up: connections, event pool, allocator
            await comm.all_reduce(t)
        torch.cuda.synchronize()

        # issue cost
        works: list[Any] = []
        p0 = time.process_time_ns()
        wall, cpu = _ns_per(lambda: works.append(comm.all_reduce(t)), iters)
        await asyncio.gather(*works)
        res["issue_wall_us"] = wall / 1e3
        res["issue_thread_cpu_us"] = cpu / 1e3
        res["process_cpu_per_op_us"] = (time.process_time_ns() - p0) / iters / 1e3

        # throughput: back-to-back, completion awaited
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        last = None
        for _ in range(iters):
            last = comm.all_reduce(t)
        await last
        dt = time.perf_counter() - t0
        res["throughput_ops_s"] = iters / dt

        # notification latency (GPU clock)
        probe, idle = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
        cycles = int(_cycles_per_us() * 200)  # the op finishes ~200 us after we start awaiting
        lats = []
        for _ in range(min(iters, 300)):
            torch.cuda._sleep(cycles)
            w = comm.all_reduce(t)
            w.wait_stream(probe)
            e_done = torch.cuda.Event(enable_timing=True)
            e_done.record(probe)
            await w
            e_now = torch.cuda.Event(enable_timing=True)
            e_now.record(idle)
            e_now.synchronize()
            lats.append(e_done.elapsed_time(e_now) * 1e3)  # ms -> us
        res["notify_us_p50"] = statistics.median(lats)
        res["notify_us_p90"] = sorted(lats)[int(0.9 * len(lats))]

        # round trip of one small op, awaited
        rts = []
        for _ in range(min(iters, 300)):
            t0 = time.perf_counter()
            await comm.all_reduce(t)
            rts.append((time.perf_counter() - t0) * 1e6)
        res["roundtrip_us_p50"] = statistics.median(rts)
    finally:
        await comm.close()
    return res


_CYCLES: float | None = None


def _cycles_per_us() -> float:
    """GPU clock cycles per microsecond for ``torch.cuda._sleep`` (measured once)."""
    global _CYCLES
    if _CYCLES is None:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        a.record()
        torch.cuda._sleep(10_000_000)
        b.record()
        b.synchronize()
        _CYCLES = 10_000_000 / (a.elapsed_time(b) * 1e3)
    return _CYCLES


# ------------------------------------------------------------------ torch baseline
def measure_torch(iters: int, size: int) -> dict[str, Any]:
    """torch's own ProcessGroupNCCL at world size 1, the same measures (its ``async_op`` works)."""
    import torch.distributed as dist

    dev = torch.device("cuda", torch.cuda.current_device())
    res: dict[str, Any] = {"loop": "torch (blocking wait)"}
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev)
        try:
            t = torch.ones(size, device=dev)
            for _ in range(50):
                dist.all_reduce(t, async_op=True).wait()
            torch.cuda.synchronize()

            works: list[Any] = []
            p0 = time.process_time_ns()
            wall, cpu = _ns_per(lambda: works.append(dist.all_reduce(t, async_op=True)), iters)
            works[-1].wait()
            torch.cuda.synchronize()
            res["issue_wall_us"] = wall / 1e3
            res["issue_thread_cpu_us"] = cpu / 1e3
            res["process_cpu_per_op_us"] = (time.process_time_ns() - p0) / iters / 1e3

            t0 = time.perf_counter()
            last = None
            for _ in range(iters):
                last = dist.all_reduce(t, async_op=True)
            last.wait()
            torch.cuda.current_stream(dev).synchronize()
            res["throughput_ops_s"] = iters / (time.perf_counter() - t0)

            rts = []
            for _ in range(min(iters, 300)):
                t0 = time.perf_counter()
                dist.all_reduce(t, async_op=True).wait()
                torch.cuda.current_stream(dev).synchronize()
                rts.append((time.perf_counter() - t0) * 1e6)
            res["roundtrip_us_p50"] = statistics.median(rts)
        finally:
            dist.destroy_process_group()
    return res


# --------------------------------------------------------------------------- main
_COLUMNS = [
    ("issue_wall_us", "issue wall us"),
    ("issue_thread_cpu_us", "issue thread-CPU us"),
    ("process_cpu_per_op_us", "process CPU/op us"),
    ("notify_us_p50", "notify p50 us"),
    ("notify_us_p90", "notify p90 us"),
    ("roundtrip_us_p50", "round trip p50 us"),
    ("throughput_ops_s", "ops/s"),
]


def _table(rows: list[dict[str, Any]]) -> str:
    head = ["runner"] + [c[1] for c in _COLUMNS]
    lines = [head]
    for r in rows:
        cells = [str(r.get("loop", "?"))]
        for key, _ in _COLUMNS:
            v = r.get(key)
            cells.append(
                "-" if v is None else (f"{v:,.0f}" if key == "throughput_ops_s" else f"{v:.2f}")
            )
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--size", type=int, default=8, help="elements per all_reduce (float32)")
    ap.add_argument(
        "--sim", action="store_true", help="the host cost on the simulated GPU (no GPU needed)"
    )
    ap.add_argument(
        "--out", help="--sim: the directory for gpu_sim.json/.png (default bench/results)"
    )
    args = ap.parse_args(argv)
    if args.sim:
        from bench import gpu_sim

        return gpu_sim.main(n=args.iters if args.iters != 1000 else 2000, out_dir=args.out)

    from asynccoll._backends import nccl

    reason = nccl.missing()
    if reason is not None:
        kind = "no CUDA" if not torch.cuda.is_available() else "no nccl4py"
        print(f"skipped: {kind} ({reason})")
        return 0

    rows = [asyncio.run(measure_asynccoll(args.iters, args.size, "asynccoll asyncio"))]
    try:
        import uvloop
    except ImportError:
        print("uvloop not installed: skipping the uvloop run", file=sys.stderr)
    else:
        rows.append(uvloop.run(measure_asynccoll(args.iters, args.size, "asynccoll uvloop")))
    rows.append(measure_torch(args.iters, args.size))

    print(
        f"world size 1, {torch.cuda.get_device_name()}, all_reduce of {args.size} float32, {args.iters} ops"
    )
    print(_table(rows))
    if args.json:
        meta = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "iters": args.iters,
            "size": args.size,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
