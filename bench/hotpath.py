"""Where the time of one small ``await comm.all_reduce(t)`` goes (Gloo, 2 ranks).

    python -m bench.hotpath [--loop uvloop|asyncio] [--quick|--smoke] [--json PATH]

Nothing in the library is changed: this script times library pieces from outside.
By default every variant runs on one Gloo group (asynccoll through ``ac.wrap`` of the
default group's Gloo backend), so only the Python paths differ (see ``bench/run.py``).

A. Issue side, each step alone, uninstrumented (median over repeats of the mean
   per call of a batch): validation (tensor, backend lookup, reduce op, OpSpec),
   ``Work()``, ``ledger.reserve`` and ``ledger.commit`` (deadline add) under the
   ledger lock, the torch ``pg.allreduce`` call, the whole ``comm.all_reduce()``
   call; for comparison ``dist.all_reduce(async_op=True)`` and a few primitives.

B. Completion side, one op in flight at a time, a timeline stamped with
   ``perf_counter_ns`` by wrappers installed on this process's objects (the
   completion thread's wait function, ``ledger.succeed_all``, ``Wakeups.deliver``
   and the wake-ups it posts): issue returns -> the completion thread's ``wait()``
   returns -> ``succeed_all`` -> ``deliver`` -> the loop runs the wake-ups -> the
   task resumes.
   The floor bridge and torch's blocking ``wait()`` are stamped alike, the three
   alternating op by op.

D. asynccoll side by side with the floor, a floor without a waiter thread
   (``get_future()`` callback) and torch (``variants``).

C. cProfile of the event-loop thread over a run of awaited small all_reduces:
   the top functions by own time (bench/results/hotpath_<loop>_profile.txt).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench._common import (
    FloorBridge,
    machine,
    median,
    orders,
    pct,
    progress,
    run_loop,
    spawn,
    store_server,
)

ns = time.perf_counter_ns


def per_call_us(fn: Callable[[int], Any], n: int, reps: int) -> float:
    """Median over ``reps`` of the mean time per call when ``fn(n)`` runs a batch of ``n``."""
    out = []
    for _ in range(reps):
        out.append(fn(n) / n / 1e3)
    return statistics.median(out)


async def issue_side(comm: Any, dist: Any, n: int, reps: int) -> dict[str, float]:
    import queue

    import torch

    from asynccoll._base.ops import OpKind, OpSpec, ReduceOp
    from asynccoll._core import validate
    from asynccoll._core.work import Work

    t = torch.zeros(2)
    backend = comm._specs.backend_for(t)
    ledger = comm.ledger
    pg, opts = backend._pg, backend._sum_opts
    loop = asyncio.get_running_loop()
    res: dict[str, float] = {}

    def validation(k: int) -> int:
        t0 = ns()
        for _ in range(k):
            x = validate.tensor(t, "tensor")
            b = comm._specs.backend_for(x)
            spec = OpSpec(
                OpKind.ALL_REDUCE, x, reduce_op=validate.reduce_op(ReduceOp.SUM, x.dtype, b.caps)
            )
            spec.timeout = comm.timeout
        return ns() - t0

    def work_new(k: int) -> int:
        t0 = ns()
        for i in range(k):
            Work("all_reduce", i, t, t)
        return ns() - t0

    stamps: dict[str, int] = {}

    def reserve_commit(k: int) -> int:
        with ledger.lock:
            t0 = ns()
            works = [ledger.reserve("all_reduce", t, t) for _ in range(k)]
            t1 = ns()
            for w in works:
                ledger.commit(w, 60.0)
            t2 = ns()
            ledger.discard(works)  # never issued: seqs given back, deadlines dead
        stamps["reserve"], stamps["commit"] = t1 - t0, t2 - t1
        return t2 - t0

    def split(name: str) -> Callable[[int], int]:
        def fn(k: int) -> int:
            reserve_commit(k)
            return stamps[name]

        return fn

    res["validate (tensor, backend, reduce_op, OpSpec)"] = per_call_us(validation, n, reps)
    res["Work() alone"] = per_call_us(work_new, n, reps)
    res["ledger.reserve (Work + pending)"] = per_call_us(split("reserve"), n, reps)
    res["ledger.commit (deadline add)"] = per_call_us(split("commit"), n, reps)

    async def batch(k: int, issue: Callable[[], Any], wait: Callable[[Any], Any]) -> int:
        t0 = ns()
        handles = [issue() for _ in range(k)]
        dt = ns() - t0
        for h in handles:
            await wait(h)
        return dt

    async def torch_wait(h: Any) -> None:
        h.wait()

    async def ac_wait(h: Any) -> None:
        await h

    async def per_call_async(issue: Callable[[], Any], wait: Callable[[Any], Any]) -> float:
        out = []
        for _ in range(reps):
            dist.barrier()
            out.append(await batch(n, issue, wait) / n / 1e3)
        return statistics.median(out)

    res["pg.allreduce call (backend submit core)"] = await per_call_async(
        lambda: pg.allreduce([t], opts), torch_wait
    )
    res["comm.all_reduce() call, whole issue"] = await per_call_async(
        lambda: comm.all_reduce(t), ac_wait
    )
    res["dist.all_reduce(async_op=True) call"] = await per_call_async(
        lambda: dist.all_reduce(t, async_op=True), torch_wait
    )
    dtor = []
    for _ in range(reps):
        dist.barrier()
        tws = [pg.allreduce([t], opts) for _ in range(n)]
        for tw in tws:
            tw.wait()
        t0 = ns()
        while tws:
            tws.pop()
        dtor.append((ns() - t0) / n / 1e3)
    res["torch Work destructor (after wait)"] = statistics.median(dtor)
    q: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def put(k: int) -> int:
        t0 = ns()
        for _ in range(k):
            q.put(t)
        dt = ns() - t0
        while not q.empty():
            q.get_nowait()
        return dt

    def lock_new(k: int) -> int:
        t0 = ns()
        for _ in range(k):
            threading.Lock()
        return ns() - t0

    def future_new(k: int) -> int:
        t0 = ns()
        for _ in range(k):
            loop.create_future()
        return ns() - t0

    def monotonic(k: int) -> int:
        m = time.monotonic
        t0 = ns()
        for _ in range(k):
            m()
        return ns() - t0

    res["primitive: SimpleQueue.put"] = per_call_us(put, n, reps)
    res["primitive: threading.Lock()"] = per_call_us(lock_new, n, reps)
    res["primitive: loop.create_future()"] = per_call_us(future_new, n, reps)
    res["primitive: time.monotonic()"] = per_call_us(monotonic, n, reps)
    return res


class Timeline:
    """Stamps of the op in flight (one at a time), by step name."""

    def __init__(self) -> None:
        self.cur: dict[str, int] = {}

    def mark(self, name: str) -> None:
        self.cur.setdefault(name, ns())


def instrument(comm: Any, tl: Timeline) -> None:
    """Wrap this process's objects (not the library's code) so each step stamps ``tl``."""
    from asynccoll._core import wakeups as wake_mod

    backend = comm._cpu_backend
    ledger = comm.ledger
    from asynccoll._backends import torch_pg

    def timed_wait(tw: Any) -> None:
        tw.wait()
        tl.mark("wait_ret")

    old = backend._waiter
    new = backend._completer("asynccoll-gloo-waiter")
    new._wait = timed_wait  # read once when its thread starts (on the first watch)
    backend._waiter = new
    old.stop()
    assert torch_pg  # the backend whose completion thread is wrapped

    orig_succeed_all = ledger.succeed_all

    def succeed_all(targets: Any) -> None:
        tl.mark("succeed_in")
        orig_succeed_all(targets)
        tl.mark("succeed_out")

    ledger.succeed_all = succeed_all
    orig_deliver, orig_run_all = wake_mod.Wakeups.deliver, wake_mod._run_all

    def deliver(self: Any) -> None:
        tl.mark("post")
        orig_deliver(self)

    def run_all(items: Any) -> None:
        tl.mark("drain")
        orig_run_all(items)

    wake_mod.Wakeups.deliver = deliver  # type: ignore[method-assign]
    wake_mod._run_all = run_all


STEPS_AC = [
    ("issue: comm.all_reduce() returns", "t0", "ret"),
    ("issue return -> completion thread's wait() returns", "ret", "wait_ret"),
    ("wait() returns -> ledger.succeed_all entered", "wait_ret", "succeed_in"),
    ("succeed_all: settle -> Wakeups.deliver", "succeed_in", "post"),
    ("deliver (call_soon_threadsafe) -> the loop runs the wake-ups", "post", "drain"),
    ("wake-ups (fut result) -> task resumed", "drain", "resume"),
    ("total", "t0", "resume"),
]
STEPS_FLOOR = [
    ("issue: dist.all_reduce + queue.put", "t0", "ret"),
    ("issue return -> waiter thread's wait() returns", "ret", "wait_ret"),
    ("wait() returns -> call_soon_threadsafe callback runs on the loop", "wait_ret", "cb"),
    ("callback (set_result) -> task resumed", "cb", "resume"),
    ("total", "t0", "resume"),
]
STEPS_TORCH = [
    ("issue: dist.all_reduce(async_op=True) returns", "t0", "ret"),
    ("issue return -> wait() returns (main thread)", "ret", "end"),
    ("total", "t0", "end"),
]


async def completion_side(comm: Any, dist: Any, group: Any, n: int) -> dict[str, Any]:
    import torch

    tl = Timeline()
    instrument(comm, tl)
    loop = asyncio.get_running_loop()
    floor_tl: dict[str, int] = {}
    import queue

    q: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def mark_set(fut: asyncio.Future[Any]) -> None:
        floor_tl.setdefault("cb", ns())
        fut.set_result(None)

    def floor_thread() -> None:  # the floor bridge, stamped
        while True:
            tw, fut = q.get()
            if tw is None:
                return
            tw.wait()
            floor_tl.setdefault("wait_ret", ns())
            loop.call_soon_threadsafe(mark_set, fut)
            del tw, fut

    th = threading.Thread(target=floor_thread, daemon=True)
    th.start()
    t = torch.zeros(2)
    samples: dict[str, list[dict[str, int]]] = {"asynccoll": [], "floor": [], "torch": []}
    modes = ("asynccoll", "floor", "torch")
    dist.barrier()
    for i, order in enumerate(orders(modes, n + n // 10, seed=3)):
        for mode in order:
            if mode == "asynccoll":
                tl.cur = {}
                t0 = ns()
                w = comm.all_reduce(t)
                ret = ns()
                await w
                resume = ns()
                s = {"t0": t0, "ret": ret, "resume": resume, **tl.cur}
            elif mode == "floor":
                floor_tl.clear()
                t0 = ns()
                fut = loop.create_future()
                q.put((dist.all_reduce(t, group=group, async_op=True), fut))
                ret = ns()
                await fut
                resume = ns()
                s = {"t0": t0, "ret": ret, "resume": resume, **floor_tl}
            else:
                t0 = ns()
                tw = dist.all_reduce(t, async_op=True)
                ret = ns()
                tw.wait()
                s = {"t0": t0, "ret": ret, "end": ns()}
            if i >= n // 10:
                samples[mode].append(s)
    q.put((None, None))
    th.join(5)
    out: dict[str, Any] = {}
    for mode, steps in (("asynccoll", STEPS_AC), ("floor", STEPS_FLOOR), ("torch", STEPS_TORCH)):
        rows = []
        full = [s for s in samples[mode] if all(a in s and b in s for _, a, b in steps)]
        for name, a, b in steps:
            d = [(s[b] - s[a]) / 1e3 for s in full]
            rows.append({"step": name, "median_us": median(d), "p10_us": pct(d, 0.1)})
        out[mode] = {"steps": rows, "ops": len(samples[mode]), "slow_path_ops": len(full)}
    return out


async def variants(
    comm: Any,
    dist: Any,
    floor: FloorBridge,
    future_group: Any,
    n: int,
    nbytes: int = 8,
) -> dict[str, Any]:
    """Latency of candidate cuts, built from outside the library, op by op in a rotating order.

    asynccoll         as shipped (the two cuts this section first measured — one plain
                      ``call_soon_threadsafe`` per burst instead of ``streams.LoopWaker``, and
                      a leaner completion loop — are in the library now)
    floor             the thread bridge (``_common.FloorBridge``)
    floor_future      no waiter thread: ``work.get_future()``'s done-callback (on Gloo's own
                      thread) calls ``loop.call_soon_threadsafe(fut.set_result, None)``
    torch             ``dist.all_reduce(t, async_op=True).wait()``

    Each variant runs on a Gloo group of its own (see ``FloorBridge``).
    """
    import torch

    loop = asyncio.get_running_loop()
    t = torch.zeros(max(1, nbytes // 4))

    async def asynccoll() -> None:
        await comm.all_reduce(t)

    async def floor_op() -> None:
        await floor.all_reduce(t)

    async def floor_future() -> None:
        fut = loop.create_future()
        dist.all_reduce(t, group=future_group, async_op=True).get_future().add_done_callback(
            lambda _f: loop.call_soon_threadsafe(fut.set_result, None)
        )
        await fut

    async def torch_op() -> None:
        dist.all_reduce(t, async_op=True).wait()

    fns = {
        "asynccoll": asynccoll,
        "floor": floor_op,
        "floor_future": floor_future,
        "torch": torch_op,
    }
    modes = tuple(fns)
    samples: dict[str, list[float]] = {m: [] for m in modes}
    dist.barrier()
    for i, order in enumerate(orders(modes, n + n // 10, seed=5)):
        for m in order:
            t0 = ns()
            await fns[m]()
            if i >= n // 10:
                samples[m].append((ns() - t0) / 1e3)
    out: dict[str, Any] = {}
    for m in modes:
        out[m] = {"median_us": median(samples[m]), "p10_us": pct(samples[m], 0.1)}
    for m in modes:
        for q in ("median_us", "p10_us"):
            out[m][f"vs_floor_{q[:-3]}"] = out[m][q] / out["floor"][q]
    return out


def profile_loop(comm: Any, n: int) -> Any:
    async def body() -> None:
        import torch

        t = torch.zeros(2)
        for _ in range(n):
            await comm.all_reduce(t)

    return body


def _rank(
    rank: int, world_size: int, port: int, loop: str, n_issue: int, n_timeline: int, groups: str
) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        import asynccoll as ac

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("torch/", store), rank=rank, world_size=world_size
        )
        if groups == "shared":  # every variant on the default group's one Gloo backend
            gloo = dist.group.WORLD._get_backend(torch.device("cpu"))
            comm = ac.wrap(gloo, timeout=60.0)
            floor_group = fgroup = None
        else:
            comm = await ac.init(
                "gloo", rank=rank, world_size=world_size, store=dist.PrefixStore("ac/", store)
            )
            floor_group, fgroup = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
        say = progress if rank == 0 else (lambda _m: None)
        floor = FloorBridge(loop, floor_group)
        res: dict[str, Any] = {}
        try:
            say("hot path A: issue-side steps, uninstrumented")
            res["issue"] = await issue_side(comm, dist, 200, max(3, n_issue))
            say("hot path C: cProfile of the loop thread")
            prof = cProfile.Profile()
            dist.barrier()
            prof.enable()
            await profile_loop(comm, n_timeline)()
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            res["profile"] = buf.getvalue()
            say("hot path D: candidate cuts, measured side by side")
            res["variants"] = await variants(comm, dist, floor, fgroup, n_timeline)
            res["variants_2MB"] = await variants(
                comm, dist, floor, fgroup, max(10, n_timeline // 15), 2 << 20
            )
            say("hot path B: completion-side timeline (instrumented)")
            res["timeline"] = await completion_side(comm, dist, floor.group, n_timeline)
        finally:
            floor.close()
            dist.barrier()
            await comm.close()
            dist.destroy_process_group()
        return res

    return run_loop(loop, main)


def tables(res: dict[str, Any]) -> str:
    head = (
        f"asynccoll small all_reduce (8 B) hot path, Gloo, 2 ranks, loop {res['loop']}, "
        f"groups {res['groups']} (rank 0)"
    )
    out = [head]
    out.append("\nA. issue side, each step alone (median of the mean per call, batches of 200)")
    for name, us in res["issue"].items():
        out.append(f"  {name:<52} {us:>8.2f} us")
    out.append(
        "\nB. completion side, one op in flight, steps stamped with perf_counter_ns, modes shuffled op by op"
    )
    for mode, title in (
        ("asynccoll", "asynccoll"),
        ("floor", "floor bridge"),
        ("torch", "torch blocking wait()"),
    ):
        m = res["timeline"][mode]
        out.append(f"  {title} ({m['slow_path_ops']} of {m['ops']} ops went through every step)")
        out.append(f"    {'step':<66} {'median us':>10} {'p10 us':>8}")
        for row in m["steps"]:
            out.append(f"    {row['step']:<66} {row['median_us']:>10.1f} {row['p10_us']:>8.1f}")
    for key, what in (("variants", "8 B"), ("variants_2MB", "2 MiB")):
        out.append(
            f"\nD. asynccoll beside the floors and torch, one all_reduce of {what}, alternating op by op"
        )
        out.append(
            f"    {'variant':<14} {'median us':>10} {'p10 us':>8} {'/floor med':>11} {'/floor p10':>11}"
        )
        for m, row in res[key].items():
            out.append(
                f"    {m:<14} {row['median_us']:>10.1f} {row['p10_us']:>8.1f} {row['vs_floor_median']:>11.3f} "
                f"{row['vs_floor_p10']:>11.3f}"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default="uvloop")
    ap.add_argument(
        "--groups",
        choices=("shared", "own"),
        default="shared",
        help="shared: every variant on one Gloo group (asynccoll via ac.wrap); own: one group each",
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default=None, help="default bench/results/hotpath_<loop>.json")
    args = ap.parse_args(argv)
    n_issue, n_tl = (3, 60) if args.smoke else ((7, 500) if args.quick else (15, 3000))
    before = machine()
    server = store_server()
    results = spawn(_rank, (2, server.port, args.loop, n_issue, n_tl, args.groups), 2)
    del server
    res = {
        "loop": args.loop,
        "groups": args.groups,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": before,
        "machine_after": machine(),
        **results[0],
    }
    print(tables(res))
    suffix = "" if args.groups == "shared" else "_own"
    path = Path(args.json or f"bench/results/hotpath_{args.loop}{suffix}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    prof = res.pop("profile")
    path.write_text(json.dumps(res, indent=2))
    path.with_name(path.stem + "_profile.txt").write_text(prof)
    print(f"\nwrote {path} and {path.stem}_profile.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
