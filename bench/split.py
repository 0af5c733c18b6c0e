"""Subgroup creation: ``await comm.split(groups)`` against torch's equivalent on Gloo.

    python bench/split.py [--world-size 4] [--rounds 5] [--json bench/results/split.json]

Every rank is a process on this machine, all on one TCPStore. Each round, in
rotating order, the ranks meet at a barrier of the world communicator and then
make the same subgroups ``[[0, 1], [2, 3], ...]`` (pairs) four ways:

* **torch**: ``ProcessGroupGloo`` of the rank's pair on a fresh ``PrefixStore`` over
  the same store (what ``new_group`` builds for Gloo, without its world barrier): the
  issue's yardstick;
* **new_group**: what a torch user writes, ``dist.new_subgroups_by_enumeration(pairs)``
  (``new_group`` of each pair, every rank calling it for every pair) on a default Gloo
  group made with ``init_process_group`` over the same store, at torch's defaults;
* **floor**: the thinnest agreed split, on one blocking thread with a connection made
  beforehand: each rank writes its lists, polls (from 50 µs) until every rank's are
  there, reads and compares them, builds the pair's ``ProcessGroupGloo`` and meets its
  pair at a store barrier (the two steps ``split`` adds to torch's bare group: the
  agreement, which makes bad lists ``InvalidArgument`` on every rank, and the end of
  creation, which keeps a fast rank from closing while its peer still connects);
* **gloo floor**: the same two steps on connections that already exist, the thinnest
  they can be: the agreement as one all-reduce (MAX of the lists' hash and of its
  negation) on the default Gloo group, and the end of creation as a barrier on the new
  group; what a split could cost if it used the store only through Gloo's own connect;
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
import json
import os
import sys
import time
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import machine, median, quiet, spawn, store_server, write_json  # noqa: E402

MODES = ("torch", "new_group", "floor", "gloo_floor", "asynccoll")


def _poll(store: Any, keys: list[str]) -> None:
    delay = 0.00005
    while not store.check(keys):
        time.sleep(delay)
        delay = min(delay * 2, 0.001)


def _floor(conn: Any, tag: str, rank: int, world_size: int, pairs: list[list[int]]) -> Any:
    """The thinnest agreed split (see the module docstring), blocking."""
    import torch.distributed as dist

    mine = next(p for p in pairs if rank in p)
    store = dist.PrefixStore(f"bench-floor/{tag}/", conn)
    store.set(f"lists/{rank}", json.dumps(pairs))
    keys = [f"lists/{r}" for r in range(world_size)]
    _poll(store, keys)
    if any(json.loads(bytes(v)) != pairs for v in store.multi_get(keys)):
        raise ValueError("the lists differ")
    group = dist.PrefixStore(f"{pairs.index(mine)}/", store)
    pg = dist.ProcessGroupGloo(group, mine.index(rank), len(mine), timedelta(seconds=60))
    if int(group.add("created", 1)) == len(mine):
        group.set("created/all", "1")
    else:
        _poll(group, ["created/all"])
    return pg


def _gloo_floor(store: Any, tag: str, rank: int, pairs: list[list[int]]) -> Any:
    """The thinnest agreed split over Gloo connections (see the module docstring), blocking."""
    import torch
    import torch.distributed as dist

    digest = zlib.crc32(json.dumps(pairs).encode())
    seen = torch.tensor([digest, -digest], dtype=torch.int64)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)  # the default group: made beforehand
    if seen.tolist() != [digest, -digest]:
        raise ValueError("the lists differ")
    mine = next(p for p in pairs if rank in p)
    group = dist.PrefixStore(f"bench-gloo-floor/{tag}/{pairs.index(mine)}/", store)
    pg = dist.ProcessGroupGloo(group, mine.index(rank), len(mine), timedelta(seconds=60))
    pg.barrier().wait()  # the end of creation
    return pg


def _rank(rank: int, port: int, world_size: int, rounds: int) -> dict[str, list[float]]:
    import torch.distributed as dist

    import asynccoll as ac

    store = dist.TCPStore(
        "127.0.0.1", port, world_size, False, timeout=timedelta(seconds=60), wait_for_workers=False
    )
    pairs = [list(range(i, min(i + 2, world_size))) for i in range(0, world_size, 2)]
    mine = next(p for p in pairs if rank in p)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("bench-world", store), rank=rank, world_size=world_size
    )
    conn = store.clone()  # the floor's connection, made beforehand

    async def main() -> dict[str, list[float]]:
        world = await ac.init("gloo", rank=rank, world_size=world_size, store=store, timeout=60)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(rounds + 1):  # round 0 warms every path up (imports, first store use)
            for mode in MODES[i % len(MODES) :] + MODES[: i % len(MODES)]:
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
                elif mode == "new_group":
                    group, _ = dist.new_subgroups_by_enumeration(pairs)
                    took = time.perf_counter() - start
                    dist.barrier(group=group)
                    del group  # torch keeps it registered (destroying it slowed the next)
                elif mode == "floor":
                    pg = _floor(conn, str(i), rank, world_size, pairs)
                    took = time.perf_counter() - start
                    pg.barrier().wait()
                    del pg
                elif mode == "gloo_floor":
                    pg = _gloo_floor(store, str(i), rank, pairs)
                    took = time.perf_counter() - start
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

    try:
        return asyncio.run(main())
    finally:
        dist.destroy_process_group()


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
    medians = {m: median(worst[m]) for m in MODES}
    torch_s, ours_s = medians["torch"], medians["asynccoll"]
    res: dict[str, Any] = {
        "world_size": args.world_size,
        "rounds": args.rounds,
        **{f"{m}_s": worst[m] for m in MODES},
        **{f"{m}_median_s": medians[m] for m in MODES},
        "ratio": ours_s / torch_s if torch_s else None,
        "ratio_new_group": ours_s / medians["new_group"],
        "floor_ratio": medians["floor"] / torch_s if torch_s else None,
        "gloo_floor_ratio": medians["gloo_floor"] / torch_s if torch_s else None,
        "machine_before": before,
        "machine_after": after,
        "quiet": quiet(before, after),
        "pid": os.getpid(),
    }
    print(
        f"subgroup creation, {args.world_size} ranks in pairs, median of {args.rounds} "
        f"(slowest rank): torch ProcessGroupGloo {torch_s * 1e3:.2f} ms, torch "
        f"new_subgroups_by_enumeration {medians['new_group'] * 1e3:.2f} ms, the floor of an "
        f"agreed split {medians['floor'] * 1e3:.2f} ms ({res['floor_ratio']:.2f}x torch), "
        f"over Gloo connections {medians['gloo_floor'] * 1e3:.2f} ms "
        f"({res['gloo_floor_ratio']:.2f}x), "
        f"asynccoll split {ours_s * 1e3:.2f} ms: ratio {res['ratio']:.2f} (goal <= 1.5), "
        f"{res['ratio_new_group']:.2f}x new_group; load "
        f"{before['loadavg'][0]:.2f} -> {after['loadavg'][0]:.2f}"
        + ("" if res["quiet"] else " (not quiet: no verdict)")
    )
    if args.json:
        write_json(res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
