"""asynccoll training: GradSync overlaps the gradient all-reduce with backward; join() for uneven data.

    python examples/train.py                        # starts 2 local CPU ranks itself
    python examples/train.py --ranks 3 --accumulate 2
    torchrun --nproc-per-node 2 examples/train.py   # or under torchrun

Every rank trains the same small classifier on its own shard of a synthetic data
set; the shards are uneven (rank r has ``--batches + 3 r`` batches). One step::

    loss = loss_fn(model(x), y)
    await asyncio.to_thread(loss.backward)   # buckets are all-reduced while backward runs
    await sync.wait()                        # every bucket reduced, written into .grad
    opt.step()

``async with sync.join():`` lets a rank that runs out of batches keep answering the
others' gradient all-reduces (with zeros), as torch DDP's ``join()`` does, and at the
end gives every rank the model of the last one to finish. Meanwhile two tasks run on
the same event loop: a heartbeat that records how late it wakes (backward runs in a
thread, so the loop stays free) and an evaluation task that computes the held-out
loss of a snapshot of the model at common checkpoints and averages it over the ranks
through a second communicator (collectives of concurrent tasks must not share one
communicator: their order would differ between ranks). At the end the ranks check
that they hold identical parameters.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import multiprocessing as mp
import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import asynccoll as ac

FEATURES, CLASSES, BATCH = 32, 4, 32


def make_data(seed: int, batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of a synthetic 4-class problem (the same rule for every rank and seed)."""
    rule = torch.Generator().manual_seed(0)
    centers = torch.randn(CLASSES, FEATURES, generator=rule) * 0.3
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batches):
        y = torch.randint(0, CLASSES, (BATCH,), generator=g)
        x = centers[y] + torch.randn(BATCH, FEATURES, generator=g)
        out.append((x, y))
    return out


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)  # the same initial weights on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, CLASSES),
    )


def connect_store() -> dist.Store:
    """A client of the store that torchrun's agent (or our launcher) hosts."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not hosted,
        timeout=timedelta(seconds=60),
        wait_for_workers=False,
    )
    return dist.PrefixStore("train_example/", store)


async def heartbeat(stop: asyncio.Event, period: float = 0.002) -> dict[str, float]:
    """Wake every ``period`` s; report how late the loop let us wake."""
    lags = []
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(period)
        lags.append(time.perf_counter() - t0 - period)
    lags.sort()
    return {"ticks": len(lags), "p50_ms": lags[len(lags) // 2] * 1e3, "max_ms": lags[-1] * 1e3}


async def evaluator(
    comm: ac.Communicator, queue: asyncio.Queue[Any], heldout: list[Any]
) -> list[str]:
    """Held-out loss of model snapshots, averaged over the ranks on ``comm`` (its own communicator)."""
    lines = []
    while (item := await queue.get()) is not None:
        step, model = item
        with torch.no_grad():
            total = sum(
                float(torch.nn.functional.cross_entropy(model(x), y, reduction="sum"))
                for x, y in heldout
            )
        stats = torch.tensor([total, float(len(heldout) * BATCH)], dtype=torch.float64)
        await comm.all_reduce(stats)
        lines.append(f"eval  step {step:3d}: held-out loss {stats[0] / stats[1]:.4f}")
    return lines


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # several ranks share this machine's cores
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = await asyncio.to_thread(connect_store)
    comm = await ac.init("gloo", rank=rank, world_size=world_size, store=store)
    eval_comm = await ac.init("gloo", rank=rank, world_size=world_size, store=store)
    try:
        batches = make_data(seed=100 + rank, batches=args.batches + 3 * rank)  # uneven shards
        heldout = make_data(seed=999 + rank, batches=4)
        # Checkpoints every rank reaches: evaluation collectives must match across ranks.
        counts = await eval_comm.all_gather_object(len(batches))
        checkpoints = set(range(args.eval_every, min(counts) + 1, args.eval_every))

        model = make_model()
        sync = ac.GradSync(comm, model, bucket_mb=0.05)  # small model: several small buckets
        opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        stop = asyncio.Event()
        hb = asyncio.create_task(heartbeat(stop))
        ev = asyncio.create_task(evaluator(eval_comm, queue, heldout))

        losses = []
        t0 = time.perf_counter()
        async with sync.join() as joined:
            for step, (x, y) in enumerate(batches, start=1):
                # --accumulate n: the batch in n micro-batches, all but the last under no_sync()
                for i, (xs, ys) in enumerate(
                    zip(x.chunk(args.accumulate), y.chunk(args.accumulate))
                ):
                    last = i == args.accumulate - 1
                    with contextlib.nullcontext() if last else sync.no_sync():
                        loss = torch.nn.functional.cross_entropy(model(xs), ys) / args.accumulate
                        await asyncio.to_thread(
                            loss.backward
                        )  # hooks issue the buckets' all-reduces
                await sync.wait()
                opt.step()
                opt.zero_grad()
                losses.append(float(loss.detach()) * args.accumulate)
                if step in checkpoints:
                    queue.put_nowait((step, copy.deepcopy(model)))
            print(f"rank {rank}: out of data after {len(batches)} steps, joining", flush=True)
        elapsed = time.perf_counter() - t0
        queue.put_nowait(None)
        evals = await ev
        stop.set()
        beat = await hb
        sync.close()

        # Every rank must now hold the same parameters (join() synced the final model).
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        hi, lo = flat.clone(), flat.clone()
        await comm.all_reduce(hi, ac.ReduceOp.MAX)
        await comm.all_reduce(lo, ac.ReduceOp.MIN)
        same = bool(torch.equal(hi, lo))
        summary = await comm.all_gather_object(
            f"rank {rank}: {len(batches)} batches, shadowed {joined.shadowed_steps} steps, "
            f"first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}, "
            f"heartbeat p50 lag {beat['p50_ms']:.2f} ms, max {beat['max_ms']:.1f} ms ({beat['ticks']} ticks)"
        )
        if rank == 0:
            print("\n".join(evals))
            print("\n".join(summary))
            print(f"final model from rank {joined.authoritative_rank} (the last to finish)")
            print(
                f"{sync.steps} synchronised steps in {elapsed:.2f} s, {len(sync.bucket_sizes)} buckets"
            )
            print(f"parameters identical on all {world_size} ranks: {same}")
        if not same:
            raise SystemExit(f"rank {rank}: parameters differ across ranks")
    finally:
        await eval_comm.close()
        await comm.close()


def _local_rank(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    asyncio.run(main(args))


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--ranks", type=int, default=2, help="local ranks to start (ignored under torchrun)"
    )
    ap.add_argument(
        "--batches", type=int, default=40, help="batches of rank 0 (rank r has 3 r more)"
    )
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (no_sync)")
    ap.add_argument("--eval-every", type=int, default=10)
    return ap.parse_args()


if __name__ == "__main__":
    args = parse()
    if "RANK" in os.environ:
        asyncio.run(main(args))
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # The launcher hosts the store (as torchrun's agent does); every rank is a client.
        host = dist.TCPStore(
            "127.0.0.1",
            port,
            args.ranks + 1,
            True,
            timeout=timedelta(seconds=60),
            wait_for_workers=False,
        )
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_local_rank, args=(r, args.ranks, port, args))
            for r in range(args.ranks)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            if p.is_alive():
                p.kill()
        raise SystemExit(max(abs(p.exitcode or 0) for p in procs))
