"""Rank functions of tests/nccl/test_gpu.py, run on the one real GPU (run_ranks needs them
importable).

Each runs in a rank process of its own, never in the pytest process (which also runs the
simulated GPU's doubles of ``torch.cuda``). ``python tests/support/gpu_ranks.py stall LOOP``
runs the event-loop stall check in a fresh process (a cold init needs one).
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import json
import os
import pkgutil
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

import asynccoll as ac
from asynccoll._faults.service import Service
from asynccoll.testing import RankContext

DEV = torch.device("cuda", 0)
_PER_MS: list[float] = []


def cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep`` (measured once per process)."""
    if not _PER_MS:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        a.record()
        torch.cuda._sleep(10_000_000)
        b.record()
        b.synchronize()
        _PER_MS.append(max(1e5, 10_000_000 / max(a.elapsed_time(b), 1e-3)))
    return _PER_MS[0]


def gpu_sleep(ms: float) -> None:
    """Queue ``ms`` milliseconds of GPU work on the current stream (returns at once)."""
    torch.cuda._sleep(int(cycles_per_ms() * ms))


def our_threads(rank: int) -> set[str]:
    """asynccoll's and streams' threads, less run_ranks' executor (``asynccoll-rank<R>_<N>``)."""
    return {
        t.name
        for t in threading.enumerate()
        if t.name.startswith(("asynccoll", "streams"))
        and not t.name.startswith(f"asynccoll-rank{rank}_")
    }


async def threads_gone(before: set[str], rank: int, within: float = 5.0) -> list[str]:
    """Threads started since ``before`` still alive after at most ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        left = sorted(our_threads(rank) - before)
        if not left or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.02)


# ============================================================ stream order, allocator
OUT_OF_PLACE = ("all_gather", "all_to_all", "reduce_scatter", "gather", "scatter")


def issue(comm: Any, kind: str, out: Any, x: Any) -> Any:
    """The out-of-place op ``kind`` from ``x`` into ``out`` (equal sizes at world size 1)."""
    if kind == "all_gather":
        return comm.all_gather(out, x)
    if kind == "all_to_all":
        return comm.all_to_all(out, x)
    if kind == "reduce_scatter":
        return comm.reduce_scatter(out, x)
    if kind == "gather":
        return comm.gather(x, 0, out)
    return comm.scatter(out, 0, x)


async def side_stream_order(comm: Any, iters: int = 120, numel: int = 1 << 16) -> dict[str, Any]:
    """Out-of-place ops issued on a side stream, each behind 0-6 ms of GPU work queued just
    before its input is filled; the input freed and its size allocated again at once (the
    caching allocator hands the block out again unless the comm stream still holds it);
    the output read on a third stream ordered by ``wait_stream``. The host never waits:
    the loop ends while the GPU still has work."""
    side, consumer = torch.cuda.Stream(DEV), torch.cuda.Stream(DEV)
    rng = random.Random(34)
    outs, ys, works = [], [], []
    slept_ms = 0.0
    t0 = time.perf_counter()
    for i in range(iters):
        with torch.cuda.stream(side):
            ms = rng.uniform(0.0, 6.0)
            slept_ms += ms
            gpu_sleep(ms)
            x = torch.full((numel,), float(i), device=DEV)
            out = torch.zeros(numel, device=DEV)
            w = issue(comm, OUT_OF_PLACE[i % len(OUT_OF_PLACE)], out, x)
            del x
            junk = torch.full(
                (numel,), -1.0, device=DEV
            )  # x's block, were it not held for the comm stream
        w.wait_stream(consumer)
        with torch.cuda.stream(consumer):
            ys.append(out * 2)
        del junk
        outs.append(out)
        works.append(w)
    loop_s = time.perf_counter() - t0
    pending_at_end = not works[-1].done()
    for w in works:
        await w
    consumer.synchronize()
    bad = [
        (i, OUT_OF_PLACE[i % len(OUT_OF_PLACE)], float(y.min()), float(y.max()))
        for i, y in enumerate(ys)
        if not bool((y == 2.0 * i).all())
    ]
    return {
        "bad": bad[:10],
        "loop_s": loop_s,
        "gpu_sleep_s": slept_ms / 1e3,
        "pending_at_end": pending_at_end,
    }


# ================================================================= abort and close
async def abort_behind_gpu_work(ctx: RankContext) -> dict[str, Any]:
    """``comm.abort()`` while an op waits behind 2 s of GPU work; then close, the threads,
    and a fresh communicator."""
    kw: dict[str, Any] = dict(rank=0, world_size=1, store=ctx.store, device=DEV, timeout=60)
    warm = await ac.init(
        "nccl", **kw
    )  # process-wide services and the device's lane exist from here on
    await warm.all_reduce(torch.ones(4, device=DEV))
    await warm.close()
    before = our_threads(ctx.rank)
    comm = await ac.init("nccl", **kw)
    handle = comm.backends["cuda"].handle
    can_revoke = bool(handle.lib.can_revoke(handle.communicator))
    t = torch.ones(1 << 20, device=DEV)
    await comm.all_reduce(t)
    gpu_sleep(2000)  # on the current stream: the op below waits for it
    w = comm.all_reduce(t, ac.ReduceOp.AVG)
    await asyncio.sleep(0.2)  # launched by now, queued behind the sleep on the device
    queued = not w.done()
    t0 = time.perf_counter()
    comm.abort("test: abort behind GPU work")
    abort_call_s = time.perf_counter() - t0
    try:
        await asyncio.wait_for(w, 10)
        outcome = "completed"
    except ac.CommAborted:
        outcome = "CommAborted"
    except BaseException as exc:  # noqa: BLE001 - reported
        outcome = f"{type(exc).__name__}: {exc}"
    failed_s = time.perf_counter() - t0
    revoked = handle.revoked
    await comm.close()
    left = await threads_gone(before, ctx.rank)
    try:
        fresh = await asyncio.wait_for(ac.init("nccl", **kw), 30)
        r = await asyncio.wait_for(fresh.all_reduce(torch.full((4,), 2.0, device=DEV)), 30)
        fresh_ok = "ok" if bool((r == 2).all()) else f"wrong result {r.tolist()}"
        await fresh.close()
    except BaseException as exc:  # noqa: BLE001 - reported
        fresh_ok = f"{type(exc).__name__}: {exc}"
    return {
        "queued": queued,
        "outcome": outcome,
        "failed_s": failed_s,
        "abort_call_s": abort_call_s,
        "can_revoke": can_revoke,
        "revoked": revoked,
        "threads_left": left,
        "fresh": fresh_ok,
    }


async def close_with_pending(comm: Any) -> dict[str, Any]:
    """``close()`` while an op waits behind 1 s of GPU work: the op completes, then the
    communicator is finalized (not aborted)."""
    handle = comm.backends["cuda"].handle
    x = torch.full((1 << 20,), 3.0, device=DEV)
    out = torch.zeros_like(x)
    gpu_sleep(1000)
    w = comm.all_gather(out, x)  # out of place: out == 3 only if it ran
    await comm.close()
    return {
        "done": w.done(),
        "exception": repr(w.exception()) if w.done() else "not done",
        "ran": bool((out == 3).all()),
        "state": comm.state,
        "handle": handle.state,
        "finalized": handle.communicator is None and not handle.stopping,
    }


# ============================================================ event-loop stalls
def _loop_stall_main(loop_name: str) -> dict[str, Any]:
    """The loop's longest stall in each phase: a cold init (the first CUDA context and NCCL
    communicator of this process; the imports and torch's CUDA check come first), a warm
    init, 100 ops, and close."""
    import cuda.bindings.driver  # noqa: F401 - the imports come before the measure
    import nccl.core  # noqa: F401
    import torch.distributed as dist

    import streams  # noqa: F401
    from asynccoll._backends.nccl import missing

    if loop_name == "uvloop":
        import uvloop  # noqa: F401
    for pkg in (ac, streams):  # every module asynccoll may import lazily (not the test kit)
        for mod in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if not mod.name.startswith("asynccoll.testing"):
                importlib.import_module(mod.name)
    for name in (
        "anyio._backends._asyncio",
        "nccl.core.interop.torch",
    ):  # imported by their first use
        importlib.import_module(name)
    # torch's CUDA check (cuInit: torch holds the GIL through it, so no library can keep it
    # off a loop) and libnccl loaded by nccl4py; no CUDA context yet.
    assert missing() is None, missing()
    gc.collect()
    gc.freeze()  # the imports' objects: a full collection of them is no stall of ours
    tick = 0.001

    async def main() -> dict[str, Any]:
        gaps: list[float] = []
        stop = False

        async def beat() -> None:
            last = time.perf_counter()
            while not stop:
                await asyncio.sleep(tick)
                now = time.perf_counter()
                gaps.append(now - last - tick)
                last = now

        task = asyncio.ensure_future(beat())
        await asyncio.sleep(0.05)
        res: dict[str, Any] = {"loop": loop_name}

        def phase(name: str) -> None:
            res[name] = round(max(gaps, default=0.0) * 1e3, 3)
            gaps.clear()

        kw: dict[str, Any] = dict(rank=0, world_size=1, device=DEV, timeout=60)
        gaps.clear()
        modules = set(sys.modules)
        cold = await ac.init("nccl", store=dist.HashStore(), **kw)
        phase("cold_init_ms")
        res["cold_init_imported"] = sorted(
            set(sys.modules) - modules
        )  # a stall there may be an import
        warm = await ac.init("nccl", store=dist.HashStore(), **kw)
        phase("warm_init_ms")
        x = torch.ones(1 << 22, device=DEV)
        for _ in range(50):
            await cold.all_reduce(x, ac.ReduceOp.AVG)
            await warm.all_reduce(x)
        phase("ops_ms")
        await warm.close()
        await cold.close()
        phase("close_ms")
        stop = True
        await task
        return res

    if loop_name == "uvloop":
        import uvloop

        return uvloop.run(main())
    return asyncio.run(main())


# =================================================================== two ranks
async def auto_two_ranks_one_gpu(ctx: RankContext) -> dict[str, Any]:
    """``init("auto")`` at world size 2 with both ranks on cuda:0 (NCCL < 2.30 refuses two
    ranks of one communicator on one GPU): the error, how long it took, and what is left."""
    store = ctx.store

    async def both(name: str) -> None:
        store.add(name, 1)
        while int(store.add(name, 0)) < ctx.world_size:
            await asyncio.sleep(0.01)

    kw: dict[str, Any] = dict(rank=ctx.rank, world_size=ctx.world_size, store=store, timeout=20)
    warm = await ac.init("gloo", **kw)  # once-per-store keys (creation counters) exist from here on
    await warm.close()
    for _ in range(200):  # the warm-up's liveness service unlists itself as it ends
        if Service.threads() == 0:
            break
        await asyncio.sleep(0.025)
    for name in ("b1", "b2", "b3"):
        store.add(name, 0)
    await both("b1")
    keys0, before = store.num_keys(), our_threads(ctx.rank)
    await both("b2")
    t0 = time.perf_counter()
    try:
        comm = await ac.init("auto", device=DEV, **kw)
        outcome = f"no error: backends {sorted(map(str, comm.backends))}"
        await comm.close()
    except BaseException as exc:  # noqa: BLE001 - the finding
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - t0
    await both("b3")
    left = await threads_gone(before, ctx.rank)
    return {
        "outcome": outcome,
        "seconds": seconds,
        "keys_left": store.num_keys() - keys0,
        "threads_left": left,
    }


# ======================================================== every collective, groups
def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (exact comparison for every dtype, fp8 and complex included)."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().view(torch.uint8)


def zeros_as(x: torch.Tensor) -> torch.Tensor:
    """Zeros of ``x``'s shape and dtype, made as bytes (no fill kernel needed for any dtype)."""
    z = torch.zeros(x.numel() * x.element_size(), dtype=torch.uint8, device=x.device)
    if x.is_complex():
        return torch.view_as_complex(z.view(x.real.dtype).view(-1, 2)).view(x.shape)
    return z.view(x.dtype).view(x.shape)


def sample(dtype: torch.dtype, n: int = 12) -> torch.Tensor:
    base = torch.arange(1, n + 1, device=DEV)
    if dtype is torch.bool:
        return base % 3 == 0
    return base.to(dtype)


async def every_collective(comm: Any) -> list[str]:
    """Every collective, dtype and reduce op at world size 1 (the result is the input,
    exactly), then CuPy arrays on a non-blocking CuPy stream; the mismatches."""
    from asynccoll._backends.nccl import caps as nccl_caps

    caps = comm.backends["cuda"].caps
    moved = sorted(nccl_caps.NATIVE | nccl_caps.COMPLEX | {torch.int16}, key=str)
    bad: list[str] = []

    def check(what: str, got: Any, want: torch.Tensor) -> None:
        if not torch.equal(bits(got), bits(want)):
            bad.append(f"{what}: bytes {bits(got).tolist()} != {bits(want).tolist()}")

    for op in ac.ReduceOp:
        for dt in sorted(caps.reduce[op], key=str):
            x = sample(dt)
            check(f"all_reduce {dt} {op.name}", await comm.all_reduce(x.clone(), op), x)
            r = x.clone()
            await comm.reduce(r, 0, op)
            check(f"reduce {dt} {op.name}", r, x)
            check(
                f"reduce_scatter {dt} {op.name}", await comm.reduce_scatter(zeros_as(x), x, op), x
            )
    for dt in moved:
        x = sample(dt)
        check(f"broadcast {dt}", await comm.broadcast(x.clone(), 0), x)
        check(f"all_gather {dt}", await comm.all_gather(zeros_as(x), x), x)
        check(f"all_to_all {dt}", await comm.all_to_all(zeros_as(x), x), x)
        out = zeros_as(x)
        await comm.gather(x, 0, out)
        check(f"gather {dt}", out, x)
        check(f"scatter {dt}", await comm.scatter(zeros_as(x), 0, x), x)
    await comm.barrier()
    bad += await _cupy_on_its_stream(comm)
    return bad


async def _cupy_on_its_stream(comm: Any) -> list[str]:
    try:
        import cupy
    except ImportError:
        return []
    bad: list[str] = []
    with cupy.cuda.Device(0):
        cs = cupy.cuda.Stream(non_blocking=True)
        ext = torch.cuda.ExternalStream(cs.ptr, device=DEV)
        for i in range(20):
            with cs:
                with torch.cuda.stream(ext):
                    gpu_sleep(2.0)  # on CuPy's stream, before the fill: the op must wait for it
                a = cupy.full(4096, i, dtype=cupy.float32)
                o = cupy.zeros(4096, dtype=cupy.float32)
                w = comm.all_gather(o, a)
                del a  # CuPy's pool reuses the block at once unless the op still holds the array
                junk = cupy.full(4096, -1, dtype=cupy.float32)
                n = cupy.arange(1, 9, dtype=cupy.int32)
                for op in ac.ReduceOp:
                    await comm.all_reduce(n, op)
                await w
                if float(o.min()) != i or float(o.max()) != i:
                    bad.append(f"cupy all_gather {i}: {float(o.min())}..{float(o.max())}")
                if n.tolist() != list(range(1, 9)):
                    bad.append(f"cupy all_reduce int32 {i}: {n.tolist()}")
                del junk
        cs.synchronize()
    return bad


async def coalesced_group(comm: Any) -> list[str]:
    """Coalesced batches (one NCCL group) mixing collectives with the send/recv to self of
    all_to_all, gather and scatter, on a side stream behind GPU work; then a batch whose
    body raises at a bad member: nothing of it runs."""
    side = torch.cuda.Stream(DEV)
    bad: list[str] = []
    n = 1024
    for i in range(20):
        with torch.cuda.stream(side):
            gpu_sleep(1.0)
            a = torch.full((n,), float(i), device=DEV)
            outs = {
                k: torch.zeros(n, device=DEV)
                for k in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")
            }
            c = torch.arange(8.0, device=DEV) + i
            async with comm.coalescing():
                comm.all_reduce(a)
                comm.all_gather(outs["all_gather"], a)
                comm.broadcast(c, 0)
                comm.reduce_scatter(outs["reduce_scatter"], a)
                comm.all_to_all(outs["all_to_all"], a)
                comm.gather(a, 0, outs["gather"])
                comm.scatter(outs["scatter"], 0, a)
            side.synchronize()
        bad += [f"batch {i}: {k}" for k, o in outs.items() if not bool((o == i).all())]
        if not bool((c == torch.arange(8.0, device=DEV) + i).all()):
            bad.append(f"batch {i}: broadcast")
    out = torch.zeros(n, device=DEV)
    try:
        async with comm.coalescing():
            comm.all_gather(out, torch.ones(n, device=DEV))
            comm.all_gather(
                torch.zeros(n + 1, device=DEV), torch.ones(n, device=DEV)
            )  # sizes differ
        bad.append("a bad member did not raise")
    except ac.InvalidArgument:
        pass
    torch.cuda.synchronize()
    if bool(out.any()):
        bad.append("the batch with a bad member ran its first member")
    await comm.all_reduce(torch.ones(4, device=DEV))  # the communicator is still usable
    return bad


async def nccl_group_error_rule(ctx: RankContext) -> dict[str, Any]:
    """NCCL's group error rule, which ``NcclLib.poison_group`` relies on: a call that fails
    its argument check inside a group makes ``ncclGroupEnd`` fail (NCCL src/group.cc).
    Whether the group's valid members ran is reported (``ran``), not asserted: on the H100
    with NCCL 2.28.9 (world size 1, non-blocking) they did, though 2.30's group.cc reads
    "launches nothing" (docs/verified.md). Raw nccl4py, through asynccoll's ``NcclLib``."""
    from asynccoll._backends.nccl import NcclLib, abort_quietly, wait_ready

    lib = NcclLib()
    torch.cuda.set_device(DEV)
    comm = lib.init(1, 0, lib.unique_id())
    wait_ready(comm, lib, time.monotonic() + 30, "NCCL init")
    stream = torch.cuda.Stream(DEV)
    src = torch.full((1024,), 5.0, device=DEV)
    dst = torch.zeros_like(src)
    torch.cuda.synchronize()
    lib.group_start()
    # AVG, not SUM: at world size 1 NCCL runs SUM/PROD/MIN/MAX as a cudaMemcpyAsync at the
    # call, inside the group or not (src/enqueue.cc taskAppend: "single rank communicators,
    # collectives are issued as ncclMemcpyAsyncs"; seen on the H100: the copy ran though
    # group_end failed); AVG (PreMulSum) is a task of the group, as every op is at world size > 1
    comm.allreduce(src, dst, lib.redop(ac.ReduceOp.AVG), stream=stream.cuda_stream)
    lib.poison_group(comm, src, stream.cuda_stream, 1)  # a send to rank 1 of 1
    try:
        lib.group_end()
        end = "returned"
    except Exception as exc:  # noqa: BLE001 - expected: the group's error
        end = f"{type(exc).__name__}: {exc}"
    stream.synchronize()
    torch.cuda.synchronize()
    ran = bool(dst.any())
    abort_quietly(comm)
    return {"group_end": end, "ran": ran}


# =================================================================== init, close
async def init_close_cycles(comm: Any) -> dict[str, Any]:
    """Communicators made, used and closed, again and again: no thread left, and no memory
    that grows with the cycles. The first cycle is the baseline: on the H100 a fixed
    512-byte block and the first op's freed input moved ``memory_allocated`` once
    (-88576, +512 in two runs), which is no leak; one that grows per cycle is."""
    from tests.support.ports import unused_port

    await comm.all_reduce(torch.ones(4, device=DEV))

    async def cycle() -> None:
        async with ac.init(
            backend="nccl",
            rank=0,
            world_size=1,
            master_addr="127.0.0.1",
            master_port=unused_port(),
            device=DEV,
        ) as c:
            t = torch.ones(1024, device=DEV)
            await c.all_reduce(t)
            await c.barrier()
            del t

    def settled() -> int:
        gc.collect()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated(DEV)

    threads0 = threading.active_count()
    await cycle()
    mem0 = settled()
    for _ in range(4):
        await cycle()
    return {"threads": threading.active_count() - threads0, "mem": settled() - mem0}


async def local_rank_device(ctx: RankContext) -> str:
    os.environ["LOCAL_RANK"] = "0"
    try:
        async with ac.init(backend="nccl", rank=0, world_size=1, store=ctx.store) as c:
            return f"{c.device} {c.backend}"
    finally:
        del os.environ["LOCAL_RANK"]


# ======================================================================== split
async def split_on_gpu(ctx: RankContext, rounds: int = 7) -> dict[str, Any]:
    """``comm.split`` on real NCCL at world size 1: a child made by one ``ncclCommSplit``
    that runs ops and coalesced groups; a rank in no group gets None (NCCL_SPLIT_NOCOLOR)
    and its parent goes on; a child outlives its parent aborted; nothing is left. And what
    a split and its first op cost, beside torch's ``split_group`` (ncclCommSplit too) and
    ``new_group`` (a fresh init) in the same process."""
    kw: dict[str, Any] = dict(rank=0, world_size=1, store=ctx.store, device=DEV, timeout=60)
    warm = await ac.init("nccl", **kw)  # process-wide services exist from here on
    await warm.all_reduce(torch.ones(4, device=DEV))
    await warm.close()
    before = our_threads(ctx.rank)
    comm: Any = await ac.init("nccl", **kw)
    lib = comm.backends["cuda"].handle.lib
    calls: list[tuple[Any, int]] = []
    real_split = lib.split

    def counted(parent: Any, color: int | None, key: int) -> Any:
        calls.append((color, key))
        return real_split(parent, color, key)

    lib.split = counted  # (this process's NcclLib: the rank process's only communicators)
    res: dict[str, Any] = {}
    try:
        sub: Any = await asyncio.wait_for(comm.split([[0]]), 60)
        parent_nc = comm.backends["cuda"].handle.communicator
        child_nc = sub.backends["cuda"].handle.communicator
        res["sub"] = [sub.rank, sub.world_size, sub.backend, str(sub.device)]
        res["own_nccl"] = child_nc is not None and int(child_nc.ptr) != int(parent_nc.ptr)
        x = torch.arange(1 << 16, device=DEV, dtype=torch.float32)
        avg = await asyncio.wait_for(sub.all_reduce(x.clone(), ac.ReduceOp.AVG), 30)
        gathered = torch.zeros_like(x)
        await asyncio.wait_for(sub.all_gather(gathered, x), 30)
        a, b = x.clone(), torch.full((8,), 5.0, device=DEV)
        async with sub.coalescing():
            w1 = sub.all_reduce(a, ac.ReduceOp.MAX)
            w2 = sub.broadcast(b, 0)
        await asyncio.wait_for(asyncio.gather(w1, w2), 30)
        res["ops_exact"] = bool(
            torch.equal(avg, x) and torch.equal(gathered, x) and torch.equal(a, x)
        ) and bool((b == 5).all())
        none = await asyncio.wait_for(comm.split([]), 60)  # this rank in no group
        res["none"] = none is None
        p = await asyncio.wait_for(comm.all_reduce(torch.full((4,), 2.0, device=DEV)), 30)
        res["parent_after"] = p.tolist()
        res["calls"] = list(calls)

        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            s: Any = await comm.split([[0]])
            await s.all_reduce(torch.ones(4, device=DEV))
            times.append((time.perf_counter() - t0) * 1e3)
            await s.close()
        res["split_ms"] = times

        other: Any = await asyncio.wait_for(comm.split([[0]]), 60)
        comm.abort("the test aborts the parent")
        y = await asyncio.wait_for(other.all_reduce(torch.full((4,), 3.0, device=DEV)), 30)
        res["child_after_abort"] = y.tolist()
        try:
            await asyncio.wait_for(comm.split([[0]]), 30)
            res["split_of_aborted"] = "returned"
        except ac.CommAborted:
            res["split_of_aborted"] = "CommAborted"
        await other.close()
        await sub.close()
        await comm.close()
    finally:
        lib.split = real_split
    res["threads_left"] = await threads_gone(before, ctx.rank)
    res["torch"] = _torch_split_cost(rounds)
    return res


def _torch_split_cost(rounds: int) -> dict[str, Any]:
    """torch's ``split_group`` and ``new_group`` at world size 1, each with its first op."""
    import tempfile

    import torch.distributed as dist

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=DEV)
        try:
            dist.all_reduce(torch.ones(4, device=DEV))
            torch.cuda.synchronize()
            for name, make in (
                ("split_group_ms", lambda: dist.split_group(split_ranks=[[0]])),
                ("new_group_ms", lambda: dist.new_group([0])),
            ):
                times = []
                try:
                    for _ in range(rounds):
                        t0 = time.perf_counter()
                        g = make()
                        dist.all_reduce(torch.ones(4, device=DEV), group=g)
                        torch.cuda.synchronize()
                        times.append((time.perf_counter() - t0) * 1e3)
                        dist.destroy_process_group(g)
                    out[name] = times
                except Exception as exc:  # noqa: BLE001 - reported beside ours
                    out[name] = f"{type(exc).__name__}: {exc}"
        finally:
            dist.destroy_process_group()
    return out


# =================================================================== host cost
async def host_cost(ctx: RankContext, iters: int) -> list[dict[str, Any]]:
    """bench.gpu's measures of asynccoll (asyncio) and torch's ProcessGroupNCCL, here, now: the
    better of two alternated rounds of each."""
    root = str(Path(__file__).resolve().parents[2])  # the repository, for bench/
    if root not in sys.path:
        sys.path.insert(0, root)
    from bench import gpu as bench_gpu

    torch.cuda.set_device(DEV)
    rounds: list[list[dict[str, Any]]] = [[], []]
    for _ in range(2):  # alternated: a burst of load elsewhere on the machine hits both
        rounds[0].append(await bench_gpu.measure_asynccoll(iters, 8, "asynccoll asyncio"))
        rounds[1].append(bench_gpu.measure_torch(iters, 8))
    return [min(r, key=lambda row: row["issue_wall_us"]) for r in rounds]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "stall":
        print("RESULT " + json.dumps(_loop_stall_main(sys.argv[2])), flush=True)
    else:
        sys.exit(f"usage: {sys.argv[0]} stall asyncio|uvloop")
