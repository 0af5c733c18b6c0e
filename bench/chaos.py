"""Chaos soak: ranks run random op streams and train a model while a driver kills,
freezes and aborts them, and starts replacements that join the group and grow it back.

    python -m bench.chaos --minutes 10 [--world 4] [--seed 1] [--no-split]
                          [--json bench/results/chaos.json]

This process hosts the TCPStore (as torchrun's agent or ``python -m asynccoll.store``
would), so the store outlives any rank. A *generation* is one elastic group
(``ac.init(..., name="chaos")``) started with ``--world`` ranks (forkserver: torch
and what its optimizers import are loaded once). Every member runs the same stream
of steps, each bounded by ``--deadline`` (a training step, a split or a grow by the
longer creation bound): random operations (``bench/_chaos_ops.py``: every
collective, coalesced batches of one kind and of several, p2p in a ring, object
collectives small and of 300 kB), each result checked against what it must be for
the world size of the moment; every 5th step a training step of a small model with
``GradSync`` (``bench/_chaos_train.py``); and, where the Communicator has ``split``,
every 5th step an all-reduce on this rank's pair of a subgroup split off the world
group (``bench/_chaos_split.py``: a second communicator alive beside it, made again
after every membership change). Meanwhile the driver injects one fault at a time:

* ``kill``: SIGKILL of a member. The survivors get ``PeerFailure``, ``shrink()``
  and go on.
* ``stop``: SIGSTOP of a member for a while, then SIGCONT. Shorter than the
  deadline it is absorbed (the ops wait); longer, the others time out and abort,
  and everyone (the frozen rank too, once resumed, unless the others left it
  out) shrinks.
* ``abort``: a member calls ``comm.abort()`` (SIGUSR1); the abort reaches every
  rank as news and they all shrink, without excluding anyone.
* ``joiner``: a replacement is hit within 0.8 s of its start (SIGKILL, or SIGSTOP
  longer than the deadline): at its start, while it waits in ``ac.join``, in the
  grow's assembly, in ``broadcast_state`` or just after. If none is waiting (the
  usual case: the driver lets replacements in before the next fault), a member
  is killed and its replacement is the one hit.

The driver keeps ``--world`` processes: each one that ended (killed, or left out
by a shrink) is replaced within a second by a new process that calls
``ac.join``, as a per-rank launcher would restart it. Every ``WAIT_EVERY`` steps
(every step when alone) the members call ``waiting()``, ``grow()`` back towards
``--world`` and send the state with ``broadcast_state``, as ``examples/elastic.py``
does: the model, the optimizer's state and the training step, with a stand-in
state of 0.5 MB that is a function of the membership epoch; after every shrink
too, so that all members hold the same state. The sender is the member furthest on
in training (a step that failed on some ranks and completed on others leaves them
one step apart). A failed grow (a participant died or froze in it) is followed as
the faults guide says: shrink if the old communicator aborted, else go on with it.
A generation ends when no member is left (its waiting replacements are stopped);
the next one starts fresh.

After each recovery and each grow the ranks check the invariants and report
violations: every result correct (at the new world size too), the state a
joiner receives exactly the members' (and the members agree on it: at the same
training step, bit-equal parameters and momentum; never more than one step
apart), every rank's parameters and momentum bit-equal after the state sync and
again after the first training step on the new communicator, no wait longer than
its bound + 1 s (an op's deadline; a grow's two phases within its timeout each),
the flight record bounded, no growth of threads or open files beyond what the
communicators alive at the time explain, no replacement left waiting in
``ac.join`` for 60 s, and every replacement admitted in step (its first training
step on the grown group checked bit-equal) within ``in_step_bound`` unless it
failed or was frozen meanwhile.

Reported (``bench/_chaos_report.py``): ops, faults injected (by kind), recoveries,
the worst and median recovery time (first failure seen to the slowest survivor's
first op on the new communicator, the state sync included), replacements, joins,
grow-backs (and failed grows), rank 0's ``grow()`` call and the grow to every rank
of the grown group checked in step (median and worst), the time from a
replacement's start to its first op in the group and from its admission to its
first checked training step, training steps and in-step checks, subgroups made and
their ops, violations (must be 0), store keys at each generation start, before each
fault and every 10 s, and the load average. A figure taken at load > 1.5 is not a
verdict.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import random
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench._chaos_ranks import HOST, _rank_main, in_step_bound  # noqa: E402 - after the path
from bench._chaos_report import FAULTS, figures, key_shapes, summary  # noqa: E402

#: A replacement starts within this many seconds after a process ended (as its launcher restarts it).
RESTART_DELAY = 1.0


# ====================================================================== driver
class Generation:
    """One group (named ``chaos``) started with ``world`` ranks, the replacements that join
    it, and the faults injected into it. Processes are numbered in start order (``idx``)."""

    def __init__(
        self,
        ctx: Any,
        gen: int,
        world: int,
        port: int,
        seed: int,
        deadline: float,
        rng: random.Random,
        split: bool = True,
        tick: Any = None,
    ) -> None:
        self.ctx, self.gen, self.world, self.port, self.seed, self.deadline = (
            ctx,
            gen,
            world,
            port,
            seed,
            deadline,
        )
        self.split, self.tick = split, tick  # tick(): called at every poll (the key sampler)
        self.rng = rng  # restart delays only (faults draw from their own)
        self.procs: dict[int, Any] = {}
        self.conns: dict[int, Any] = {}
        self.pids: dict[int, int] = {}
        self.alive: set[int] = set()  # processes running
        self.members: set[int] = set()  # in the group (ready, or joined)
        self.pending: set[int] = set()  # replacements not in the group yet
        self.ops: dict[int, int] = {}
        self.violations: list[str] = []
        self.messages: list[tuple[Any, ...]] = []
        #: (idx, from, to): when a process was frozen by the driver (wall clock).
        self.frozen: list[tuple[int, float, float]] = []
        self.excused = 0
        self.started_at: dict[int, float] = {}  # replacements: wall clock at their start
        self.joint_at: dict[int, float] = {}  # ...and at their first op in the group
        self.joins = self.grows = 0
        #: Training: the furthest training step any rank reported, the subgroup ops and
        #: splits by process, and every passed in-step check (idx, when, epoch, size, step).
        self.train_steps = 0
        self.sub_ops: dict[int, int] = {}
        self.sub_made: dict[int, int] = {}
        self.in_step: list[tuple[int, float, int, int, int]] = []
        #: Rank 0's grows: (done at, old size, new size, called at, the new epoch).
        self.grown: list[tuple[float, int, int, float, int]] = []
        #: Replacements admitted and not yet in step (nor failed since): idx -> admitted at.
        self.admitted: dict[int, float] = {}
        self.join_in_step: list[float] = []  # admission -> first checked training step
        self.start_in_step: list[float] = []  # process start -> the same
        self.grow_failures: list[str] = []
        self.restarts: list[float] = []  # monotonic times at which replacements are due
        self.fault_times: list[float] = []  # wall clock
        self.closing = False
        for r in range(world):
            self.spawn(r, joiner=False)

    def spawn(self, idx: int, joiner: bool) -> None:
        parent, child = self.ctx.Pipe()
        args = (
            self.gen,
            idx,
            self.world,
            self.port,
            self.seed,
            self.deadline,
            joiner,
            self.split,
            child,
        )
        p = self.ctx.Process(target=_rank_main, args=args, daemon=True)
        if joiner:
            self.started_at[idx] = time.time()
            self.pending.add(idx)
        p.start()
        child.close()
        self.procs[idx], self.conns[idx] = p, parent
        self.alive.add(idx)

    def replace(self) -> int | None:
        """Start a replacement now; its idx (None once the group is gone)."""
        if self.closing or not self.members:
            return None
        idx = len(self.procs)
        self.spawn(idx, joiner=True)
        return idx

    def _tend(self) -> None:
        """Keep ``world`` processes: each one that ended is replaced after a random delay."""
        now = time.monotonic()
        missing = self.world - len(self.alive) - len(self.restarts)
        self.restarts += [now + self.rng.uniform(0.0, RESTART_DELAY) for _ in range(missing)]
        for due in sorted(self.restarts):
            if due <= now:
                self.restarts.remove(due)
                self.replace()

    def poll(self, timeout: float) -> list[tuple[Any, ...]]:
        """Messages that arrived within ``timeout``; notices processes that exited, starts replacements."""
        out = []
        conns = {c: r for r, c in self.conns.items() if r in self.alive}
        ready = mp.connection.wait(
            list(conns) + [self.procs[r].sentinel for r in self.alive], timeout
        )
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
            if kind in ("ready", "started"):
                self.pids[r] = msg[2]
                if kind == "ready":
                    self.members.add(r)
            elif kind == "joined":
                self.members.add(r)
                self.pending.discard(r)
                self.joins += 1
                self.admitted[r] = msg[2]
            elif kind == "in_step":
                self.in_step.append((r, *msg[2:]))
                if r in self.admitted:
                    self.join_in_step.append(msg[2] - self.admitted.pop(r))
                    self.start_in_step.append(msg[2] - self.started_at[r])
            elif kind == "failed":  # (a replacement that fails before it is in step recovers)
                self.admitted.pop(r, None)
            elif kind == "joint":
                self.joint_at[r] = msg[2]
            elif kind == "grew":
                self.grows += 1
                self.grown.append(msg[2:])
            elif kind == "grow_failed":  # (reported by rank 0 of the members)
                self.grow_failures.append(f"gen {self.gen}: {msg[2]}")
            elif kind == "join_timeout":
                self.violations.append(f"gen {self.gen} process {r}: not admitted: {msg[2]}")
            elif kind == "ops":
                self.ops[r] = msg[2]
                self.train_steps = max(self.train_steps, msg[3])
                self.sub_ops[r], self.sub_made[r] = msg[4], msg[5]
            elif kind == "violation":
                self.violations += [f"gen {self.gen} process {r}: {v}" for v in msg[2]]
            elif kind == "long_wait":
                # A wait longer than its bound + 1 s is a violation, unless this process itself
                # was frozen meanwhile (its clock ran while it could not).
                _, r, start, end, text = msg
                if any(fr == r and f0 < end and start < f1 for fr, f0, f1 in self.frozen):
                    self.excused += 1
                else:
                    self.violations.append(
                        f"gen {self.gen} process {r}: a wait of {text} > its bound + 1 s"
                    )
            elif kind == "crashed":
                self.violations.append(f"gen {self.gen} process {r} crashed:\n{msg[2]}")
            if kind in ("done", "left", "join_timeout", "crashed"):
                self._gone(r)
        for r in list(self.alive):
            if not self.procs[r].is_alive():
                self._gone(r)
        self._late_in_step()
        if self.tick is not None:
            self.tick()
        self.messages += out
        if not self.closing:
            self._tend()
        return out

    def _late_in_step(self) -> None:
        """A replacement admitted must train in step within ``in_step_bound``, unless it
        was frozen meanwhile (its clock ran while it could not) or failed (and recovers)."""
        now, bound = time.time(), in_step_bound(self.deadline)
        for r, at in list(self.admitted.items()):
            if now - at <= bound:
                continue
            del self.admitted[r]
            if any(fr == r and f0 < now and at < f1 for fr, f0, f1 in self.frozen):
                self.excused += 1
                continue
            self.violations.append(
                f"gen {self.gen} process {r}: admitted, and not in step after {bound:g} s"
            )

    def _gone(self, r: int) -> None:
        self.admitted.pop(r, None)
        self.alive.discard(r)
        self.members.discard(r)
        self.pending.discard(r)

    def kill(self) -> None:
        """Interrupted (Ctrl-C): end every process now, a frozen one too."""
        self.closing = True
        for p in self.procs.values():
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.join(10)

    def finish(self) -> None:
        self.closing = True
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


def _freeze(g: Generation, victim: int, pause: float, early: list[tuple[Any, ...]]) -> None:
    """SIGSTOP ``victim`` for ``pause`` seconds (polling meanwhile into ``early``), then SIGCONT."""
    pid = g.pids[victim]
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.time()
    resume_at = time.monotonic() + pause
    g.frozen.append((victim, stopped_at, stopped_at + pause + 60.0))  # until resumed
    while time.monotonic() < resume_at:
        early += g.poll(0.05)
    os.kill(pid, signal.SIGCONT)
    g.frozen[-1] = (victim, stopped_at, time.time() + 0.5)


def _inject(
    g: Generation, kind: str, rng: random.Random, deadline: float, early: list[tuple[Any, ...]]
) -> str:
    """One fault of ``kind`` into a random process of ``g``; what it hit."""
    if kind == "joiner":
        # A replacement is hit before it is in: at its start, while it waits in ac.join,
        # in the grow's assembly or in broadcast_state. If none waits, a member is killed
        # and its replacement (started at once) is the one hit.
        waiting = sorted(g.pending)
        before = ""
        if waiting:
            victim = rng.choice(waiting)
        else:
            dead = rng.choice(sorted(r for r in g.members if r in g.pids))
            os.kill(g.pids[dead], signal.SIGKILL)
            started = g.replace()  # (it takes the dead one's place: no other replacement starts)
            if started is None:
                return f"member {dead} killed, no replacement (the group is gone)"
            victim, before = started, f"member {dead} killed, then its "
        # (a replacement is in about 0.5 s after its start: most hits land before or during its join)
        hit_at = time.monotonic() + rng.uniform(0.0, 0.8)
        while victim not in g.pids or time.monotonic() < hit_at:
            if victim not in g.alive:
                return f"{before}replacement {victim} (ended before the hit)"
            early += g.poll(0.02)
        g.fault_times.append(time.time())  # (a join that spans this hit is not an undisturbed one)
        if rng.random() < 0.6:
            os.kill(g.pids[victim], signal.SIGKILL)
            return f"{before}replacement {victim} killed"
        pause = rng.uniform(1.2 * deadline, 1.8 * deadline)
        _freeze(g, victim, pause, early)
        return f"{before}replacement {victim} frozen {pause:.1f} s"
    victim = rng.choice(sorted(r for r in g.members if r in g.pids))
    if kind == "kill":
        os.kill(g.pids[victim], signal.SIGKILL)
    elif kind == "abort":
        os.kill(g.pids[victim], signal.SIGUSR1)
    else:
        pause = rng.choice(
            [rng.uniform(0.1, deadline * 0.6), rng.uniform(deadline * 1.2, deadline * 1.8)]
        )
        _freeze(g, victim, pause, early)
        return f"member {victim} frozen {pause:.1f} s"
    return f"member {victim}"


#: Store keys are sampled this often (seconds) for the keys-over-time figure.
KEYS_EVERY = 10.0


def run(
    minutes: float, world: int, seed: int, deadline: float, split: bool = True
) -> dict[str, Any]:
    import torch.distributed as dist

    ctx = mp.get_context("forkserver")
    # torch, and what its optimizers import when the first one is made (torch._dynamo,
    # 2-5 s here): a rank starts as a trained process would, with its libraries loaded.
    ctx.set_forkserver_preload(["asynccoll", "torch", "torch._dynamo"])
    server = dist.TCPStore(
        HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    # Separate streams, so the sequence of fault kinds is the same on every run of a seed
    # (victims and delays depend on which processes are there at the time).
    kinds, victims, timing = (
        random.Random(f"{seed}/{what}") for what in ("kinds", "victims", "timing")
    )
    end = time.monotonic() + minutes * 60
    res: dict[str, Any] = {
        "minutes": minutes,
        "world": world,
        "seed": seed,
        "deadline_s": deadline,
        "split": split,
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "faults": {k: 0 for k in FAULTS},
        "recoveries": 0,
        "absorbed": 0,
        "excused_waits": 0,
        "generations": 0,
        "ops": 0,
        "violations": [],
        "detect_s": [],
        "recovery_s": [],
        "keys": [],
        "keys_at_faults": [],
        "keys_series": [],  # (seconds after the start, store keys), every KEYS_EVERY s
        "joins": 0,
        "grows": 0,
        "grow_failures": [],
        "grow_call_s": [],  # rank 0's grow() call
        "grow_s": [],  # grow() called -> the slowest rank of the grown group checked in step
        "replacements": 0,
        "join_s": [],
        "join_undisturbed_s": [],
        "join_in_step_s": [],  # a replacement's admission -> its first checked training step
        "start_in_step_s": [],  # its start -> the same
        "train_steps": 0,
        "in_step_checks": 0,  # membership epochs whose ranks all checked bit-equal after training
        "subgroup_splits": 0,
        "subgroup_ops": 0,
        "started": time.time(),
        "fault_log": [],  # every fault: when (s after the start), kind, what it hit, who failed, how long
    }
    next_sample = [0.0]

    def tick() -> None:
        if time.monotonic() >= next_sample[0]:
            next_sample[0] = time.monotonic() + KEYS_EVERY
            res["keys_series"].append((round(time.time() - res["started"], 1), server.num_keys()))

    gen = 0
    while time.monotonic() < end:
        gen += 1
        res["keys"].append(server.num_keys())
        g = Generation(ctx, gen, world, server.port, seed, deadline, timing, split, tick)
        res["generations"] = gen
        try:
            _soak(g, res, end, world, deadline, kinds, victims, timing, server)
        except BaseException:
            g.kill()
            raise
        g.finish()
        _collect(g, res)
    res["keys"].append(server.num_keys())
    res["keys_series"].append((round(time.time() - res["started"], 1), server.num_keys()))
    res["keys_at_end"] = key_shapes(server.list_keys())
    res["loadavg_end"] = os.getloadavg()
    res.update(figures(res))
    return res


def _collect(g: Generation, res: dict[str, Any]) -> None:
    """Generation ``g``'s counts and times, into ``res``."""
    res["ops"] += sum(g.ops.values())
    res["violations"] += g.violations
    res["excused_waits"] += g.excused
    res["joins"] += g.joins
    res["grows"] += g.grows
    res["grow_failures"] += g.grow_failures
    res["replacements"] += len(g.started_at)
    res["train_steps"] += g.train_steps
    res["subgroup_ops"] += sum(g.sub_ops.values())
    res["subgroup_splits"] += sum(g.sub_made.values())
    res["join_in_step_s"] += g.join_in_step
    res["start_in_step_s"] += g.start_in_step
    for r, t in g.joint_at.items():
        took = t - g.started_at[r]
        res["join_s"].append(took)
        if not any(g.started_at[r] <= f <= t for f in g.fault_times):
            res["join_undisturbed_s"].append(took)
    checked: dict[int, list[float]] = {}  # epoch -> when each rank was checked in step
    for _, at, epoch, _size, _step in g.in_step:
        checked.setdefault(epoch, []).append(at)
    res["in_step_checks"] += len(checked)
    for done_at, _old, size, called_at, epoch in g.grown:
        res["grow_call_s"].append(done_at - called_at)
        if len(checked.get(epoch, ())) == size:  # (no fault cut the grown group's first step)
            res["grow_s"].append(max(checked[epoch]) - called_at)


def _soak(
    g: Generation,
    res: dict[str, Any],
    end: float,
    world: int,
    deadline: float,
    kinds: random.Random,
    victims: random.Random,
    timing: random.Random,
    server: Any,
) -> None:
    """Generation ``g`` until ``end`` or until its group is gone: faults, and their recoveries."""
    gen = g.gen
    start_by = time.monotonic() + 120
    while len(g.members) < world and time.monotonic() < start_by and g.alive:
        g.poll(0.5)
    while time.monotonic() < end and g.members:
        # Steady: ops flow for a while, then one fault.
        quiet_until = time.monotonic() + timing.uniform(1.0, 3.0)
        while time.monotonic() < quiet_until and g.members:
            g.poll(0.2)
        if not g.members or time.monotonic() >= end:
            break
        kind = kinds.choices(list(FAULTS), weights=list(FAULTS.values()))[0]
        res["faults"][kind] += 1
        res["keys_at_faults"].append(server.num_keys())
        t_fault = time.time()
        g.fault_times.append(t_fault)
        recovered: dict[int, float] = {}
        failed: set[int] = set()
        early: list[tuple[Any, ...]] = []
        hit = _inject(g, kind, victims, deadline, early)
        entry: dict[str, Any] = {"at": round(t_fault - res["started"], 3), "kind": kind, "hit": hit}
        res["fault_log"].append(entry)
        # Wait until every live process that failed has recovered (or left), the
        # replacements are in, and then nothing more happens for a while.
        limit = max(8 * deadline, 40.0)
        settle_by = time.monotonic() + limit
        quiet = deadline + 2.0
        last_event = time.monotonic()
        first_failed: float | None = None
        while time.monotonic() < settle_by and g.members:
            msgs, early = early + g.poll(0.1), []
            for msg in msgs:
                if msg[0] in ("failed", "recovered", "left", "joined", "grow_failed"):
                    last_event = time.monotonic()
                if msg[0] == "failed":
                    failed.add(msg[1])
                    entry.setdefault("why", []).append(
                        (round(msg[4] - res["started"], 3), msg[1], msg[5])
                    )
                    first_failed = msg[4] if first_failed is None else min(first_failed, msg[4])
                elif msg[0] == "recovered":
                    recovered[msg[1]] = msg[2]
                    entry.setdefault("back", []).append((round(msg[2] - res["started"], 3), msg[1]))
            pending = [r for r in failed if r in g.alive and r not in recovered]
            joining = g.pending or g.restarts
            if not pending and not joining and time.monotonic() - last_event > quiet:
                break
        entry["failed"] = sorted(failed)
        if not failed:
            res["absorbed"] += 1
            continue
        stuck = [r for r in failed if r in g.alive and r not in recovered]
        if stuck and g.members:
            g.violations.append(
                f"gen {gen}: {kind} fault: {stuck} did not recover within {limit:g} s"
            )
        elif recovered and first_failed is not None:
            res["recoveries"] += 1
            res["detect_s"].append(first_failed - t_fault)
            res["recovery_s"].append(max(recovered.values()) - first_failed)
            entry.update(
                detect_s=round(res["detect_s"][-1], 3), recovery_s=round(res["recovery_s"][-1], 3)
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--deadline", type=float, default=3.0, help="every op's timeout, seconds")
    ap.add_argument("--json", default="bench/results/chaos.json")
    ap.add_argument(
        "--no-split",
        action="store_true",
        help="no subgroup beside the world group (it is made only where comm.split exists)",
    )
    args = ap.parse_args(argv)
    res = run(args.minutes, args.world, args.seed, args.deadline, split=not args.no_split)
    print(summary(res))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2))
    print(f"wrote {path}")
    return 0 if not res["violations"] else 1


if __name__ == "__main__":
    sys.exit(main())
