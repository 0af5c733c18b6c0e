"""asynccoll fault tolerance: a rank dies mid-training, the survivors shrink and finish.

    python examples/fault_tolerant.py                          # starts 3 local CPU ranks itself
    python examples/fault_tolerant.py --kill-rank 1 --kill-step 10
    torchrun --nproc-per-node 3 examples/fault_tolerant.py     # or under torchrun

Three ranks train a linear regression, data-parallel: each computes the gradient on
its shard of a synthetic data set and the ranks average it with one
``all_reduce(..., ReduceOp.AVG)`` per step. At ``--kill-step`` rank ``--kill-rank``
writes the time to the store and kills itself. The survivors' all_reduce raises
``ac.PeerFailure`` naming the dead rank; they call ``comm.shrink()`` to get a
communicator of the survivors (ranks renumbered), re-shard the data over it, redo the
interrupted step and finish. Rank 0 (of the survivors) prints the timeline.

The rendezvous store must outlive any rank, so no rank hosts it: started here, the
launcher process hosts it (as torchrun's agent does) and every rank is a client.
Under torchrun the killed rank exits with status 0: torchrun stops all workers as
soon as one fails, which would take the survivors down with it.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import asynccoll as ac
from asynccoll.testing import crash

SAMPLES, FEATURES = 3000, 16  # 3000 splits evenly over 3 and over 2 ranks


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """The same synthetic regression problem on every rank: y = X w + noise."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    w = torch.randn(FEATURES, 1, generator=gen)
    return x, x @ w + 0.1 * torch.randn(SAMPLES, 1, generator=gen)


def connect_store() -> dist.Store:
    """A client of the store that torchrun's agent (or our launcher) hosts."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not hosted,
        timeout=timedelta(seconds=30),
        wait_for_workers=False,
    )
    return dist.PrefixStore("fault_tolerant/", store)


async def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # several ranks share this machine's cores
    store = await asyncio.to_thread(connect_store)
    me = int(os.environ["RANK"])  # the original rank, kept for the report
    comm = await ac.init("gloo", rank=me, world_size=int(os.environ["WORLD_SIZE"]), store=store)
    await comm.barrier()
    start = time.time()
    timeline: list[tuple[float, str, str]] = []

    x, y = dataset()
    model = torch.nn.Linear(FEATURES, 1)
    torch.nn.init.zeros_(model.weight)  # same start on every rank
    torch.nn.init.zeros_(model.bias)
    params = list(model.parameters())

    step, resumed = 0, True
    first_loss = mean_loss = float("nan")
    while step < args.steps:
        if me == args.kill_rank and step == args.kill_step:
            store.set("killed_at", repr(time.time()))
            if "TORCHELASTIC_RUN_ID" in os.environ:
                crash("exit", code=0)  # see the module docstring
            crash("sigkill")

        # This rank's shard of the data: every world_size-th sample, from its rank on.
        xs, ys = x[comm.rank :: comm.world_size], y[comm.rank :: comm.world_size]
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        grads = torch.autograd.grad(loss, params)
        flat = torch.cat([g.flatten() for g in grads] + [loss.detach().reshape(1)])

        try:
            await comm.all_reduce(flat, ac.ReduceOp.AVG)  # averaged gradients and loss
        except ac.PeerFailure as failure:
            timeline.append((time.time(), "detected", f"PeerFailure, ranks {list(failure.ranks)}"))
            old, comm = comm, await comm.shrink()  # the survivors, renumbered 0..n-1
            timeline.append((time.time(), "shrunk", f"{old.world_size} -> {comm.world_size} ranks"))
            await old.close()  # releases what the aborted one holds
            killed_at = float(await asyncio.to_thread(store.get, "killed_at"))
            timeline.insert(
                0, (killed_at, "failure", f"rank {args.kill_rank} killed at step {step}")
            )
            resumed = False
            continue  # redo this step on the new shards

        if not resumed:
            timeline.append(
                (time.time(), "resumed", f"step {step} all_reduce on {comm.world_size} ranks")
            )
            resumed = True
        with torch.no_grad():
            offset = 0
            for p in params:
                p.sub_(args.lr * flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        mean_loss = float(flat[-1])
        if step == 0:
            first_loss = mean_loss
        if comm.rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {mean_loss:8.4f}  ({comm.world_size} ranks)", flush=True)
        step += 1

    survivors = await comm.all_gather_object(me)
    if comm.rank == 0:
        print(f"final loss {mean_loss:.4f} after {args.steps} steps (first {first_loss:.4f})")
        print("timeline (seconds since start):")
        for at, what, detail in timeline:
            print(f"  {at - start:+7.3f}  {what:<9} {detail}")
        print(f"survivors: {survivors}")
        assert mean_loss < first_loss / 10, "training did not converge"
    await comm.close()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="train on 3 ranks, kill one, shrink, finish")
    ap.add_argument("--kill-rank", type=int, default=2, help="the rank that dies")
    ap.add_argument("--kill-step", type=int, default=20, help="the step at which it dies")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--lr", type=float, default=0.05)
    return ap.parse_args(argv)


def _local_rank(rank: int, world_size: int, port: int, argv: list[str]) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the launcher hosts the store, as torchrun's agent does
    )
    asyncio.run(train(parse(argv)))


def launch(argv: list[str], world_size: int = 3) -> int:
    """Host the store here, start the ranks, wait; 0 when every survivor finished."""
    args = parse(argv)
    if not 0 <= args.kill_rank < world_size:
        raise SystemExit(f"--kill-rank must be 0..{world_size - 1}")
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_local_rank, args=(r, world_size, store.port, argv))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    survivors = [p for r, p in enumerate(procs) if r != args.kill_rank]
    return max(abs(p.exitcode if p.exitcode is not None else 1) for p in survivors)


if __name__ == "__main__":
    import sys

    if "RANK" in os.environ:
        asyncio.run(train(parse()))
    else:
        raise SystemExit(launch(sys.argv[1:]))
