"""Fault-handling benchmark: abort latency, failure detection, recovery by shrink.

    python bench/faults.py [--quick] [--only NAME ...] [--json bench/results/faults.json]

Ranks are started here on this machine (forkserver: torch is imported once); this
process hosts the TCPStore, so the store outlives any rank that dies. Each scenario
runs in fresh processes and is repeated; the median and the worst run are
reported. Times across processes are wall-clock (``time.time()``) on one machine.

* **abort**: a rank issues 1000 all_reduces its peer never joins, 1000 tasks await
  them, then ``comm.abort()`` is called on the loop, from another thread, or from
  a signal handler (``signal.signal``, the handler runs on the main thread between
  bytecodes): time until the last task has caught ``CommAborted`` (goal: <= 5 ms).
* **peer death**, 3 ranks all-reducing in a loop; rank 2 records ``time.time()`` in
  the store and then dies (``two_killed``: 4 ranks, ranks 2 and 3 die together):
  - asynccoll, Gloo default (``heartbeat=None``): killed with ``os._exit``; Gloo
    reports the closed connection, the census names the rank (goal: death ->
    ``PeerFailure([2])`` on every survivor <= 0.1 s);
  - asynccoll, ``heartbeat=0.2``: frozen with SIGSTOP (its sockets stay open, so
    Gloo sees nothing); detected after 3 silent beats;
  for both: death -> ``shrink()`` done (3 -> 2) -> first all_reduce on the new
  communicator done (goal: <= 0.5 s); ``settle``/``build`` split the shrink into
  choosing the excluded set and building the new communicator (its Gloo group);
  - torch.distributed Gloo (``init_process_group`` over the same kind of store),
    killed and frozen: death -> ``all_reduce(async_op=True).wait()`` raises. torch
    does not name the rank and has no shrink for Gloo.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import re
import signal
import statistics
import sys
import threading
import time
from datetime import timedelta
from typing import Any

# This checkout's asynccoll, in this process and (through sys.path) in the ranks.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench._common import last_waiter_after, write_json  # noqa: E402 - after the path

HOST = "127.0.0.1"
VICTIM = 2  # the rank that dies in the 3-rank scenarios
HEARTBEAT = 0.2  # the heartbeat interval of the detection scenario
TORCH_FROZEN_TIMEOUT = 5.0  # torch's op timeout in its frozen-peer scenario
WARMUP = 20


def _client(port: int, prefix: str) -> Any:
    import torch.distributed as dist

    store = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=60))
    return dist.PrefixStore(prefix, store)


async def _poll(store: Any, key: str, seconds: float = 60.0) -> None:
    """Wait for ``key`` without a blocking store wait (that would stall the comm's heartbeats)."""
    end = time.monotonic() + seconds
    while not store.check([key]):
        if time.monotonic() > end:
            raise TimeoutError(f"store key {key!r} did not appear")
        await asyncio.sleep(0.005)


# ------------------------------------------------------------------- abort
ABORT_FROM = ("loop", "thread", "signal")


async def _abort_once(comm: Any, waiters: int, where: str) -> tuple[float, float]:
    """Abort with ``waiters`` tasks parked on pending Works: (to the last ``CommAborted``, the call)."""
    import torch

    import asynccoll as ac

    calls: list[float] = []

    def abort(*_: Any) -> None:
        start = time.perf_counter()
        comm.abort("bench")
        calls.append(time.perf_counter() - start)

    thread = threading.Thread(target=abort)

    def start_abort() -> None:
        if where == "thread":
            thread.start()
        elif where == "signal":
            os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs on this thread at once
        else:
            abort()

    works = [comm.all_reduce(torch.ones(4)) for _ in range(waiters)]  # the peer never joins
    if where == "signal":
        old = signal.signal(signal.SIGUSR1, abort)
    last = await last_waiter_after(works, start_abort, ac.CommAborted)
    if where == "thread":
        thread.join()
    if where == "signal":
        signal.signal(signal.SIGUSR1, old)
    return last, calls[0]


async def _abort(rank: int, store: Any, reps: int, waiters: int) -> list[dict[str, Any]]:
    import asynccoll as ac

    rows = []
    for rep in range(reps):
        for where in ABORT_FROM:
            key = f"abort/{rep}/{where}"
            comm = await ac.init("gloo", rank=rank, world_size=2, store=store, timeout=60)
            if rank == 1:  # joins nothing; the abort reaches it as news through the store
                await _poll(store, key)
                await comm.close()
                continue
            last, call = await _abort_once(comm, waiters, where)
            rows.append({"from": where, "abort_call_ms": call * 1e3, "last_waiter_ms": last * 1e3})
            store.set(key, "1")
            await comm.close()
    return rows


# --------------------------------------------------------------- peer death
def _doom(store: Any, how: str, delay: float = 0.3) -> None:
    """In ``delay`` seconds, from a thread: record the time, then die (``exit``) or freeze (``stop``)."""

    def later() -> None:
        time.sleep(delay)
        store.compare_set("died_at", "", repr(time.time()))  # the first death, with two
        sys.stdout.flush()
        if how == "exit":
            os._exit(1)
        os.kill(os.getpid(), signal.SIGSTOP)

    threading.Thread(target=later, daemon=True).start()


async def _asynccoll_death(rank: int, store: Any, params: dict[str, Any]) -> dict[str, Any]:
    import torch

    import asynccoll as ac
    from asynccoll._bootstrap.init import init_with

    how, heartbeat = params["how"], params["heartbeat"]
    marks, factories = _instrument()
    world, victims = params.get("world", 3), params.get("victims", [VICTIM])
    comm = await init_with(
        factories, "gloo", rank=rank, world_size=world, store=store, timeout=30, heartbeat=heartbeat
    )
    t = torch.ones(256)
    for _ in range(WARMUP):
        await comm.all_reduce(t)
    await comm.barrier()
    if rank in victims:
        _doom(store, how)
    try:
        while True:
            await comm.all_reduce(t)
    except ac.PeerFailure as failure:
        detected, ranks = time.time(), list(failure.ranks)
    new = await comm.shrink()
    shrunk = time.time()
    one = torch.ones(4)
    await new.all_reduce(one)
    resumed = time.time()
    size = world - len(victims)
    assert new.world_size == size and one.tolist() == [float(size)] * 4, one
    died = float(store.get("died_at"))
    await new.close()
    # The old communicator is left to process exit: its Gloo group still holds the op
    # that the lost peer never finished, and releasing it waits for Gloo's timeout.
    return {
        "ranks": ranks,
        "detect_ms": (detected - died) * 1e3,
        "settle_ms": (marks["settled"] - died) * 1e3,
        "gloo_build_ms": marks["gloo"] * 1e3,
        "shrink_ms": (shrunk - died) * 1e3,
        "resume_ms": (resumed - died) * 1e3,
    }


def _instrument() -> tuple[dict[str, float], Any]:
    """Time inside shrink: when the excluded set is settled, how long the Gloo group takes
    (the backend factories to pass to ``init_with``)."""
    import asynccoll._bootstrap.build as init_mod
    import asynccoll._faults.shrink as shrink_mod

    marks: dict[str, float] = {}
    # (_settle since the census record; before that, shrink called agree(): the
    # same bench then measures the previous commit for a before/after table.)
    name = "_settle" if hasattr(shrink_mod, "_settle") else "agree"
    settle, gloo = getattr(shrink_mod, name), init_mod.Factories().gloo

    def timed_settle(*args: Any) -> Any:
        out = settle(*args)
        marks["settled"] = time.time()
        return out

    def timed_gloo(*args: Any) -> Any:
        start = time.perf_counter()
        out = gloo(*args)
        marks["gloo"] = time.perf_counter() - start
        return out

    setattr(shrink_mod, name, timed_settle)
    return marks, init_mod.Factories(gloo=timed_gloo)


def _torch_death(rank: int, store: Any, how: str, timeout: float) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("torch/", store),
        rank=rank,
        world_size=3,
        timeout=timedelta(seconds=timeout),
    )
    t = torch.ones(256)
    for _ in range(WARMUP):
        dist.all_reduce(t)
    dist.barrier()
    if rank == VICTIM:
        _doom(store, how)
    try:
        while True:
            dist.all_reduce(t, async_op=True).wait()
    except RuntimeError as exc:  # torch's DistBackendError is one
        # Gloo's message starts with its source location: keep what follows.
        text = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).splitlines()[0])
        detected, error = time.time(), f"{type(exc).__name__}: {text[:80]}"
    died = float(store.get("died_at"))
    return {"detect_ms": (detected - died) * 1e3, "error": error}


# ------------------------------------------------------------------ ranks
def _rank(
    scenario: str, rank: int, port: int, prefix: str, params: dict[str, Any], conn: Any
) -> None:
    import torch

    torch.set_num_threads(1)
    store = _client(port, prefix)
    try:
        if scenario == "abort":
            result: Any = asyncio.run(_abort(rank, store, params["reps"], params["waiters"]))
        elif scenario == "asynccoll":
            result = asyncio.run(_asynccoll_death(rank, store, params))
        else:
            result = _torch_death(rank, store, params["how"], params["timeout"])
        conn.send(("ok", result))
    except BaseException as exc:  # report, then exit non-zero
        import traceback

        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from exc
    conn.close()
    if scenario != "abort":
        os._exit(0)  # a Gloo group broken by a lost peer may wait for its timeout in teardown


class Launcher:
    """Hosts the store and starts each scenario's ranks in fresh processes."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "torch.distributed", "asynccoll"])
        self.store = dist.TCPStore(
            HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self.runs = 0

    def run(
        self,
        scenario: str,
        world_size: int,
        params: dict[str, Any],
        lost: tuple[int, ...] = (),
        limit: float = 120,
    ) -> list[Any]:
        """Each surviving rank's result (``None`` for the ranks in ``lost``)."""
        self.runs += 1
        pipes, procs = [], []
        for r in range(world_size):
            parent, child = self.ctx.Pipe(duplex=False)
            p = self.ctx.Process(
                target=_rank,
                args=(scenario, r, self.store.port, f"run{self.runs}/", params, child),
                daemon=True,
            )
            p.start()
            child.close()
            pipes.append(parent)
            procs.append(p)
        results: list[Any] = [None] * world_size
        started = time.monotonic()
        try:
            deadline = time.monotonic() + limit
            for r, conn in enumerate(pipes):
                if r in lost:
                    continue
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"{scenario}: rank {r} did not answer within {limit} s")
                status, payload = conn.recv()
                if status != "ok":
                    raise RuntimeError(f"{scenario}: rank {r} failed:\n{payload}")
                results[r] = payload
        finally:
            for r in lost:
                procs[r].kill()  # SIGKILL ends a stopped process too
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join()
            print(
                f"  {scenario} {params}: {time.monotonic() - started:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        return results


# --------------------------------------------------------------- driver
WAITERS = 1000
SCENARIOS = (
    "asynccoll_gloo_killed",
    "asynccoll_gloo_two_killed",
    "asynccoll_heartbeat_frozen",
    "torch_gloo_killed",
    "torch_gloo_frozen",
)


def _stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst of every ``*_ms`` figure over ``rows``."""
    keys = [k for k in rows[0] if k.endswith("_ms")]
    return {
        k: {"median": statistics.median(r[k] for r in rows), "worst": max(r[k] for r in rows)}
        for k in keys
    }


def run(quick: bool = False, only: tuple[str, ...] = ()) -> dict[str, Any]:
    reps = 3 if quick else 7
    launcher = Launcher()
    res: dict[str, Any] = {"reps": reps, "heartbeat_s": HEARTBEAT, "waiters": WAITERS}

    if not only or "abort" in only:
        rows = launcher.run("abort", 2, {"reps": reps, "waiters": WAITERS})[0]
        res["abort"] = {
            where: dict(
                _stats([r for r in rows if r["from"] == where]),
                runs=[r for r in rows if r["from"] == where],
            )
            for where in ABORT_FROM
        }

    scenarios: dict[str, tuple[str, dict[str, Any], int]] = {
        "asynccoll_gloo_killed": ("asynccoll", {"how": "exit", "heartbeat": None}, reps),
        "asynccoll_gloo_two_killed": (
            "asynccoll",
            {"how": "exit", "heartbeat": None, "world": 4, "victims": [2, 3]},
            reps,
        ),
        "asynccoll_heartbeat_frozen": ("asynccoll", {"how": "stop", "heartbeat": HEARTBEAT}, reps),
        "torch_gloo_killed": ("torch", {"how": "exit", "timeout": 60.0}, reps),
        "torch_gloo_frozen": (
            "torch",
            {"how": "stop", "timeout": TORCH_FROZEN_TIMEOUT},
            1 if quick else 2,
        ),
    }
    res["death"] = {}
    for name, (kind, params, n) in scenarios.items():
        if only and name not in only:
            continue
        runs = []
        for _ in range(n):
            victims = tuple(params.get("victims", [VICTIM]))
            results = launcher.run(kind, params.get("world", 3), params, lost=victims)
            survivors = [r for r in results if r is not None]
            # Per repetition: the survivor that got there last (every survivor has recovered).
            last = {k: max(s[k] for s in survivors) for k in survivors[0] if k.endswith("_ms")}
            last["ranks"] = sorted({r for s in survivors for r in s.get("ranks", [])})
            last["error"] = survivors[0].get("error")
            runs.append(last)
        row: dict[str, Any] = _stats(runs)
        row.update(
            params=params,
            ranks=sorted({r for run in runs for r in run["ranks"]}),
            error=runs[0]["error"],
            runs=runs,
        )
        res["death"][name] = row
    return res


def _ms(row: dict[str, Any], key: str) -> str:
    v = row.get(key)
    return f"{v['median']:8.1f} {v['worst']:8.1f}" if v is not None else f"{'n/a':>8} {'n/a':>8}"


def _table(res: dict[str, Any]) -> str:
    lines = []
    if "abort" in res:
        lines.append(
            f"abort -> the last of {res['waiters']} awaiting tasks has CommAborted "
            f"(2 ranks, {res['reps']} runs; median / worst ms)   goal <= 5 ms"
        )
        lines.append(
            f"{'abort() from':>14} {'call med':>8} {'worst':>8} {'last med':>8} {'worst':>8}"
        )
        for where, row in res["abort"].items():
            lines.append(f"{where:>14} {_ms(row, 'abort_call_ms')} {_ms(row, 'last_waiter_ms')}")
        lines.append("")
    lines.append(
        "peer death (3 ranks, rank 2 dies; two_killed: 4 ranks, ranks 2 and 3 die): ms after the (first) "
        f"death, slowest survivor of each run, median / worst of {res['reps']} runs"
    )
    lines.append(
        "goals: detected <= 100 ms (PeerFailure naming the rank), resumed (first all_reduce on the shrunk "
        "comm) <= 500 ms"
    )
    lines.append(
        f"asynccoll: Gloo default (census on the transport error), heartbeat={res['heartbeat_s']} s for the "
        f"frozen peer; torch frozen: op timeout {TORCH_FROZEN_TIMEOUT:g} s"
    )
    lines.append(
        f"{'scenario':<27} {'detected':>17} {'settled':>17} {'gloo build':>17} {'resumed':>17}  named / error"
    )
    for name, row in res["death"].items():
        named = str(row["ranks"]) if name.startswith("asynccoll") else (row["error"] or "")[:50]
        lines.append(
            f"{name:<27} {_ms(row, 'detect_ms')} {_ms(row, 'settle_ms')} {_ms(row, 'gloo_build_ms')} "
            f"{_ms(row, 'resume_ms')}  {named}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    ap.add_argument(
        "--only", nargs="*", default=(), choices=("abort", *SCENARIOS), help="run only these"
    )
    ap.add_argument(
        "--json", default="bench/results/faults.json", help="where to write the results"
    )
    args = ap.parse_args(argv)
    res = run(quick=args.quick, only=tuple(args.only))
    print(_table(res))
    print()
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
