"""Diagnostics (API.md §6): fingerprint check, flight record, trace files, diagnose CLI.

Rank functions are module-level so ``run_ranks`` workers can import them. Every
mismatch test gives its ops a 120 s deadline: a mismatch must be reported within
seconds by the check, never by the deadline, and never by a crashed process.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import subprocess
import sys
import time
import tracemalloc
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import asynccoll as ac
from asynccoll._base.ops import OpKind, OpSpec
from asynccoll._base.recorder import FlightRecorder
from asynccoll.testing import run_ranks, skip_collective

pytestmark = pytest.mark.timeout(180)

LONG = 120.0  # op deadline in mismatch tests: detection must not wait for it
DETECT_WITHIN = 10.0


async def _comm(ctx: Any, **kw: Any) -> ac.Communicator:
    return await ac.init(
        "gloo", rank=ctx.rank, world_size=ctx.world_size, store=ctx.store, timeout=LONG, **kw
    )


# ------------------------------------------------------------------ mismatch kinds
# Each issues, on the last rank, something different from the other ranks, and
# returns the Works whose failure is expected on this rank (None: not involved).
def _odd(comm: ac.Communicator) -> bool:
    return comm.rank == comm.world_size - 1


def k_all_reduce_size(comm: ac.Communicator) -> list[ac.Work]:
    return [comm.all_reduce(torch.ones(6 if _odd(comm) else 4))]


def k_shape(comm: ac.Communicator) -> list[ac.Work]:
    return [comm.all_reduce(torch.ones((3, 2) if _odd(comm) else (2, 3)))]


def k_dtype(comm: ac.Communicator) -> list[ac.Work]:
    return [comm.all_reduce(torch.ones(4, dtype=torch.float64 if _odd(comm) else torch.float32))]


def k_reduce_op(comm: ac.Communicator) -> list[ac.Work]:
    return [comm.all_reduce(torch.ones(4), ac.ReduceOp.MAX if _odd(comm) else ac.ReduceOp.SUM)]


def k_broadcast_root(comm: ac.Communicator) -> list[ac.Work]:
    return [comm.broadcast(torch.ones(4), 1 if _odd(comm) else 0)]


def k_broadcast_size(comm: ac.Communicator) -> list[ac.Work]:
    return [comm.broadcast(torch.ones(8 if _odd(comm) else 4), 0)]


def k_order(comm: ac.Communicator) -> list[ac.Work]:
    a, b = torch.ones(4), torch.ones(4)
    first, second = (lambda: comm.broadcast(b, 0)), (lambda: comm.all_reduce(a))
    if not _odd(comm):
        first, second = second, first
    works = [first()]
    try:
        works.append(second())
    except ac.CommAborted:  # the first op's mismatch was detected already
        pass
    return works


def k_send_recv_size(comm: ac.Communicator) -> list[ac.Work] | None:
    if comm.rank == 0:
        return [comm.send(torch.ones(4), 1)]
    if comm.rank == 1:
        return [comm.recv(torch.ones(8), 0)]
    return None


def k_object(comm: ac.Communicator) -> list[ac.Work]:
    if _odd(comm):
        return [comm.broadcast_object("x", 0)]
    return [comm.all_gather_object(comm.rank)]


def k_batch(comm: ac.Communicator) -> list[ac.Work]:
    raise AssertionError("coalesced batches are issued by _batch_kind")  # see below


KINDS = {
    "all_reduce_size": (k_all_reduce_size, {"shape"}),
    "shape": (k_shape, {"shape"}),
    "dtype": (k_dtype, {"dtype"}),
    "reduce_op": (k_reduce_op, {"reduce_op"}),
    "broadcast_root": (k_broadcast_root, {"root"}),
    "broadcast_size": (k_broadcast_size, {"shape"}),
    "order": (k_order, {"op"}),
    "send_recv_size": (k_send_recv_size, {"shape"}),
    "object": (k_object, {"op"}),
    "batch": (k_batch, {"shape"}),
}


async def _one_kind(ctx: Any, name: str) -> dict[str, Any]:
    comm = await _comm(ctx, check="fingerprint")
    try:
        try:
            await comm.all_reduce(torch.ones(2))  # a matching op first: seqs > 1
        except ac.CommAborted as exc:
            # Only a rank the mismatch does not involve can get here: the involved ranks'
            # check needs this rank's next op, issued after this one finished here. A
            # bystander whose op had not finished locally when the involved ranks aborted
            # (it was starved of CPU) hears their news: the abort is communicator-wide.
            if name != "send_recv_size" or comm.rank in (0, 1):
                raise
            return {"involved": False, "news": str(exc)}
        t0 = time.monotonic()
        if name == "batch":
            works: list[ac.Work] | None = None
            try:
                async with comm.coalescing() as group:
                    comm.all_reduce(torch.ones(4))
                    comm.all_reduce(torch.ones(5 if _odd(comm) else 3))
                raise AssertionError("the batch did not raise")
            except ac.CollectiveMismatch as exc:
                errors: list[BaseException] = [exc]
                errors += [w.exception() for w in group.works]  # type: ignore[misc]
        else:
            works = KINDS[name][0](comm)
            if works is None:  # not involved (p2p between other ranks)
                return {"involved": False}
            errors = []
            for w in works:
                try:
                    await w
                except ac.AsyncCollError as exc:
                    errors.append(exc)
                else:
                    raise AssertionError(f"{name}: {w} succeeded on rank {comm.rank}")
        elapsed = time.monotonic() - t0
        first = errors[0]
        # Whichever rank decides first: a peer's abort news carries the mismatch whole,
        # and every involved rank raises it (seq, fields, details), never a bare CommAborted.
        assert isinstance(first, ac.CollectiveMismatch), (name, repr(first))
        # Later Works of the same unit / after it: mismatch copies or CommAborted caused by it.
        for exc in errors[1:]:
            assert isinstance(exc, (ac.CollectiveMismatch, ac.CommAborted)), repr(exc)
            if not isinstance(exc, ac.CollectiveMismatch):
                assert isinstance(exc.__cause__, ac.CollectiveMismatch), repr(exc.__cause__)
        assert comm.state == "aborted"  # already when the first waiter saw the error
        assert isinstance(comm.error.__cause__, ac.CollectiveMismatch), repr(comm.error)
        with pytest.raises(ac.CommAborted):
            comm.all_reduce(torch.ones(1))
        return {
            "involved": True,
            "seconds": elapsed,
            "message": str(first),
            "seq": first.seq,
            "details": sorted(first.details),
            "fields": list(first.fields),
            "copy": pickle.loads(pickle.dumps(first)).fields == first.fields,
        }
    finally:
        await comm.close()


async def every_kind(ctx: Any) -> dict[str, Any]:
    return {name: await _one_kind(ctx, name) for name in KINDS}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_every_mismatch_raises_on_every_rank(world_size: int, loop: str) -> None:
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    results = run_ranks(every_kind, world_size=world_size, backend=None, timeout=150, loop=loop)
    odd = world_size - 1
    for name, (_fn, fields) in KINDS.items():
        involved = [r for r in range(world_size) if results[r][name]["involved"]]
        expected = [0, 1] if name == "send_recv_size" else list(range(world_size))
        assert involved == expected, (name, involved)
        for r in set(range(world_size)) - set(involved):  # a bystander: untouched, or told
            news = results[r][name].get("news")
            assert news is None or results[involved[0]][name]["message"] in news, (name, r, news)
        for r in involved:
            res = results[r][name]
            assert res["seconds"] < DETECT_WITHIN, (name, r, res)
            assert set(res["fields"]) == fields, (name, res)
            assert res["details"] == involved, (name, res)
            assert res["copy"]
            msg = res["message"]
            assert msg.startswith(f"seq {res['seq']} "), msg
            assert (
                f"rank {odd}" in msg
                or f"ranks {odd}" in msg
                or (name == "send_recv_size" and "rank 1" in msg)
            ), msg
            assert "rank 0" in msg or "ranks 0" in msg, msg
        # Every rank reaches the same verdict, in the same words (same seq here).
        assert len({results[r][name]["message"] for r in involved}) == 1, (name, results)


def test_mismatch_text_is_the_same_whichever_rank_detects_it() -> None:
    """Ranks that issued different ops at one seq say the same thing: a rank that
    learns the mismatch from a peer's abort news reads the text that peer wrote
    (the suite once failed at random on ``seq 2 broadcast`` vs ``seq 2 all_reduce``)."""
    from asynccoll._diag.mismatch import fingerprint, mismatch

    reduce = OpSpec(OpKind.ALL_REDUCE, torch.ones(4), reduce_op=ac.ReduceOp.SUM)
    bcast = OpSpec(OpKind.BROADCAST, torch.ones(4), peer=0)
    seqs = {0: 2, 1: 2, 2: 2}
    single = {0: fingerprint(reduce), 1: fingerprint(reduce), 2: fingerprint(bcast)}
    texts = {str(mismatch(seqs, single, me=r)) for r in range(3)}
    assert texts == {"seq 2 all_reduce: op all_reduce on ranks 0, 1, broadcast on rank 2"}, texts
    batch = {
        r: "\x1e".join(single[(r + i) % 3] for i in range(2)) for r in range(3)
    }  # batches of 2, orders differ
    assert len({str(mismatch(seqs, batch, me=r)) for r in range(3)}) == 1


def test_mismatch_message_names_ranks_and_values() -> None:
    results = run_ranks(_size_message, world_size=2, backend=None, timeout=60)
    assert results[0] == results[1] == "seq 2 all_reduce: shape (4,) on rank 0, (6,) on rank 1"


async def _size_message(ctx: Any) -> str:
    comm = await _comm(ctx, check="fingerprint")
    try:
        await comm.all_reduce(torch.ones(2))
        with pytest.raises(ac.CollectiveMismatch) as info:
            await comm.all_reduce(torch.ones(4 + 2 * ctx.rank))
        return str(info.value)
    finally:
        await comm.close()


# ------------------------------------------------------------------ no false alarm
async def agreeing_program(ctx: Any, trace_dir: str) -> list[float]:
    """Every op kind, p2p between ranks 0 and 1 only (seqs then differ on rank 2), batches."""
    comm = await _comm(ctx, check="fingerprint", trace_dir=trace_dir)
    ws, r = comm.world_size, comm.rank
    out = []
    try:
        objs = await comm.all_gather_object({"rank": r})
        assert objs == [{"rank": q} for q in range(ws)]
        assert await comm.broadcast_object("hi" if r == 1 else None, 1) == "hi"
        t = torch.full((4,), float(r + 1))
        await comm.all_reduce(t)
        out.append(t.sum().item())
        b = torch.arange(4.0) if r == 0 else torch.zeros(4)
        await comm.broadcast(b, 0)
        assert b.tolist() == [0.0, 1.0, 2.0, 3.0]
        await comm.reduce(torch.ones(3), 0, ac.ReduceOp.MAX)
        g = torch.zeros(ws * 2)
        await comm.all_gather(g, torch.full((2,), float(r)))
        rs = torch.zeros(2)
        await comm.reduce_scatter(rs, torch.ones(ws * 2))
        a2a = torch.zeros(ws)
        await comm.all_to_all(a2a, torch.full((ws,), float(r)))
        await comm.gather(torch.ones(2), 0, torch.zeros(ws * 2) if r == 0 else None)
        await comm.scatter(torch.zeros(2), 0, torch.ones(ws * 2) if r == 0 else None)
        await comm.barrier()
        if r == 0:  # p2p both ways, issued before awaiting
            x = torch.zeros(3)
            w1, w2 = comm.send(torch.arange(3.0), 1), comm.recv(x, 1)
            await w1
            await w2
            assert x.tolist() == [5.0, 5.0, 5.0]
        elif r == 1:
            y = torch.zeros(3)
            w1, w2 = comm.recv(y, 0), comm.send(torch.full((3,), 5.0), 0)
            await w1
            await w2
            assert y.tolist() == [0.0, 1.0, 2.0]
        async with comm.coalescing():
            u, v = torch.ones(3), torch.ones(5, dtype=torch.float64)
            comm.all_reduce(u)
            comm.all_reduce(v)
        out.append(u.sum().item() + v.sum().item())
        async with comm.coalescing():  # p2p inside a batch: checked pairwise, the rest as a whole
            s = torch.ones(3)
            comm.all_reduce(s)
            if r in (0, 1):
                p2p = torch.full((2,), float(r))
                if r == 0:
                    comm.send(p2p, 1)
                else:
                    comm.recv(p2p, 0)
        assert s.tolist() == [float(ws)] * 3
        if r == 1:
            assert p2p.tolist() == [0.0, 0.0]
        for _ in range(50):  # back-to-back, not awaited one by one
            works = [comm.all_reduce(torch.ones(2)) for _ in range(4)]
            for w in works:
                await w
        assert comm.state == "ok"
        return out
    finally:
        await comm.close()


@pytest.mark.parametrize("world_size", [2, 3])
def test_agreeing_ranks_pass_the_check(world_size: int, tmp_path: Path) -> None:
    results = run_ranks(
        agreeing_program, world_size=world_size, backend=None, timeout=90, args=(str(tmp_path),)
    )
    ws = world_size
    for res in results:
        assert res[0] == 4 * ws * (ws + 1) / 2
        assert res[1] == (3 + 5) * ws
    # diagnose lines collectives up by cseq: p2p between ranks 0 and 1 is no disagreement
    proc = _diagnose(tmp_path)
    assert proc.returncode == 0, proc.stdout


# ------------------------------------------------------------------ traces + diagnose
async def never_issues(
    ctx: Any, trace_dir: str, skip: bool, check: str | None = None
) -> dict[str, Any]:
    """Rank 1 does not take part in seq 3 (skip: it skips it locally); rank 0 times out."""
    comm = await _comm(ctx, trace_dir=trace_dir, check=check)
    await comm.all_reduce(torch.ones(2))
    await comm.broadcast(torch.ones(2), 0)
    if comm.rank == 0:
        with pytest.raises(ac.CollectiveTimeout):
            await comm.all_reduce(torch.ones(4), timeout=1.0)
    elif skip:
        skip_collective(comm)
        await comm.all_reduce(torch.ones(4))
    deadline = time.monotonic() + 20
    while comm.state == "ok" and time.monotonic() < deadline:  # rank 1: until rank 0's abort news
        await asyncio.sleep(0.05)
    state = comm.state
    record = comm.flight_record()
    await comm.close()
    return {"state": state, "last": record[-1]}


def _diagnose(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asynccoll.diagnose", str(path), *extra],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("check", [None, "fingerprint"])
def test_rank_that_never_issues_is_named(tmp_path: Path, check: str | None) -> None:
    results = run_ranks(
        never_issues, world_size=2, backend=None, timeout=60, args=(str(tmp_path), False, check)
    )
    assert [r["state"] for r in results] == ["aborted", "aborted"]
    assert results[0]["last"]["seq"] == 3 and results[0]["last"]["state"] == "timed out"
    assert results[1]["last"]["seq"] == 2
    for r in (0, 1):
        assert len(list(tmp_path.glob(f"*.rank{r}.flight.json"))) == 1
        assert len(list(tmp_path.glob(f"*.rank{r}.trace.json"))) == 1
    (flight_file,) = tmp_path.glob("*.rank0.flight.json")
    flight0 = json.loads(flight_file.read_text())
    assert flight0["error_type"] == "CollectiveTimeout"
    proc = _diagnose(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "rank 1 never issued seq 3 all_reduce; issued by rank 0 at" in proc.stdout, proc.stdout
    assert "timed out on rank 0" in proc.stdout
    assert "rank 1: last completed seq 2 broadcast" in proc.stdout
    if check:  # the held op says whose fingerprint it waited for
        assert flight0["waiting"] == [{"seq": 3, "ops": ["all_reduce"], "waiting_for": [1]}]
        assert "seq 3 all_reduce held for the fingerprint of rank 1" in proc.stdout, proc.stdout
    js = json.loads(_diagnose(tmp_path, "--json").stdout)
    assert js["ok"] is False
    behind = [p for p in js["problems"] if p["kind"] == "behind"]
    assert (
        behind
        and behind[0]["rank"] == 1
        and behind[0]["seq"] == 3
        and behind[0]["op"] == "all_reduce"
    )


def test_rank_that_skips_is_named(tmp_path: Path) -> None:
    """skip_collective records the skipped op as skipped, not done: diagnose blames the
    rank that skipped it, not the one that timed out waiting (it said "ended
    differently: timed out on rank 0, done on rank 1")."""
    results = run_ranks(
        never_issues, world_size=2, backend=None, timeout=60, args=(str(tmp_path), True)
    )
    assert [r["state"] for r in results] == ["aborted", "aborted"]
    assert results[1]["last"]["seq"] == 3 and results[1]["last"]["state"] == "skipped", results
    proc = _diagnose(tmp_path)
    assert proc.returncode == 1
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBLEM")]
    assert lines[0].startswith("PROBLEM: rank 1 skipped seq 3 all_reduce"), proc.stdout
    assert "rank 1 never issued seq 3 all_reduce; issued by rank 0 at" in proc.stdout, proc.stdout
    assert "ended differently" not in proc.stdout, proc.stdout
    assert "rank 1: last completed seq 2 broadcast" in proc.stdout, proc.stdout


async def mismatch_traced(ctx: Any, trace_dir: str) -> None:
    comm = await _comm(ctx, check="fingerprint", trace_dir=trace_dir)
    await comm.all_reduce(torch.ones(2))
    with pytest.raises(ac.CollectiveMismatch):
        await comm.all_reduce(torch.ones(2, dtype=torch.float64 if comm.rank else torch.float32))
    await comm.close()


def test_mismatch_trace_and_diagnose(tmp_path: Path) -> None:
    run_ranks(mismatch_traced, world_size=2, backend=None, timeout=60, args=(str(tmp_path),))
    proc = _diagnose(tmp_path)
    assert proc.returncode == 1
    assert (
        "recorded CollectiveMismatch: seq 2 all_reduce: dtype float32 on rank 0, float64 on rank 1"
        in proc.stdout
    )
    assert "seq 2: ranks disagree: dtype float32 on rank 0, float64 on rank 1" in proc.stdout, (
        proc.stdout
    )


async def traced_ops(ctx: Any, trace_dir: str) -> list[dict[str, Any]]:
    comm = await _comm(ctx, trace_dir=trace_dir)
    await comm.all_reduce(torch.ones(2))
    async with comm.coalescing():
        comm.all_reduce(torch.ones(3))
        comm.all_reduce(torch.ones(4))
    if comm.rank == 0:
        await comm.send(torch.ones(2), 1)
    else:
        await comm.recv(torch.ones(2), 0)
    await comm.all_gather_object(comm.rank)
    record = comm.flight_record()
    await comm.close()
    return record


def test_timeline_is_valid_chrome_trace(tmp_path: Path) -> None:
    records = run_ranks(traced_ops, world_size=2, backend=None, timeout=60, args=(str(tmp_path),))
    assert [r["op"] for r in records[0]] == [
        "all_reduce",
        "all_reduce",
        "all_reduce",
        "send",
        "all_gather_object",
    ]
    assert [r["op"] for r in records[1]][3] == "recv"
    assert all(r["state"] == "done" for rs in records for r in rs)
    first = records[0][0]
    assert first["dtype"] == "float32" and first["shape"] == [2] and first["reduce_op"] == "SUM"
    assert first["issued_at"] <= first["ended_at"]
    assert records[0][1]["batch"] == records[0][2]["batch"] == 2
    for rank in (0, 1):
        assert not list(tmp_path.glob(f"*.rank{rank}.flight.json"))  # nothing went wrong
        (timeline_file,) = tmp_path.glob(f"*.rank{rank}.trace.json")
        data = json.loads(timeline_file.read_text())
        events = data["traceEvents"]
        meta = {
            (e["name"], e["args"]["name"]) for e in events if e["ph"] == "M" and "name" in e["args"]
        }
        assert ("process_name", f"rank {rank}") in meta
        assert {("thread_name", s) for s in ("collectives", "p2p", "objects")} <= meta
        ops = [e for e in events if e["ph"] == "X" and e["cat"] == "op"]
        assert sorted(e["args"]["seq"] for e in ops) == [1, 2, 3, 4, 5]
        assert all(e["pid"] == rank and e["dur"] >= 0 for e in ops)
        p2p = [e for e in ops if e["name"] in ("send", "recv")]
        assert len(p2p) == 1 and p2p[0]["tid"] != ops[0]["tid"]
        (batch,) = [e for e in events if e.get("cat") == "batch"]
        assert batch["name"] == "coalesced[2]" and batch["args"]["members"] == [2, 3]
        members = [e for e in ops if e["args"]["seq"] in (2, 3)]
        for m in members:  # drawn inside the batch span, to the float's resolution: ts is
            # time.time() in µs (~1.8e15, one ulp 0.25 µs), so ts + dur rounds differently
            # for a member and its batch even when both end at the same instant
            assert batch["ts"] <= m["ts"] and m["ts"] + m["dur"] <= batch["ts"] + batch["dur"] + 1.0
    proc = _diagnose(tmp_path)
    assert proc.returncode == 0, proc.stdout
    assert "OK" in proc.stdout


# ------------------------------------------------------------------ flight recorder
def _spec(n: int) -> OpSpec:
    return OpSpec(OpKind.ALL_REDUCE, torch.ones(n), reduce_op=ac.ReduceOp.SUM)


def test_flight_record_is_bounded_under_100k_ops() -> None:
    rec = FlightRecorder(capacity=4096)
    spec = _spec(8)
    tracemalloc.start()
    for seq in range(1, 100_001):
        rec.issued(seq, "all_reduce", spec, float(seq))
        if seq % 3:  # a third never ends (lost): must not pin memory either
            rec.ended(seq, "done", float(seq) + 0.5)
        if seq == 10_000:
            base, _ = tracemalloc.get_traced_memory()
    current, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(rec) == 4096
    assert len(rec._open) <= 4096
    assert current - base < 256 * 1024  # no growth between 10k and 100k ops
    snap = rec.snapshot()
    assert snap[0]["seq"] == 100_000 - 4095 and snap[-1]["seq"] == 100_000
    assert snap[-1]["state"] == "done" and snap[-1]["numel"] == 8
    assert snap[-2]["state"] == "issued" and snap[-2]["ended_at"] is None  # seq 99999 never ended


def test_flight_record_cseq_skips_point_to_point_ops() -> None:
    rec = FlightRecorder()
    rec.issued(1, "all_reduce", _spec(2), 1.0)
    rec.issued(2, "send", OpSpec(OpKind.SEND, torch.ones(2), peer=1), 2.0)
    rec.issued(3, "recv", OpSpec(OpKind.RECV, torch.ones(2), peer=1), 3.0)
    rec.issued(4, "barrier", None, 4.0)
    rec.issued(3, "all_reduce", _spec(2), 5.0)  # seq 3 given back and reused: the recv is gone
    snap = rec.snapshot()
    assert [(r["seq"], r.get("cseq")) for r in snap] == [(1, 1), (2, None), (3, 2)]
    assert snap[1]["peer"] == 1


@pytest.mark.parametrize(
    "kinds",
    [
        ("all_reduce", "broadcast", "reduce", "all_gather"),  # recorded in one pass
        (
            "all_reduce",
            "send",
            "barrier",
            "scatter",
            "broadcast",
        ),  # one by one: p2p moves the cseqs
    ],
)
def test_flight_record_of_a_batch_is_its_members_recorded_one_by_one(
    kinds: tuple[str, ...],
) -> None:
    """A batch's records (``issued_batch``) equal what ``issued`` makes for each member,
    after a p2p op that already moved the cseqs: ops, dtypes, shapes, roots, cseqs."""

    def spec(i: int, kind: str) -> OpSpec | None:
        t = torch.ones(i + 1, dtype=torch.float64 if i % 2 else torch.float32)
        if kind == "barrier":
            return None
        if kind == "scatter":
            return OpSpec(OpKind.SCATTER, None, t, peer=1)
        return OpSpec(
            OpKind(kind), t, reduce_op=ac.ReduceOp.MAX if i % 2 else ac.ReduceOp.SUM, peer=i % 3
        )

    members = [(types.SimpleNamespace(seq=3 + i, op=k), spec(i, k)) for i, k in enumerate(kinds)]
    batched, single = FlightRecorder(), FlightRecorder()
    for rec in (batched, single):
        rec.issued(1, "all_reduce", _spec(2), 1.0)
        rec.issued(2, "send", OpSpec(OpKind.SEND, torch.ones(2), peer=1), 1.0)
    batched.issued_batch([w for w, _ in members], [s for _, s in members], 2.0, batch=3)
    for w, s in members:
        single.issued(w.seq, w.op, s, 2.0, batch=3)
    assert batched.snapshot() == single.snapshot()
    assert batched.snapshot()[2]["cseq"] == 2  # the first member, after the send: its seq - 1
    assert batched.open_seqs() == single.open_seqs() == [1, 2] + [w.seq for w, _ in members]


def test_flight_record_reused_seq_replaces_stale_records() -> None:
    rec = FlightRecorder(capacity=16)
    rec.issued(1, "all_reduce", _spec(2), 1.0)
    rec.issued(2, "broadcast", None, 2.0)
    rec.issued(2, "barrier", None, 3.0)  # seq 2 was given back and reused
    rec.discard(3)  # nothing to discard
    assert [(r["seq"], r["op"]) for r in rec.snapshot()] == [(1, "all_reduce"), (2, "barrier")]
    rec.discard(2)
    assert [r["seq"] for r in rec.snapshot()] == [1]


# ------------------------------------------------------------------ diagnose on synthetic files
def _write(path: Path, rank: int, records: list[dict[str, Any]], **extra: Any) -> None:
    data = {
        "kind": "asynccoll.flight_record",
        "rank": rank,
        "world_size": 3,
        "backend": "gloo",
        "reason": None,
        "error_type": None,
        "error": None,
        "records": records,
        "waiting": [],
        **extra,
    }
    (path / f"rank{rank}.flight.json").write_text(json.dumps(data))


def _r(
    seq: int, op: str = "all_reduce", shape: list[int] | None = None, state: str = "done"
) -> dict[str, Any]:
    return {
        "seq": seq,
        "op": op,
        "dtype": "float32",
        "shape": shape or [4],
        "numel": 4,
        "state": state,
        "issued_at": 1000.0 + seq,
        "ended_at": 1000.5 + seq if state != "issued" else None,
    }


def test_diagnose_finds_disagreement_and_missing_rank(tmp_path: Path) -> None:
    _write(
        tmp_path,
        0,
        [_r(1), _r(2, shape=[4], state="issued")],
        waiting=[{"seq": 2, "ops": ["all_reduce"], "waiting_for": [1]}],
    )
    _write(tmp_path, 1, [_r(1), _r(2, shape=[8], state="issued")])
    proc = _diagnose(tmp_path)
    assert proc.returncode == 1
    assert "no trace files from rank 2" in proc.stdout
    assert "seq 2: ranks disagree: shape (4,) on rank 0, (8,) on rank 1" in proc.stdout, proc.stdout
    assert "held for the fingerprint of rank 1" in proc.stdout


def test_diagnose_rejects_empty_dir(tmp_path: Path) -> None:
    assert _diagnose(tmp_path).returncode == 2


# ------------------------------------------------------------------ arguments
async def _bad_args(ctx: Any) -> list[str]:
    errors = []
    for kw in ({"check": "md5"}, {"trace_dir": 42}):
        try:
            await _comm(ctx, **kw)
        except ac.InvalidArgument as exc:
            errors.append(str(exc))
    return errors


def test_bad_check_and_trace_dir_are_invalid_arguments() -> None:
    (errors,) = run_ranks(_bad_args, world_size=1, backend=None, timeout=30)
    assert len(errors) == 2 and "check" in errors[0] and "trace_dir" in errors[1]


async def peer_leaves(ctx: Any) -> dict[str, Any]:
    comm = await _comm(ctx, check="fingerprint")
    await comm.all_reduce(torch.ones(2))
    if comm.rank == 1:
        await comm.close()  # leaves; rank 0 then issues an op rank 1 will never match
        return {}
    t0 = time.monotonic()
    with pytest.raises(ac.PeerFailure) as info:
        await comm.all_reduce(torch.ones(2))
    elapsed = time.monotonic() - t0
    await comm.close()
    return {"ranks": list(info.value.ranks), "seconds": elapsed}


def test_peer_that_leaves_is_named_before_the_deadline() -> None:
    res = run_ranks(peer_leaves, world_size=2, backend=None, timeout=60)[0]
    assert res["ranks"] == [1]
    assert res["seconds"] < DETECT_WITHIN


async def dropped_without_close(ctx: Any) -> list[int]:
    import gc
    import threading

    def readers() -> int:
        return sum(t.name.startswith("asynccoll-fingerprints") for t in threading.enumerate())

    before = readers()
    comm = await _comm(ctx, check="fingerprint")
    await comm.all_reduce(torch.ones(2))
    during = readers()
    del comm
    deadline = time.monotonic() + 10
    while readers() > before and time.monotonic() < deadline:
        gc.collect()
        await asyncio.sleep(0.05)
    return [before, during, readers()]


def test_checker_thread_ends_when_its_communicator_is_collected() -> None:
    for before, during, after in run_ranks(
        dropped_without_close, world_size=2, backend=None, timeout=60
    ):
        assert during == before + 1
        assert after == before


async def verdict_before_news(ctx: Any) -> str:
    """Rank 0's reader thread is held up while rank 1 reaches the mismatch verdict and
    aborts: the abort news from rank 1 reaches rank 0 before rank 0 has read rank 1's
    fingerprint. Rank 0 must still raise the mismatch (API.md §6: on every rank), not
    the news."""
    import threading

    comm = await _comm(ctx, check="fingerprint")
    try:
        await comm.all_reduce(torch.ones(2))
        if comm.rank == 0:
            work = comm.all_reduce(torch.ones(4))  # held: rank 1's fingerprint is not here yet
            checker = comm._diag.checker
            held, release = threading.Event(), threading.Event()

            def stall() -> None:  # the reader thread cannot take the checker's lock meanwhile
                with checker._lock:
                    held.set()
                    release.wait(20)

            threading.Thread(target=stall, daemon=True).start()
            held.wait(10)
            ctx.store.set("rank0/stalled", "1")
            ctx.store.wait(["rank1/aborted"], __import__("datetime").timedelta(seconds=20))
            await asyncio.sleep(1.0)  # rank 1's abort news arrives meanwhile (one store hop)
            release.set()
            try:
                await work
            except ac.AsyncCollError as exc:
                return type(exc).__name__
            return "no error"
        ctx.store.wait(["rank0/stalled"], __import__("datetime").timedelta(seconds=20))
        try:
            await comm.all_reduce(torch.ones(6))
        except ac.AsyncCollError as exc:
            ctx.store.set("rank1/aborted", "1")
            return type(exc).__name__
        return "no error"
    finally:
        comm.abort("test over")
        await comm.close()


def test_a_held_op_raises_the_mismatch_even_when_the_peers_abort_news_comes_first() -> None:
    assert run_ranks(verdict_before_news, world_size=2, backend=None, timeout=90) == [
        "CollectiveMismatch",
        "CollectiveMismatch",
    ]


def test_a_flight_record_written_after_close_still_names_the_held_ops() -> None:
    """An op held for a peer's fingerprint that times out: the abort writes the flight
    record on the deadline thread while the rank's task, already woken by the error,
    may close the communicator (which drops the held ops). The record still says
    which op waited for whom (it once came out empty in a flake-hunt run, 1 in 5)."""
    import socket

    from asynccoll._diag.fingerprint import FingerprintChecker

    out_a, out_b = socket.socketpair()
    in_a, in_b = socket.socketpair()
    checker = FingerprintChecker(0, 2, {1: out_a}, {1: in_a})
    try:
        spec = OpSpec(OpKind.ALL_REDUCE, torch.ones(4), reduce_op=ac.ReduceOp.SUM)
        work = ac.Work("all_reduce", 3)
        checker.gate_op(spec, work, lambda: None)  # rank 1 never sends its fingerprint: held
        held = [{"seq": 3, "ops": ["all_reduce"], "waiting_for": [1]}]
        assert checker.waiting() == held
        checker.close()
        assert checker.waiting() == held
    finally:
        checker.close()
        for s in (out_b, in_b):
            s.close()


def test_the_mesh_never_blocks_an_issuing_thread_before_its_reader_ran() -> None:
    """An op issued right after the fingerprint channel is built pulls from the peers'
    sockets on the issuing thread. The sockets became non-blocking only once the reader
    thread first ran, so an early pull waited in a blocking recv for the peer's next
    frame (``test_a_flight_record_written_after_close_still_names_the_held_ops`` hung
    in it about 1 run in 8 under CPU load)."""
    import socket
    import threading

    from asynccoll._diag.mesh import Mesh

    class User:
        def frames_arrived(self) -> None:
            pass

        def crashed(self, exc: Exception) -> None:
            pass

    out_a, out_b = socket.socketpair()
    in_a, in_b = socket.socketpair()  # blocking, as a fresh socket is
    user = User()
    mesh = Mesh(0, {1: out_a}, {1: in_a}, user)  # its reader thread not started yet
    answers: list[bool] = []

    def early_pull() -> None:
        with mesh.lock:
            answers.append(mesh.pull(1))

    puller = threading.Thread(target=early_pull, daemon=True)
    puller.start()
    puller.join(5)
    blocked = puller.is_alive()
    in_b.close()  # ends a blocked recv (the peer's channel closes)
    puller.join(5)
    mesh.start()
    mesh.close()  # the reader thread ends and closes the mesh's sockets
    deadline = time.monotonic() + 10
    while in_a.fileno() != -1 and time.monotonic() < deadline:
        time.sleep(0.01)
    out_b.close()
    assert not blocked, "pull() blocked before the reader thread ran"
    assert answers == [False]  # nothing there yet, the channel is open
