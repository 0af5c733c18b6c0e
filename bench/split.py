"""Subgroup creation: ``await comm.split(groups)`` against torch's equivalent on Gloo.

    python bench/split.py [--world-size 4] [--rounds 5] [--json bench/results/split.json]

Every rank is a process on this machine, all on one TCPStore. Each round, in
alternating order, the ranks meet at a barrier of the world communicator and then
make the same subgroups ``[[0, 1], [2, 3], ...]`` (pairs) two ways:

* **torch**: ``ProcessGroupGloo`` of the rank's pair on a fresh ``PrefixStore`` over
  the same store (what ``new_group`` builds for Gloo, without its world barrier);
* **asynccoll**: ``await world.split(pairs)`` (the agreement, the new Gloo group in
  its own namespace, the liveness member, the end-of-creation barrier).

A round's figure is the slowest rank's time (a group is usable when its last member
has it); the result is the median over ``--rounds``. The load average before and
after is recorded: a figure taken above 1.5 is not a verdict. Goal (issue 33):
asynccoll <= 1.5x torch.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import machine, median, quiet, spawn, store_server, write_json  # noqa: E402


def _rank(rank: int, port: int, world_size: int, rounds: int) -> dict[str, list[float]]:
    import torch.distributed as dist

    import asynccoll as ac

    store = dist.TCPStore(
        "127.0.0.1", port, world_size, False, timeout=timedelta(seconds=60), wait_for_workers=False
    )
    pairs = [list(range(i, min(i + 2, world_size))) for i in range(0, world_size, 2)]
    mine = next(p for p in pairs if rank in p)

    async def main() -> dict[str, list[float]]:
        world = await ac.init("gloo", rank=rank, world_size=world_size, store=store, timeout=60)
        times: dict[str, list[float]] = {"torch": [], "asynccoll": []}
        for i in range(rounds + 1):  # round 0 warms both paths up (imports, first store use)
            for mode in ("torch", "asynccoll") if i % 2 else ("asynccoll", "torch"):
                await world.barrier()
                start = time.perf_counter()
                if mode == "torch":
                    pg = dist.ProcessGroupGloo(
                        dist.PrefixStore(f"bench-split/{i}/{pairs.index(mine)}", store),
                        mine.index(rank),
                        len(mine),
                        timedelta(seconds=60),
                    )
                    took = time.perf_counter() - start
                    pg.barrier().wait()  # peers still connecting must not see it go
                    del pg
                else:
                    sub = await world.split(pairs)
                    took = time.perf_counter() - start
                    assert sub is not None
                    await sub.close()
                if i:
                    times[mode].append(took)
        worst = await world.all_gather_object(times)
        await world.close()
        return {m: [max(w[m][k] for w in worst) for k in range(rounds)] for m in times}

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="2 ranks, 1 round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.world_size, args.rounds = 2, 1
    before = machine()
    server = store_server()
    results = spawn(_rank, (server.port, args.world_size, args.rounds), args.world_size)
    after = machine()
    worst = results[0]  # every rank returns the same (gathered) figures
    torch_s, ours_s = median(worst["torch"]), median(worst["asynccoll"])
    res: dict[str, Any] = {
        "world_size": args.world_size,
        "rounds": args.rounds,
        "torch_s": worst["torch"],
        "asynccoll_s": worst["asynccoll"],
        "torch_median_s": torch_s,
        "asynccoll_median_s": ours_s,
        "ratio": ours_s / torch_s if torch_s else None,
        "machine_before": before,
        "machine_after": after,
        "quiet": quiet(before, after),
        "pid": os.getpid(),
    }
    print(
        f"subgroup creation, {args.world_size} ranks in pairs, median of {args.rounds} "
        f"(slowest rank): torch ProcessGroupGloo {torch_s * 1e3:.1f} ms, asynccoll split "
        f"{ours_s * 1e3:.1f} ms, ratio {res['ratio']:.2f} (goal <= 1.5); load "
        f"{before['loadavg'][0]:.2f} -> {after['loadavg'][0]:.2f}"
        + ("" if res["quiet"] else " (not quiet: no verdict)")
    )
    if args.json:
        write_json(res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
