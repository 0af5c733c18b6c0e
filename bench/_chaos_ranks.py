"""The chaos soak's rank side (``bench/chaos.py`` is the driver): one random op stream, checked."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from datetime import timedelta
from typing import Any

HOST = "127.0.0.1"
#: Threads and open files a rank may hold above its first steady state: one
#: communicator's worth (its backend threads, a reaper parked in an aborted Gloo
#: group until Gloo's own timeout, sockets), since a shrink replaces one.
THREAD_SLACK = 8
FD_SLACK = 24


def _value(k: int, r: int) -> float:
    return float((k * 7 + r) % 97 + 1)


async def _op(comm: Any, k: int, rng: random.Random, deadline: float, check: list[str]) -> None:
    """One random operation of step ``k`` (the same on every rank), checked."""
    import torch

    import asynccoll as ac

    ws, r = comm.world_size, comm.rank
    vals = [_value(k, q) for q in range(ws)]
    kind = rng.choice(
        ["all_reduce", "all_reduce_max", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
         "gather", "scatter", "barrier", "ring", "batch", "object", "bcast_object", "big"]
    )
    root = rng.randrange(ws)
    dtype = rng.choice([torch.float32, torch.float64, torch.int64])
    n = rng.choice([1, 7, 256])

    def full(size: int, v: float) -> Any:
        return torch.full((size,), v, dtype=dtype)

    def expect(ok: bool, what: str) -> None:
        if not ok:
            check.append(f"step {k} {kind} on rank {r} of {ws}: {what}")

    if kind == "all_reduce":
        t = full(n, vals[r])
        await comm.all_reduce(t, timeout=deadline)
        expect(bool((t == sum(vals)).all()), f"sum {t[0].item()} != {sum(vals)}")
    elif kind == "all_reduce_max":
        t = full(n, vals[r])
        await comm.all_reduce(t, ac.ReduceOp.MAX, timeout=deadline)
        expect(bool((t == max(vals)).all()), "max")
    elif kind == "broadcast":
        t = full(n, vals[r])
        await comm.broadcast(t, root, timeout=deadline)
        expect(bool((t == vals[root]).all()), "broadcast")
    elif kind == "reduce":
        t = full(n, vals[r])
        await comm.reduce(t, root, timeout=deadline)
        if r == root:
            expect(bool((t == sum(vals)).all()), "reduce")
    elif kind == "all_gather":
        out = torch.zeros(n * ws, dtype=dtype)
        await comm.all_gather(out, full(n, vals[r]), timeout=deadline)
        expect(out.tolist() == [v for v in vals for _ in range(n)], "all_gather")
    elif kind == "reduce_scatter":
        out = torch.zeros(n, dtype=dtype)
        await comm.reduce_scatter(out, full(n * ws, vals[r]), timeout=deadline)
        expect(bool((out == sum(vals)).all()), "reduce_scatter")
    elif kind == "all_to_all":
        inp = torch.tensor([vals[r] * 100 + i for i in range(ws)], dtype=torch.float64)
        out = torch.zeros(ws, dtype=torch.float64)
        await comm.all_to_all(out, inp, timeout=deadline)
        expect(out.tolist() == [vals[q] * 100 + r for q in range(ws)], "all_to_all")
    elif kind == "gather":
        out = torch.zeros(n * ws, dtype=dtype) if r == root else None
        await comm.gather(full(n, vals[r]), root, out, timeout=deadline)
        if out is not None:
            expect(out.tolist() == [v for v in vals for _ in range(n)], "gather")
    elif kind == "scatter":
        out = torch.zeros(n, dtype=dtype)
        inp = torch.cat([full(n, v) for v in vals]) if r == root else None
        await comm.scatter(out, root, inp, timeout=deadline)
        expect(bool((out == vals[r]).all()), "scatter")
    elif kind == "barrier":
        await comm.barrier(timeout=deadline)
    elif kind == "ring":
        got = torch.zeros(3, dtype=dtype)
        send = comm.send(full(3, vals[r]), (r + 1) % ws, timeout=deadline)
        recv = comm.recv(got, (r - 1) % ws, timeout=deadline)
        await send
        await recv
        expect(bool((got == vals[(r - 1) % ws]).all()), "ring")
    elif kind == "batch":
        ts = [full(n, vals[r]), torch.full((5,), vals[r], dtype=torch.float64), full(2, vals[r])]
        async with comm.coalescing():
            for t in ts:
                comm.all_reduce(t, timeout=deadline)
        expect(all(bool((t == sum(vals)).all()) for t in ts), "coalesced batch")
    elif kind == "object":
        got = await comm.all_gather_object({"r": r, "k": k}, timeout=deadline)
        expect(got == [{"r": q, "k": k} for q in range(ws)], "all_gather_object")
    elif kind == "bcast_object":
        got = await comm.broadcast_object(("x", k, root) if r == root else None, root, timeout=deadline)
        expect(got == ("x", k, root), "broadcast_object")
    elif kind == "big":
        t = torch.full((1 << 18,), vals[r])
        await comm.all_reduce(t, timeout=deadline)
        expect(bool((t == sum(vals)).all()), "1 MB all_reduce")


def _resources() -> tuple[int, int]:
    try:
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        fds = 0
    return threading.active_count(), fds


async def _rank(gen: int, rank: int, world: int, port: int, seed: int, deadline: float, conn: Any) -> None:
    import torch.distributed as dist

    import asynccoll as ac

    client = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=60))
    store = dist.PrefixStore(f"chaos/{gen}", client)
    # Creation, shrink's agreement and rebuilds get more time than one op.
    comm = await ac.init("gloo", rank=rank, world_size=world, store=store, timeout=max(15.0, 3 * deadline))
    loop = asyncio.get_running_loop()
    holder = [comm]
    loop.add_signal_handler(signal.SIGUSR1, lambda: holder[0].abort("chaos: aborted by the driver"))
    stop = asyncio.Event()
    loop.add_reader(conn.fileno(), stop.set)  # any message from the driver: finish
    send_lock = threading.Lock()

    def send(*msg: Any) -> None:
        with send_lock:
            conn.send(msg)

    send("ready", rank, os.getpid())
    shrinks, ops, k = 0, 0, 0
    baseline: tuple[int, int] | None = None
    errors: list[str] = []
    failed_at: float | None = None
    last_report = time.monotonic()
    while not stop.is_set() and comm.world_size >= 2:  # a lone survivor has nobody to talk to
        rng = random.Random(hash((seed, gen, shrinks, k, comm.world_size)))
        t0 = time.monotonic()
        try:
            await _op(comm, k, rng, deadline, errors)
        except (ac.CommAborted, ac.CollectiveTimeout) as exc:
            waited = time.monotonic() - t0
            if waited > deadline + 1.0:  # the driver excuses it if this rank was the one frozen meanwhile
                send("long_wait", rank, time.time() - waited, time.time(), f"{waited:.2f} s ({type(exc).__name__})")
            failed_at = time.time()
            send("failed", rank, type(exc).__name__, list(getattr(exc, "ranks", ()) or ()), failed_at)
            try:
                new = await comm.shrink()
            except ac.AsyncCollError as exc2:  # left out by the others (frozen too long), or all gone
                send("left", rank, f"{type(exc2).__name__}: {exc2}")
                break
            await comm.close()
            comm = holder[0] = new
            shrinks += 1
            k = 0
            continue
        waited = time.monotonic() - t0
        if waited > deadline + 1.0:
            send("long_wait", rank, time.time() - waited, time.time(), f"{waited:.2f} s (step {k})")
        ops += 1
        k += 1
        if failed_at is not None:  # the first op on the new communicator: recovered
            threads, fds = _resources()
            send("recovered", rank, time.time(), comm.world_size, comm.rank, threads, fds)
            failed_at = None
            if baseline is not None and (threads > baseline[0] + THREAD_SLACK or fds > baseline[1] + FD_SLACK):
                errors.append(f"resources grew: threads {baseline[0]} -> {threads}, fds {baseline[1]} -> {fds}")
        elif baseline is None and k == 50:
            baseline = _resources()
        if len(comm.flight_record()) > 4096:
            errors.append(f"flight record of {len(comm.flight_record())} ops")
        if errors:
            send("violation", rank, errors[:])
            errors.clear()
        if time.monotonic() - last_report > 0.5:
            send("ops", rank, ops)
            last_report = time.monotonic()
        await asyncio.sleep(0)
    send("ops", rank, ops)
    await comm.close()
    send("done", rank, ops)


def _rank_main(gen: int, rank: int, world: int, port: int, seed: int, deadline: float, conn: Any) -> None:
    try:
        asyncio.run(_rank(gen, rank, world, port, seed, deadline, conn))
    except BaseException as exc:  # noqa: BLE001 - reported to the driver whatever it is, then exit non-zero
        import traceback

        try:
            conn.send(("crashed", rank, "".join(traceback.format_exception(exc))))
        finally:
            os._exit(3)
