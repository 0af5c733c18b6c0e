"""Cost of ``check="fingerprint"``: the same all_reduce with and without the check, same processes.

    python -m bench.check [--quick] [--world-size 2] [--loop asyncio|uvloop] [--json PATH]

Each rank builds two Gloo communicators on one store, one with ``check=None`` and one
with ``check="fingerprint"``, and alternates them op by op (A B A B ...), so drift and
noise hit both alike. Reported per size: median and p10 per-op latency of each, their
ratios (checked / unchecked) and the absolute difference.

The floor: a checked op is held until the last peer's fingerprint arrives, so the
rank that issues first pays one one-way message on the side channel plus the wake-up
of its reader thread. ``floor_us`` measures that path alone: a ping-pong of
fingerprint-sized frames between the two ranks' reader threads (half a round trip),
next to one store round trip (``store.check``) for comparison with a store-based design.
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

SIZES = [32, 4096, 262144, 1 << 20, 8 << 20]


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _iters(nbytes: int, quick: bool) -> int:
    n = 3000 if nbytes <= 4096 else (1000 if nbytes <= 262144 else 300 if nbytes <= 1 << 20 else 60)
    return max(20, n // (6 if quick else 1))


async def _latency(plain: Any, checked: Any, quick: bool) -> list[dict[str, Any]]:
    import torch

    rows = []
    pc = time.perf_counter
    for nbytes in SIZES:
        t = torch.ones(max(1, nbytes // 4))
        n = _iters(nbytes, quick)
        for _ in range(max(5, n // 10)):
            await plain.all_reduce(t)
            await checked.all_reduce(t)
        a_s, b_s = [], []
        for i in range(n):
            first, second = (plain, checked) if i % 2 == 0 else (checked, plain)
            t0 = pc()
            await first.all_reduce(t)
            t1 = pc()
            await second.all_reduce(t)
            t2 = pc()
            if first is plain:
                a_s.append(t1 - t0)
                b_s.append(t2 - t1)
            else:
                b_s.append(t1 - t0)
                a_s.append(t2 - t1)
        a, b = statistics.median(a_s), statistics.median(b_s)
        a10, b10 = _pct(a_s, 0.1), _pct(b_s, 0.1)
        rows.append(
            {
                "bytes": nbytes,
                "iters": n,
                "plain_us": a * 1e6,
                "checked_us": b * 1e6,
                "ratio": b / a,
                "extra_us": (b - a) * 1e6,
                "plain_p10_us": a10 * 1e6,
                "checked_p10_us": b10 * 1e6,
                "ratio_p10": b10 / a10,
            }
        )
    return rows


async def _pipelined(plain: Any, checked: Any, quick: bool, depth: int = 64) -> dict[str, Any]:
    """``depth`` small all_reduces issued back to back, then awaited (as gradient buckets are):
    the check overlaps with the ops in flight."""
    import torch

    ts = [torch.ones(8) for _ in range(depth)]
    n = 40 if quick else 200
    a_s, b_s = [], []
    for i in range(n + 5):
        for comm, out in (
            ((plain, a_s), (checked, b_s)) if i % 2 == 0 else ((checked, b_s), (plain, a_s))
        ):
            t0 = time.perf_counter()
            works = [comm.all_reduce(t) for t in ts]
            for w in works:
                await w
            if i >= 5:
                out.append(time.perf_counter() - t0)
    a, b = statistics.median(a_s), statistics.median(b_s)
    return {
        "depth": depth,
        "plain_us": a * 1e6,
        "checked_us": b * 1e6,
        "ratio": b / a,
        "ratio_p10": _pct(b_s, 0.1) / _pct(a_s, 0.1),
    }


def _floor(store: Any, rank: int, world_size: int, n: int) -> dict[str, float]:
    """Half a ping-pong of fingerprint-sized frames through two threads, and a store round trip."""
    import socket
    import threading

    from asynccoll._core.objects import poll_keys

    lat: dict[str, float] = {}
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        store.check(["nothing"])
        samples.append(time.perf_counter() - t0)
    lat["store_round_trip_us"] = statistics.median(samples) * 1e6
    if world_size != 2:
        return lat
    # A TCP ping-pong whose receiving side is a thread (as the checker's reader thread is).
    if rank == 0:
        srv = socket.create_server(("127.0.0.1", 0))
        store.set("floor/port", str(srv.getsockname()[1]))
        conn, _ = srv.accept()
    else:
        poll_keys(store, ["floor/port"], time.monotonic() + 30)
        conn = socket.create_connection(("127.0.0.1", int(store.get("floor/port"))))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    frame = b"x" * 48
    got = threading.Event()
    rtts: list[float] = []

    def reader() -> None:
        for _ in range(n):
            buf = b""
            while len(buf) < len(frame):
                buf += conn.recv(len(frame) - len(buf))
            if rank == 1:
                conn.sendall(frame)  # echo from the thread
            else:
                got.set()

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    if rank == 0:
        for _ in range(n):
            got.clear()
            t0 = time.perf_counter()
            conn.sendall(frame)
            got.wait(5)
            rtts.append(time.perf_counter() - t0)
        lat["one_way_thread_wake_us"] = statistics.median(rtts) / 2 * 1e6
    th.join(10)
    conn.close()
    return lat


async def _rank_main(ctx: Any, quick: bool) -> dict[str, Any]:
    import asynccoll as ac

    plain = await ac.init(
        "gloo", rank=ctx.rank, world_size=ctx.world_size, store=ctx.store, timeout=120
    )
    checked = await ac.init(
        "gloo",
        rank=ctx.rank,
        world_size=ctx.world_size,
        store=ctx.store,
        timeout=120,
        check="fingerprint",
    )
    rows = await _latency(plain, checked, quick)
    pipelined = await _pipelined(plain, checked, quick)
    await plain.close()
    await checked.close()
    floor = await asyncio.get_running_loop().run_in_executor(
        None, _floor, ctx.store, ctx.rank, ctx.world_size, 300 if quick else 2000
    )
    return {"rows": rows, "pipelined": pipelined, "floor": floor}


def run(quick: bool = False, loop: str = "asyncio", world_size: int = 2) -> dict[str, Any]:
    from asynccoll.testing import run_ranks

    results = run_ranks(
        _rank_main, world_size, backend=None, timeout=1200, loop=loop, args=(quick,)
    )
    return {"world_size": world_size, "loop": loop, "rank0": results[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--loop", default="asyncio", choices=["asyncio", "uvloop"])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    res = run(args.quick, args.loop, args.world_size)
    print(f"check='fingerprint' vs check=None, Gloo, {args.world_size} ranks, {args.loop} (rank 0)")
    print(
        f"{'bytes':>9} {'plain us':>9} {'checked':>9} {'ratio':>6} {'extra us':>9} {'p10 plain':>9} {'p10 chk':>9} {'ratio':>6}"
    )
    for r in res["rank0"]["rows"]:
        print(
            f"{r['bytes']:>9} {r['plain_us']:>9.1f} {r['checked_us']:>9.1f} {r['ratio']:>6.3f} {r['extra_us']:>9.1f}"
            f" {r['plain_p10_us']:>9.1f} {r['checked_p10_us']:>9.1f} {r['ratio_p10']:>6.3f}"
        )
    p = res["rank0"]["pipelined"]
    print(
        f"{p['depth']} x 32 B issued back to back, then awaited: plain {p['plain_us']:.0f} us, "
        f"checked {p['checked_us']:.0f} us, ratio {p['ratio']:.3f} (p10 {p['ratio_p10']:.3f})"
    )
    print("floor:", {k: round(v, 1) for k, v in res["rank0"]["floor"].items()})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
