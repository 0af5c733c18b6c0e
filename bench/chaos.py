"""Chaos soak: ranks run random op streams while a driver kills, freezes and aborts them.

    python -m bench.chaos --minutes 10 [--world 4] [--seed 1] [--json bench/results/chaos.json]

This process hosts the TCPStore (as torchrun's agent or ``python -m asynccoll.store``
would), so the store outlives any rank. A *generation* is one group of ``--world``
ranks started together (forkserver: torch is imported once). Every rank runs the
same random stream of operations (every collective, coalesced batches, p2p in a
ring, object collectives), each result checked against what it must be, each op
bounded by ``--deadline``. Meanwhile the driver injects one fault at a time into a
random live rank:

* ``kill``: SIGKILL. The survivors get ``PeerFailure``, ``shrink()`` and go on.
* ``stop``: SIGSTOP for a while, then SIGCONT. Shorter than the deadline it is
  absorbed (the ops wait); longer, the others time out and abort, and everyone
  (the frozen rank too, once resumed, unless the others left it out) shrinks.
* ``abort``: the rank calls ``comm.abort()`` (SIGUSR1); the abort reaches every
  rank as news and they all shrink, without excluding anyone.

After each recovery the ranks check the invariants and report violations:
every result correct, no wait longer than its deadline + 1 s, the flight
record bounded, no growth of threads or open files beyond what the
communicators alive at the time explain. A generation ends when fewer than two
ranks are left; the next one starts fresh. Recovery is by shrink only: the
elastic API (``ac.join``/``comm.grow``, issue 21) exists now, but this soak
does not start replacements with it yet.

Reported: ops, faults injected (by kind), recoveries, the worst and median
recovery time (fault to the slowest survivor's first op on the new
communicator), violations (must be 0), store keys at each generation start,
and the load average. A figure taken at load > 1.5 is not a verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import random
import signal
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

HOST = "127.0.0.1"
FAULTS = {"kill": 3, "stop": 3, "abort": 2}
#: Threads and open files a rank may hold above its first steady state: one
#: communicator's worth (its backend threads, a reaper parked in an aborted Gloo
#: group until Gloo's own timeout, sockets), since a shrink replaces one.
THREAD_SLACK = 8
FD_SLACK = 24


# ======================================================================= rank side
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


# ====================================================================== driver
class Generation:
    """One group of ranks started together, and the faults injected into it."""

    def __init__(self, ctx: Any, gen: int, world: int, port: int, seed: int, deadline: float) -> None:
        self.gen = gen
        self.procs: dict[int, Any] = {}
        self.conns: dict[int, Any] = {}
        self.pids: dict[int, int] = {}
        self.alive: set[int] = set()
        self.ops: dict[int, int] = {}
        self.violations: list[str] = []
        self.messages: list[tuple[Any, ...]] = []
        #: (rank, from, to): when a rank was frozen by the driver (wall clock).
        self.frozen: list[tuple[int, float, float]] = []
        self.excused = 0
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(gen, r, world, port, seed, deadline, child), daemon=True)
            p.start()
            child.close()
            self.procs[r], self.conns[r] = p, parent
            self.alive.add(r)

    def poll(self, timeout: float) -> list[tuple[Any, ...]]:
        """Messages that arrived within ``timeout``; notices ranks that exited."""
        out = []
        conns = {c: r for r, c in self.conns.items() if r in self.alive}
        ready = mp.connection.wait(list(conns) + [self.procs[r].sentinel for r in self.alive], timeout)
        for obj in ready:
            r = conns.get(obj)  # type: ignore[arg-type]
            if r is None:
                continue
            try:
                while obj.poll():  # type: ignore[union-attr]
                    msg = obj.recv()  # type: ignore[union-attr]
                    out.append(msg)
            except (EOFError, OSError):
                pass
        for msg in out:
            kind, r = msg[0], msg[1]
            if kind == "ready":
                self.pids[r] = msg[2]
            elif kind == "ops":
                self.ops[r] = msg[2]
            elif kind == "violation":
                self.violations += [f"gen {self.gen} rank {r}: {v}" for v in msg[2]]
            elif kind == "long_wait":
                # A wait longer than deadline + 1 s is a violation, unless this rank itself
                # was frozen meanwhile (its clock ran while it could not).
                _, r, start, end, text = msg
                if any(fr == r and f0 < end and start < f1 for fr, f0, f1 in self.frozen):
                    self.excused += 1
                else:
                    self.violations.append(f"gen {self.gen} rank {r}: a wait of {text} > deadline + 1 s")
            elif kind == "crashed":
                self.violations.append(f"gen {self.gen} rank {r} crashed:\n{msg[2]}")
            elif kind in ("done", "left"):
                self.alive.discard(r)
        for r in list(self.alive):
            if not self.procs[r].is_alive():
                self.alive.discard(r)
        self.messages += out
        return out

    def finish(self) -> None:
        for r in list(self.alive):
            try:
                self.conns[r].send("stop")
            except OSError:  # gone already
                pass
        end = time.monotonic() + 30
        while self.alive and time.monotonic() < end:
            self.poll(0.2)
        for p in self.procs.values():
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.join(10)


def _load() -> float:
    return os.getloadavg()[0]


def run(minutes: float, world: int, seed: int, deadline: float) -> dict[str, Any]:
    import torch.distributed as dist

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["asynccoll", "torch"])
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    rng = random.Random(seed)
    end = time.monotonic() + minutes * 60
    res: dict[str, Any] = {
        "minutes": minutes, "world": world, "seed": seed, "deadline_s": deadline, "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(), "faults": {k: 0 for k in FAULTS}, "recoveries": 0,
        "absorbed": 0, "excused_waits": 0, "generations": 0, "ops": 0, "violations": [], "detect_s": [], "recovery_s": [], "keys": [],
    }
    gen = 0
    while time.monotonic() < end:
        gen += 1
        res["keys"].append(server.num_keys())
        g = Generation(ctx, gen, world, server.port, seed, deadline)
        res["generations"] = gen
        start_by = time.monotonic() + 120
        while len(g.pids) < world and time.monotonic() < start_by and g.alive:
            g.poll(0.5)
        while time.monotonic() < end and len(g.alive) >= 2:
            # Steady: ops flow for a while, then one fault.
            quiet_until = time.monotonic() + rng.uniform(1.0, 3.0)
            while time.monotonic() < quiet_until and len(g.alive) >= 2:
                g.poll(0.2)
            live = sorted(r for r in g.alive if r in g.pids)
            if len(live) < 2 or time.monotonic() >= end:
                break
            kind = rng.choices(list(FAULTS), weights=list(FAULTS.values()))[0]
            victim = rng.choice(live)
            pid = g.pids[victim]
            res["faults"][kind] += 1
            t_fault = time.time()
            recovered: dict[int, float] = {}
            failed: set[int] = set()
            early: list[tuple[Any, ...]] = []
            if kind == "kill":
                os.kill(pid, signal.SIGKILL)
            elif kind == "abort":
                os.kill(pid, signal.SIGUSR1)
            else:
                pause = rng.choice([rng.uniform(0.1, deadline * 0.6), rng.uniform(deadline * 1.2, deadline * 1.8)])
                os.kill(pid, signal.SIGSTOP)
                stopped_at = time.time()
                resume_at = time.monotonic() + pause
                g.frozen.append((victim, stopped_at, stopped_at + pause + 60.0))  # until resumed
                while time.monotonic() < resume_at:
                    early += g.poll(0.05)
                os.kill(pid, signal.SIGCONT)
                g.frozen[-1] = (victim, stopped_at, time.time() + 0.5)
            # Wait until every live rank that failed has recovered (or left), and then
            # nothing more happens for a while (a stop shorter than the deadline: nothing).
            limit = max(8 * deadline, 40.0)
            settle_by = time.monotonic() + limit
            quiet = deadline + 2.0
            last_event = time.monotonic()
            first_failed: float | None = None
            while time.monotonic() < settle_by:
                msgs, early = early + g.poll(0.1), []
                for msg in msgs:
                    if msg[0] in ("failed", "recovered", "left"):
                        last_event = time.monotonic()
                    if msg[0] == "failed":
                        failed.add(msg[1])
                        first_failed = msg[4] if first_failed is None else min(first_failed, msg[4])
                    elif msg[0] == "recovered":
                        recovered[msg[1]] = msg[2]
                pending = [r for r in failed if r in g.alive and r not in recovered]
                if not pending and time.monotonic() - last_event > quiet:
                    break
            if not failed:
                res["absorbed"] += 1
                continue
            stuck = [r for r in failed if r in g.alive and r not in recovered]
            if stuck:
                g.violations.append(f"gen {gen}: {kind} of rank {victim}: ranks {stuck} did not recover within {limit:g} s")
            elif recovered and first_failed is not None:
                res["recoveries"] += 1
                res["detect_s"].append(first_failed - t_fault)
                res["recovery_s"].append(max(recovered.values()) - first_failed)
        g.finish()
        res["ops"] += sum(g.ops.values())
        res["violations"] += g.violations
        res["excused_waits"] += g.excused
    res["keys"].append(server.num_keys())
    res["loadavg_end"] = os.getloadavg()
    rec, det = res["recovery_s"], res["detect_s"]
    res["recovery_worst_s"] = max(rec) if rec else None
    res["recovery_median_s"] = statistics.median(rec) if rec else None
    res["detect_worst_s"] = max(det) if det else None
    return res


def _summary(res: dict[str, Any]) -> str:
    rec = res["recovery_s"]
    lines = [
        f"chaos soak: {res['minutes']:g} min, {res['world']} ranks per generation, deadline {res['deadline_s']:g} s, "
        f"{res['cpus']} CPUs, load {res['loadavg_start'][0]:.2f} -> {res['loadavg_end'][0]:.2f}",
        f"ops {res['ops']}, generations {res['generations']}, faults {sum(res['faults'].values())} {res['faults']}",
        f"recoveries {res['recoveries']} (+ {res['absorbed']} faults absorbed without one), "
        + (f"recovery (first failure seen -> slowest survivor's first op on the new communicator) median "
           f"{statistics.median(rec):.3f} s, worst {max(rec):.3f} s; fault -> first failure seen worst "
           f"{max(res['detect_s']):.3f} s" if rec else "no recovery"),
        f"store keys at each generation start: {res['keys']}",
        f"long waits of a rank that was itself frozen meanwhile (not violations): {res['excused_waits']}",
        f"violations: {len(res['violations'])}",
    ]
    lines += [f"  {v}" for v in res["violations"][:20]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--deadline", type=float, default=3.0, help="every op's timeout, seconds")
    ap.add_argument("--json", default="bench/results/chaos.json")
    args = ap.parse_args(argv)
    res = run(args.minutes, args.world, args.seed, args.deadline)
    print(_summary(res))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2))
    print(f"wrote {path}")
    return 0 if not res["violations"] else 1


if __name__ == "__main__":
    sys.exit(main())
