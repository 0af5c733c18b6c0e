"""Calling order is execution order for memory (API.md §2), on Gloo as on NCCL.

Two in-flight ops of one communicator that touch the same memory run one after
the other, in call order, on every rank; independent ops stay concurrent. Each
pattern below gave a wrong or rank-dependent answer in most rounds before the
memory gate (``_backends/gate.py``); here it must give NCCL's answer every round.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch

import asynccoll as ac
from asynccoll._backends.gate import MemoryGate, spans
from asynccoll._base.ops import OpKind, OpSpec
from asynccoll._core.work import Bundle
from asynccoll.testing import run_ranks
from tests.support.backends import LOOPS, gather
from tests.support.paths import ROOT, child_env
from tests.support.ports import unused_port

ROUNDS = 1000


def _full(value: float, n: int = 1024, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full((n,), value, dtype=dtype)


async def every_pattern(comm: ac.Communicator, rounds: int) -> dict[str, int]:
    """Each pattern ``rounds`` times on 2 ranks; the number of wrong rounds per pattern.

    Rank r starts from r + 1, so the sum of both ranks is 3."""
    r = comm.rank
    wrong: dict[str, int] = {}

    def check(name: str, ok: bool) -> None:
        wrong[name] = wrong.get(name, 0) + (not ok)

    for _ in range(rounds):
        t = _full(r + 1)
        w1, w2 = comm.all_reduce(t), comm.all_reduce(t)
        await w1
        await w2
        check("all_reduce, all_reduce", bool((t == 6).all()))

        t = _full(r + 1)
        w1, w2 = comm.all_reduce(t, ac.ReduceOp.AVG), comm.broadcast(t, src=1)
        await gather(lambda w=w1: w, lambda w=w2: w)
        check("all_reduce(AVG), broadcast", bool((t == 1.5).all()))

        ti = _full(r + 1, dtype=torch.int64)  # integer AVG: Gloo's SUM, then our division
        w1, w2 = comm.all_reduce(ti, ac.ReduceOp.AVG), comm.broadcast(ti, src=0)
        await w2
        await w1
        check("integer all_reduce(AVG), broadcast", bool((ti == 1).all()))

        # all_gather and reduce_scatter into overlapping views of one buffer:
        # buf[0:4] <- gather of [r+1, r+1]; then buf[2:4] <- reduce_scatter of x
        buf = torch.zeros(6)
        x = torch.full((4,), 10.0 * (r + 1))
        w1 = comm.all_gather(buf[0:4], _full(r + 1, 2))
        w2 = comm.reduce_scatter(buf[2:4], x)
        w3 = comm.all_reduce(buf[3:6])  # reads what both wrote
        await w3
        await w1
        await w2
        want = torch.tensor([1.0, 1.0, 30.0, 60.0, 0.0, 0.0])
        check("all_gather, reduce_scatter, all_reduce on overlapping views", torch.equal(buf, want))

        ts = [_full(r + 1, 256) for _ in range(4)]
        async with comm.coalescing(wait=False) as group:
            for g in ts:
                comm.all_reduce(g)
        w = comm.all_reduce(ts[2])
        await w
        await group
        check(
            "coalesced batch, then an op on one member",
            bool((ts[2] == 6).all()) and bool((ts[0] == 3).all()),
        )

        t = _full(r + 1)
        await gather(lambda t=t: comm.all_reduce(t), lambda t=t: comm.all_reduce(t))  # two tasks
        check("two tasks, one tensor", bool((t == 6).all()))

        peer = 1 - r
        t = _full(r + 1)
        if r == 0:
            w1, w2 = comm.send(t, peer), comm.recv(t, peer)
        else:
            w1, w2 = comm.recv(t, peer), comm.send(t, peer)
        w3 = comm.all_reduce(t)
        await w3
        await w1
        await w2
        # rank 0 sends 1, then receives 1 back: its t is 1; rank 1 received 1: 1; sum 2
        check("send/recv, then all_reduce", bool((t == 2).all()))
    return wrong


@pytest.mark.timeout(300)
@pytest.mark.parametrize("loop", LOOPS)
def test_ops_on_the_same_memory_run_in_call_order(loop: str) -> None:
    results = run_ranks(every_pattern, world_size=2, loop=loop, args=(ROUNDS,), timeout=280)
    for rank, wrong in enumerate(results):
        assert not any(wrong.values()), f"rank {rank}: wrong rounds of {ROUNDS}: {wrong}"


async def independent_ops_overlap(comm: ac.Communicator) -> tuple[int, int]:
    """Ops on disjoint tensors are never held; an op on a tensor in flight is."""
    backend = comm.backends["cpu"]
    gate = backend._gate  # type: ignore[attr-defined]
    a, b = torch.ones(4), torch.ones(4)
    if comm.rank == 1:
        await anyio.sleep(0.2)  # rank 0's ops stay in flight until rank 1 joins
    works = [comm.all_reduce(a), comm.all_reduce(b), comm.all_reduce(a[2:])]
    held = gate.holding
    for w in works:
        await w
    return held, gate.holding


def test_independent_ops_are_not_held() -> None:
    (held0, after0), (_, after1) = run_ranks(independent_ops_overlap, world_size=2)
    assert held0 == 1  # only a[2:], behind a
    assert after0 == after1 == 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_readme_first_example_gives_both_ranks_the_same_right_values(tmp_path: Path) -> None:
    """The README's first example under torchrun, several runs: both ranks print [1, 1, 1, 1]."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"### Await a collective\n\n```python\n(.*?)^```", readme, re.S | re.M)
    assert block is not None, "README lost its first example"
    script = tmp_path / "first.py"
    script.write_text(block.group(1))
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which(
        "torchrun"
    )
    cmd = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    env = child_env()
    for run in range(3):
        logs = tmp_path / f"logs{run}"  # one stdout file per rank: the two never interleave
        proc = subprocess.run(
            [
                *cmd,
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(unused_port()),
                "--log-dir",
                str(logs),
                "--redirects",
                "1",
                str(script),
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=100,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        printed = sorted(p.read_text().strip() for p in logs.rglob("stdout.log"))
        assert printed == ["0 tensor([1., 1., 1., 1.])", "1 tensor([1., 1., 1., 1.])"], printed


# ----------------------------------------------------------------- the gate alone
def _spec(t: torch.Tensor, out: torch.Tensor | None = None) -> OpSpec:
    return OpSpec(OpKind.ALL_REDUCE if out is None else OpKind.ALL_GATHER, t, out)


def _gate() -> tuple[MemoryGate, list[tuple[list[ac.Work], BaseException]]]:
    refused: list[tuple[list[ac.Work], BaseException]] = []
    return MemoryGate(lambda works, exc: refused.append((list(works), exc))), refused


def test_gate_holds_overlaps_and_everything_after_them_in_call_order() -> None:
    (gate, _), issued = _gate(), []
    buf = torch.zeros(16)
    other = torch.zeros(4)
    w = [ac.Work("op", i) for i in range(5)]
    assert gate.run(spans([_spec(buf[0:8])]), [w[0]], issued.append, 0)
    assert gate.run(spans([_spec(buf[8:16])]), [w[1]], issued.append, 1)  # adjacent, disjoint: goes
    assert not gate.run(spans([_spec(buf[7:9])]), [w[2]], issued.append, 2)  # overlaps both
    assert not gate.run(
        spans([_spec(other)]), [w[3]], issued.append, 3
    )  # disjoint, but after a held op
    assert not gate.run([], [w[4]], issued.append, 4)  # no memory (a barrier): in order too
    assert issued == [0, 1] and gate.holding == 3
    gate.finished([w[0]])
    assert issued == [0, 1]  # buf[8:16] still in flight
    gate.finished([w[1]])
    assert issued == [0, 1, 2, 3, 4] and gate.holding == 0


def test_gate_releases_a_batch_when_all_its_works_finished() -> None:
    (gate, _), issued = _gate(), []
    a, b = torch.zeros(4), torch.zeros(4)
    members = [ac.Work("all_reduce", 1), ac.Work("all_reduce", 2)]
    assert gate.run(spans([_spec(a), _spec(b)]), members, issued.append, "batch")
    later = ac.Work("all_reduce", 3)
    assert not gate.run(spans([_spec(b)]), [later], issued.append, "after")
    gate.finished([members[0]])
    assert issued == ["batch"]  # one member still in flight: b stays taken
    gate.finished([Bundle([members[1]], "all_reduce")])
    assert issued == ["batch", "after"]


def test_gate_counts_inputs_and_outputs_and_hands_back_failed_issues() -> None:
    gate, refused = _gate()
    src, out = torch.zeros(4), torch.zeros(8)
    first = ac.Work("all_gather", 1)
    assert gate.run(spans([_spec(src, out)]), [first], lambda: None)
    reader = ac.Work("broadcast", 2)

    def refuse() -> None:
        raise ac.InvalidArgument("refused when its turn came")

    assert not gate.run(spans([_spec(out[4:])]), [reader], refuse)  # overlaps the output
    gate.finished([first])
    [(works, exc)] = refused
    assert works == [reader] and isinstance(exc, ac.InvalidArgument)
    assert gate.run(
        spans([_spec(out)]), [ac.Work("all_reduce", 3)], lambda: None
    )  # nothing left behind


def test_gate_a_failed_issue_leaves_nothing_behind() -> None:
    gate, refused = _gate()
    t = torch.zeros(4)

    def refuse() -> None:
        raise ac.InvalidArgument("bad")

    with pytest.raises(ac.InvalidArgument):
        gate.run(spans([_spec(t)]), [ac.Work("all_reduce", 1)], refuse)
    assert gate.run(spans([_spec(t)]), [ac.Work("all_reduce", 2)], lambda: None)
    assert not refused  # the caller got its own op's error


def test_gate_absorbs_what_finished_on_the_next_call_when_nothing_is_held() -> None:
    """The completion thread's report takes no lock while nothing is held: the next call
    absorbs it. A call held meanwhile absorbs it too, and goes at once."""
    (gate, _), issued = _gate(), []
    t = torch.zeros(4)
    first, second = ac.Work("all_reduce", 1), ac.Work("all_reduce", 2)
    assert gate.run(spans([_spec(t)]), [first], issued.append, 1)
    gate.finished([first])  # reported, not absorbed yet
    assert gate.run(spans([_spec(t)]), [second], issued.append, 2)  # absorbed first: goes
    # A report that lands after run()'s first absorb but before the call is held
    # (the race the second absorb closes): the held call still goes, without any
    # further report.
    third = ac.Work("all_reduce", 3)
    real_overlaps = gate._overlaps

    def report_meanwhile(ranges: list[tuple[int, int]]) -> bool:
        found = real_overlaps(ranges)
        gate.finished([second])  # sees nothing held: leaves it for the caller
        gate._overlaps = real_overlaps  # type: ignore[method-assign]
        return found

    gate._overlaps = report_meanwhile  # type: ignore[method-assign]
    assert not gate.run(spans([_spec(t)]), [third], issued.append, 3)
    assert issued == [1, 2, 3] and gate.holding == 0


def test_gate_bounds_what_it_keeps_unabsorbed() -> None:
    """Reports nobody absorbs (no further calls) keep their Works alive: past
    ``absorb_after`` of them the reporting thread absorbs them itself."""
    (gate, _), issued = _gate(), []
    works = [ac.Work("all_reduce", i) for i in range(2 * MemoryGate.absorb_after)]
    tensors = [torch.zeros(2) for _ in works]
    for i, (w, t) in enumerate(zip(works, tensors)):
        assert gate.run(spans([_spec(t)]), [w], issued.append, i)
    for w in works:
        gate.finished([w])
    assert len(gate._done) < MemoryGate.absorb_after


def test_gate_close_drops_what_it_holds() -> None:
    (gate, _), issued = _gate(), []
    t = torch.zeros(4)
    first = ac.Work("all_reduce", 1)
    gate.run(spans([_spec(t)]), [first], issued.append, 1)
    gate.run(spans([_spec(t)]), [ac.Work("all_reduce", 2)], issued.append, 2)
    gate.close()
    gate.finished([first])
    assert issued == [1] and gate.holding == 0 and not gate._done


def test_spans_merge_and_cover_non_contiguous_tensors() -> None:
    t = torch.zeros(8)
    assert spans([_spec(t[0:4]), _spec(t[2:6])]) == [(t.data_ptr(), t.data_ptr() + 24)]
    assert spans([_spec(torch.zeros(0))]) == []
    m = torch.zeros(4, 4)
    col = m[:, 1]  # strided: its whole storage counts
    assert spans([_spec(col)]) == [(m.data_ptr(), m.data_ptr() + 64)]


async def chain_awaiting_only_the_last(comm: ac.Communicator, depth: int) -> list[float]:
    """``depth`` all_reduces of one tensor, only the last one awaited: each held op must
    be driven to its turn by the backend, not by someone awaiting it. The 100 ops in
    front fill the completion queue past its backlog, whose ring merges the held ops'
    rings into one drain (before the fix: a hang in 3 runs of 3)."""
    others = [torch.ones(4) for _ in range(100)]  # past the completion queue's backlog (64)
    for x in others:
        comm.all_reduce(x)
    t = torch.ones(4)
    works = [comm.all_reduce(t) for _ in range(depth)]
    await works[-1]
    return t.tolist()


def test_a_chain_of_held_ops_completes_when_only_the_last_is_awaited() -> None:
    depth = 20
    assert (
        run_ranks(chain_awaiting_only_the_last, world_size=2, args=(depth,), timeout=60)
        == [[2.0**depth] * 4] * 2
    )
