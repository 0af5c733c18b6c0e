"""asynccoll quickstart: awaitable collectives that never block the event loop.

    python examples/quickstart.py                              # starts 2 local CPU ranks itself
    torchrun --nproc-per-node 2 examples/quickstart.py         # or under torchrun

Each rank all-reduces a tensor, issues two collectives at once and awaits them
together, gathers Python objects, and shows a heartbeat task that keeps ticking
while a large all_reduce is in flight.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import socket
import time

import torch

import asynccoll as ac


async def heartbeat(stop: asyncio.Event) -> int:
    ticks = 0
    while not stop.is_set():
        await asyncio.sleep(0.001)
        ticks += 1
    return ticks


async def main() -> None:
    async with ac.init(backend="gloo") as comm:  # torchrun env: RANK, WORLD_SIZE, MASTER_*
        r, n = comm.rank, comm.world_size

        t = torch.ones(4) * r
        await comm.all_reduce(t)  # in place: sum of all ranks
        expect = sum(range(n))
        assert t.tolist() == [expect] * 4

        a = torch.full((3,), float(r))
        b = torch.arange(3.0) if r == 0 else torch.zeros(3)
        w1 = comm.all_reduce(a, ac.ReduceOp.MAX)  # issued now, in this order
        w2 = comm.broadcast(b, src=0)
        await asyncio.gather(w1, w2)  # other tasks keep running meanwhile

        names = await comm.all_gather_object(f"rank-{r}@{os.getpid()}")

        stop = asyncio.Event()
        hb = asyncio.create_task(heartbeat(stop))
        big = torch.ones(8 << 20)  # 32 MB
        t0 = time.perf_counter()
        await comm.all_reduce(big)
        elapsed = time.perf_counter() - t0
        stop.set()
        ticks = await hb

        if r == 0:
            print(f"world size {n}: all_reduce -> {t.tolist()}")
            print(f"MAX -> {a.tolist()}, broadcast -> {b.tolist()}")
            print(f"objects: {names}")
            print(
                f"32 MB all_reduce took {elapsed * 1e3:.1f} ms; the heartbeat ticked {ticks} times meanwhile"
            )


def _local_rank(rank: int, world_size: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    asyncio.run(main())


if __name__ == "__main__":
    if "RANK" in os.environ:
        asyncio.run(main())
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_local_rank, args=(r, 2, port)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            if p.is_alive():
                p.kill()
        raise SystemExit(max(abs(p.exitcode or 0) for p in procs))
