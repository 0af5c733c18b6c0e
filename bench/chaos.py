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
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import random
import signal
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench._chaos_ranks import HOST, _rank_main  # noqa: E402 - after the path

FAULTS = {"kill": 3, "stop": 3, "abort": 2}


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
