"""Deliberate breakages of the NCCL/CUDA path, each of which some CPU test must catch.

    python -m tests.support.mutations [-k SUBSTRING] [--list]     (or: make mutations)

Each mutation replaces one exact piece of source text in a temporary copy of the
repository (the original tree is never touched), runs the tests it names against the
copy, and prints ``killed`` (a test failed: the suite sees the breakage) or
``survived`` (no test noticed: a hole in the suite or in the simulator). Exit status 1
if any survived or no longer applies. Not part of ``make test`` (minutes).

The list grows with the simulator: a rule the simulator enforces earns a mutation
that breaks the code it protects.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from tests.support import paths

ROOT = str(paths.ROOT)
NCCL = "asynccoll/_backends/nccl/"
LAUNCH = "tests/nccl/test_simgpu_launch.py::"
SHRINK = "tests/nccl/test_simgpu_shrink.py::"
BACKEND = "tests/nccl/test_simgpu_backend.py::"


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


M = Mutation
MUTATIONS = [
    M(
        "no record_stream: the allocator may reuse a tensor NCCL still reads",
        NCCL + "cuda.py",
        "tensor.record_stream(self.comm_stream)",
        "pass",
        (BACKEND + "test_tensors_of_an_aborted_op_are_protected_by_record_stream",),
    ),
    M(
        "the comm stream drawn from torch's pool",
        NCCL + "cuda.py",
        "self.comm_stream = streams.own_streams().acquire(index)",
        "self.comm_stream = torch.cuda.Stream(device=index, priority=-3)",
        (BACKEND + "test_the_comm_stream_is_not_one_of_torchs_pool_streams",),
    ),
    M(
        "the ready event recorded on the comm stream, not the caller's",
        NCCL + "launcher.py",
        "ready.record(rt.caller_stream(tensors[0] if tensors else None))",
        "ready.record(rt.comm_stream)",
        (BACKEND + "test_op_waits_for_the_callers_stream_and_wait_stream_orders_a_later_kernel",),
    ),
    M(
        "the comm stream does not wait for the caller's stream",
        NCCL + "launcher.py",
        "rt.comm_stream.wait_event(job.ready)",
        "pass",
        (BACKEND + "test_op_waits_for_the_callers_stream_and_wait_stream_orders_a_later_kernel",),
    ),
    M(
        "ncclInProgress not polled: the done event goes on the stream at once",
        NCCL + "launcher.py",
        "self._landed(job, self._handle.poll(self._by(job)))",
        "self._landed(job, SUCCESS)",
        ("tests/nccl/test_simgpu_collectives.py",),
    ),
    M(
        "wait_stream does not wait for the launch",
        NCCL + "launcher.py",
        "if not job.settled:",
        "if False:",
        (BACKEND + "test_wait_stream_on_a_queued_op_is_deadlock_free_with_one_hardware_queue",),
    ),
    M(
        "wait_stream orders nothing",
        NCCL + "launcher.py",
        "target.wait_event(job.done)",
        "pass",
        (BACKEND + "test_op_waits_for_the_callers_stream_and_wait_stream_orders_a_later_kernel",),
    ),
    M(
        "success reported after abort",
        NCCL + "launcher.py",
        "if not jobs or self._handle.stopping:",
        "if not jobs:",
        (BACKEND + "test_no_success_is_reported_after_abort",),
    ),
    M(
        "a failed nccl4py call leaves the group without an error",
        NCCL + "launcher.py",
        "lib.poison_group(comm, self._rt.scratch, stream, self.world_size)",
        "pass",
        (LAUNCH + "test_a_call_failing_inside_a_group_launches_nothing",),
    ),
    M(
        "a failed group ended with ncclGroupSimulateEnd",
        NCCL + "launcher.py",
        "lib.poison_group(comm, self._rt.scratch, stream, self.world_size)",
        "lib._nc.group_end(simulate=True); lib.group_start()",
        (LAUNCH + "test_a_call_failing_inside_a_group_launches_nothing",),
    ),
    M(
        "shrink ignores the op being launched",
        NCCL + "renew.py",
        "abort_pending = bool(self._inflight or self._pending or self._launching) or self._broken",
        "abort_pending = False",
        (BACKEND + "test_shrink_defaults_to_abort_when_ops_are_in_flight",),
    ),
    M(
        "the watcher never selects its device",
        NCCL + "launcher.py",
        'f"nccl{device.index}", cuda_device=device.index',
        'f"nccl{device.index}"',
        (LAUNCH + "test_every_thread_works_on_its_communicators_device",),
    ),
    M(
        "bool reduced as uint8 SUM",
        NCCL + "encode.py",
        "ReduceOp.MAX if op in (ReduceOp.SUM, ReduceOp.MAX) else ReduceOp.MIN",
        "op",
        ("tests/nccl/test_simgpu_collectives.py",),
    ),
    M(
        "complex reduced without its real view",
        NCCL + "encode.py",
        "t = torch.view_as_real(t)",
        "pass",
        ("tests/nccl/test_simgpu_collectives.py",),
    ),
    M(
        "integer AVG without the floor division",
        NCCL + "encode.py",
        'post.append(functools.partial(t.div_, ws, rounding_mode="floor"))',
        "pass",
        ("tests/nccl/test_simgpu_collectives.py",),
    ),
    M(
        "gather's root slot never copied",
        NCCL + "encode.py",
        "post.append(P(outs[root].copy_, t))",
        "pass",
        ("tests/nccl/test_simgpu_collectives.py",),
    ),
    M(
        "scatter's root slot never copied",
        NCCL + "encode.py",
        "post.append(P(out.copy_, ins[root]))",
        "pass",
        ("tests/nccl/test_simgpu_collectives.py",),
    ),
    M(
        "revoke only from NCCL 2.29",
        NCCL + "lib.py",
        "REVOKE_SINCE = (2, 28, 7)",
        "REVOKE_SINCE = (2, 29, 0)",
        ("tests/nccl/test_simgpu_lifecycle.py::test_revoke_exists_from_nccl_2_28_7",),
    ),
    M(
        "fp8 reductions allowed below sm_90",
        NCCL + "caps.py",
        "drop = FP8 if old_gpu else frozenset()",
        "drop = frozenset()",
        (
            "tests/nccl/test_simgpu_collectives.py::test_fp8_reductions_are_refused_at_the_call_below_sm90",
        ),
    ),
    M(
        "bool AVG allowed",
        NCCL + "caps.py",
        "ReduceOp.AVG: (_NUMERIC - FP8) | COMPLEX,",
        "ReduceOp.AVG: (_NUMERIC - FP8) | COMPLEX | {torch.bool},",
        (LAUNCH + "test_every_argument_is_resolved_before_the_group_starts",),
    ),
    M(
        "one launch thread per communicator",
        NCCL + "lanes.py",
        "lane = _LANES.get(index)",
        "lane = None",
        (LAUNCH + "test_communicators_of_a_device_launch_in_issue_order",),
    ),
    M(
        "ncclCommShrink with nothing to exclude",
        NCCL + "agree.py",
        "    if not exclude:\n",
        "    if False:\n",
        (SHRINK + "test_shrink_after_a_user_abort_without_failures_builds_a_new_communicator",),
    ),
    M(
        "a stopped communicator finalized on close",
        NCCL + "handle.py",
        "        if self.stopping:\n            self.discard()",
        "        if False:\n            self.discard()",
        (SHRINK + "test_a_revoked_backend_is_shrinkable_and_close_aborts_it",),
    ),
    M(
        "the shrunk child used before its parent's job ended",
        NCCL + "handle.py",
        'self._child_ready(parent, child, deadline, "NCCL shrink")',
        'wait_ready(child, self.lib, deadline, "NCCL shrink")',
        (SHRINK + "test_dead_rank_survivors_revoke_then_shrink_with_abort_no_fresh_init",),
    ),
    M(
        "init outside the device guard",
        NCCL + "creation.py",
        "with torch.cuda.device(index):\n            return _build()",
        "if True:\n            return _build()",
        ("tests/nccl/test_simgpu_collectives.py",),
    ),
    M(
        "grow without every member's vote",
        NCCL + "agree.py",
        'ok = all(bytes(v) == b"1" for v in store.multi_get(keys))',
        "ok = True",
        ("tests/nccl/test_simgpu_grow.py::test_an_aborted_member_makes_the_grow_a_fresh_init",),
    ),
    M(
        "abort without a bound",
        NCCL + "handle.py",
        "self._stopped.wait(self.abort_timeout)\n\n    def _spawn",
        "self._stopped.wait()\n\n    def _spawn",
        (BACKEND + "test_abort_while_a_launch_is_stuck_in_progress",),
    ),
    M(
        "streams' event watcher never selects the device",
        "streams/_watcher.py",
        "torch.cuda.set_device(self.cuda_device)",
        "pass",
        ("tests/testing/test_simgpu_device.py::test_watcher_selects_its_device_before_waiting",),
    ),
    M(
        "comm.grow() never grows NCCL natively",
        "asynccoll/_bootstrap/elastic.py",
        "if cuda is not None:  # Backend.grow_agreed",
        "if False:  # Backend.grow_agreed",
        ("tests/faults/test_elastic.py::test_grow_on_nccl_on_the_simulated_gpu",),
    ),
    M(
        "a joiner never meets the native grow",
        "asynccoll/_bootstrap/elastic.py",
        'if plan.get("cuda") else None',
        "if False else None",
        ("tests/faults/test_elastic.py::test_grow_on_nccl_on_the_simulated_gpu",),
    ),
    M(
        "split by a fresh init instead of ncclCommSplit",
        NCCL + "renew.py",
        "return None if child is None else self._successor(child, rank, size)",
        "return None",
        (
            "tests/nccl/test_simgpu_split.py::test_split_makes_one_ncclcommsplit_per_rank_and_no_fresh_init",
        ),
    ),
    M(
        "a split child used before the parent's split job ended",
        NCCL + "handle.py",
        'self._child_ready(parent, None if color is None else child, deadline, "NCCL split")',
        "pass",
        (
            "tests/nccl/test_simgpu_split.py::test_split_makes_one_ncclcommsplit_per_rank_and_no_fresh_init",
        ),
    ),
]


def _copy(dst: str) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for rel in files:
        src = os.path.join(ROOT, rel)
        if not os.path.isfile(src):
            continue
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dst, rel))


def run(m: Mutation, timeout: float) -> str:
    """``killed``, ``survived``, ``stale`` (its source text is gone: update the list) or
    ``broken ...`` (pytest could not run the tests: the mutation itself is wrong)."""
    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
        _copy(tmp)
        path = os.path.join(tmp, m.path)
        with open(path) as f:
            text = f.read()
        if text.count(m.old) != 1:
            return "stale"
        with open(path, "w") as f:
            f.write(text.replace(m.old, m.new))
        env = dict(os.environ, PYTHONPATH=tmp, PYTHONDONTWRITEBYTECODE="1")
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "-o",
            "timeout=60",
            *m.tests,
        ]
        try:
            out = subprocess.run(
                cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return "killed"  # the suite hung on it: caught (by the deadline)
        if out.returncode in (0, 1):  # pytest: all passed / some test failed
            return "survived" if out.returncode == 0 else "killed"
        # Anything else (a collection error, no test collected) proves nothing about the
        # suite: the mutation broke the import, or names tests that do not exist.
        return f"broken (pytest exit {out.returncode}): {out.stdout.strip().splitlines()[-1:]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", default="", help="only mutations whose name contains this")
    ap.add_argument("--list", action="store_true", help="print the mutations and exit")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mutation")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.k in m.name]
    if args.list:
        for i, m in enumerate(chosen, 1):
            print(f"{i:2d}. {m.name}  [{m.path}]")
        return 0
    bad = 0
    t0 = time.monotonic()
    for i, m in enumerate(chosen, 1):
        verdict = run(m, args.timeout)
        bad += verdict != "killed"
        print(f"{i:2d}/{len(chosen)} {verdict:8s} {m.name}", flush=True)
    print(f"{len(chosen) - bad} of {len(chosen)} killed in {time.monotonic() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
