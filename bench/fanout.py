"""Abort fan-out: ``comm.abort()`` -> the last of N awaiting tasks has its ``CommAborted``.

    python -m bench.fanout [--waiters 1000] [--reps 9] [--loop asyncio|uvloop] [--json PATH]

Two Gloo ranks. Rank 0 issues ``--waiters`` all_reduces that rank 1 never joins,
one task awaits each, then ``comm.abort()`` is called on the loop; measured: from
the call to the last task's ``except CommAborted`` (and the call alone). Rank 1
only waits for the round to end. The floor, in the same process between the
rounds: the same number of tasks awaiting plain asyncio futures, failed in one
loop of ``fut.set_exception(CommAborted(...))`` (a fresh exception per future, as
each Work needs its own): what any awaitable abort must at least cost on this loop.
Both timed windows are ``_common.last_waiter_after`` (after a full
``gc.collect()``; young collections still count).
The goal (issue 20): <= 5 ms for 1000 waiters.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from datetime import timedelta
from typing import Any

from bench._common import (
    last_waiter_after,
    machine,
    median,
    pct,
    run_loop,
    spawn,
    store_server,
    write_json,
)


async def _ours(comm: Any, waiters: int) -> tuple[float, float]:
    import torch

    import asynccoll as ac

    works = [comm.all_reduce(torch.ones(8)) for _ in range(waiters)]  # the peer never joins
    calls: list[float] = []

    def abort() -> None:
        t0 = time.perf_counter()
        comm.abort("bench")
        calls.append(time.perf_counter() - t0)

    return await last_waiter_after(works, abort, ac.CommAborted), calls[0]


async def _floor(waiters: int) -> tuple[float, float]:
    import asynccoll as ac

    loop = asyncio.get_running_loop()
    futs = [loop.create_future() for _ in range(waiters)]
    calls: list[float] = []

    def abort() -> None:
        t0 = time.perf_counter()
        for f in futs:
            f.set_exception(ac.CommAborted("aborted by the user"))
        calls.append(time.perf_counter() - t0)

    return await last_waiter_after(futs, abort, ac.CommAborted), calls[0]


def _rank(rank: int, port: int, waiters: int, reps: int, loop: str) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        import asynccoll as ac

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        rows: dict[str, list[tuple[float, float]]] = {"asynccoll": [], "floor": []}
        for rep in range(reps + 1):  # rep 0: warm-up
            comm = await ac.init(
                "gloo", rank=rank, world_size=2, store=dist.PrefixStore(f"r{rep}/", store)
            )
            if rank == 0:
                ours = await _ours(comm, waiters)
                floor = await _floor(waiters)
                if rep:
                    rows["asynccoll"].append(ours)
                    rows["floor"].append(floor)
                store.set(f"done/{rep}", "1")
            else:
                while not store.check([f"done/{rep}"]):
                    await asyncio.sleep(0.005)
            await comm.close()
        return {
            m: {"last_ms": [r[0] * 1e3 for r in v], "call_ms": [r[1] * 1e3 for r in v]}
            for m, v in rows.items()
        }

    return run_loop(loop, main)


def measure(waiters: int, reps: int, loop: str) -> dict[str, Any]:
    before = machine()
    server = store_server()
    raw = spawn(_rank, (server.port, waiters, reps, loop), 2)[0]
    del server
    out: dict[str, Any] = {"waiters": waiters, "reps": reps, "loop": loop, "machine": before}
    for m, v in raw.items():
        out[m] = {
            "last_ms": median(v["last_ms"]),
            "last_p10_ms": pct(v["last_ms"], 0.1),
            "call_ms": median(v["call_ms"]),
            "samples_last_ms": v["last_ms"],
        }
    out["asynccoll/floor"] = out["asynccoll"]["last_ms"] / out["floor"]["last_ms"]
    out["machine_after"] = machine()
    return out


def table(res: dict[str, Any]) -> str:
    lines = [
        f"abort -> last of {res['waiters']} waiters, loop {res['loop']}, {res['reps']} reps, "
        f"load {res['machine']['loadavg'][0]:.2f}"
    ]
    for m in ("asynccoll", "floor"):
        r = res[m]
        lines.append(
            f"  {m:<10} last {r['last_ms']:7.2f} ms (p10 {r['last_p10_ms']:.2f}), call {r['call_ms']:.2f} ms"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--waiters", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    ap.add_argument("--json", default=None, help="default bench/results/fanout_<loop>.json")
    args = ap.parse_args(argv)
    res = measure(args.waiters, args.reps, args.loop)
    print(table(res))
    write_json(res, args.json or f"bench/results/fanout_{args.loop}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
