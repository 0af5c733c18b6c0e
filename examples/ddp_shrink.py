"""DDP on asynccoll: a rank dies mid-training, the survivors shrink, rebuild DDP and finish.

    python examples/ddp_shrink.py            # starts a store and one torchrun per rank itself

A plain synchronous torch script: ``dist.init_process_group("asynccoll")`` (the only
change from a Gloo script), ``DistributedDataParallel``, SGD. It runs under the launch
recipe of the faults guide (docs/guides/faults.md): a store that outlives every rank
(``python -m asynccoll.store``) and one single-node torchrun per rank, so that one
rank's death does not make a shared launcher kill the others. At ``--kill-step``
rank ``--kill-rank`` exits; the survivors' step raises ``ac.PeerFailure`` naming it,
within about a second; they ``shrink()`` the communicator, rebuild DDP on
``ac.process_group(new)`` and finish. Rank 0 prints what happened.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import asynccoll as ac


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> float:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 1, generator=gen)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def worker(args: argparse.Namespace) -> None:
    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("asynccoll", store=store, rank=args.rank, world_size=args.world_size)
    group = dist.group.WORLD
    comm: ac.Communicator = group.comm  # type: ignore[union-attr]  # the group's communicator
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    model = DDP(module, process_group=group)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    step, failed = 0, None
    while step < args.steps:
        if args.rank == args.kill_rank and step == args.kill_step:
            os._exit(1)  # a crash: no cleanup, no goodbye
        start = time.monotonic()
        try:
            train_step(model, opt, step, comm.rank)
        except ac.PeerFailure as exc:  # the step's collective found a dead peer
            failed = (exc.ranks, time.monotonic() - start, step)
        else:
            step += 1
            continue
        # Recover outside the except block: the exception (its traceback) keeps the old
        # DDP alive, and its hooks on the parameters must be gone before the new one.
        del model
        gc.collect()
        comm = asyncio.run(comm.shrink())  # the survivors, renumbered
        model = DDP(module, process_group=ac.process_group(comm))  # syncs from the new rank 0
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    high, low = flat.clone(), flat.clone()
    pg = ac.process_group(comm)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=pg)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=pg)
    if comm.rank == 0 and failed is not None:
        ranks, took, at = failed
        print(f"step {at}: PeerFailure naming rank(s) {list(ranks)} after {took:.2f} s")
        print(f"survivors finished {args.steps} steps on {comm.world_size} ranks")
        print(f"parameters equal across survivors: {torch.equal(high, low)}")
    asyncio.run(comm.close())
    dist.destroy_process_group()


def launch(args: argparse.Namespace) -> int:
    """The faults guide's launch recipe: an external store, one torchrun per rank."""
    store = subprocess.Popen(
        [sys.executable, "-m", "asynccoll.store", "--port", "0", "--host", "127.0.0.1"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert store.stdout is not None
        line = store.stdout.readline()  # "asynccoll store: listening on HOST:PORT"
        address = line.rsplit(" ", 1)[-1].strip()
        ranks = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nnodes",
                    "1",
                    "--nproc-per-node",
                    "1",
                    __file__,
                    "--rank",
                    str(r),
                    "--world-size",
                    str(args.world_size),
                    "--store",
                    address,
                    "--steps",
                    str(args.steps),
                    "--kill-rank",
                    str(args.kill_rank),
                    "--kill-step",
                    str(args.kill_step),
                ]
            )
            for r in range(args.world_size)
        ]
        codes = [p.wait(timeout=300) for p in ranks]
    finally:
        store.terminate()
        store.wait(timeout=30)
    survivors = [c for r, c in enumerate(codes) if r != args.kill_rank]
    return 0 if all(c == 0 for c in survivors) and codes[args.kill_rank] != 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--store", help="HOST:PORT of the external store")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill-rank", type=int, default=2)
    parser.add_argument("--kill-step", type=int, default=8)
    args = parser.parse_args()
    if args.rank is None:
        return launch(args)
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
