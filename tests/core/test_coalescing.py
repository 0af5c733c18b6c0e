"""``comm.coalescing()`` (API.md §4) on Gloo: flattening, task scope, failures, misuse.

Rank functions are module-level so the worker processes of ``run_ranks`` can import
them; each checks its own results and raises on a mismatch (re-raised here), and
returns what the parent checks across ranks. Inputs are small integers, so sums are
exact in every dtype used, including bfloat16.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any

import anyio
import pytest
import torch

import asynccoll as ac
from asynccoll._backends.flatten import plan
from asynccoll._base.ops import OpKind, OpSpec
from asynccoll.testing import run_ranks
from tests.support.backends import LOOPS, in_task

pytestmark = pytest.mark.timeout(120)

RUN_TIMEOUT = 60

# asyncio at world sizes 2 and 3; the other loops at 2 (the bodies are loop-neutral).
RUNS = [
    pytest.param(2, "asyncio", id="asyncio-2"),
    pytest.param(3, "asyncio", id="asyncio-3"),
    pytest.param(2, "uvloop", id="uvloop-2"),
    pytest.param(2, "trio", id="trio-2"),
]


# ------------------------------------------------------------------ helpers
def _val(rank: int, i: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s deterministic input number ``i`` (small integers)."""
    n = 1
    for d in shape:
        n *= d
    return ((torch.arange(n) % 5) + rank * 3 + i).reshape(shape).to(dtype)


def _expect_reduce(
    op: ac.ReduceOp, i: int, shape: tuple[int, ...], dtype: torch.dtype, ws: int
) -> torch.Tensor:
    vals = [_val(r, i, shape, torch.float64) for r in range(ws)]
    if op is ac.ReduceOp.MAX:
        out = torch.stack(vals).amax(0)
    else:
        out = torch.stack(vals).sum(0)
        if op is ac.ReduceOp.AVG:
            out = out / ws if dtype.is_floating_point else torch.div(out, ws, rounding_mode="floor")
    return out.to(dtype)


def _check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        raise AssertionError(
            f"{name}: got {got.tolist()} ({got.dtype}), want {want.tolist()} ({want.dtype})"
        )


class _SubmitSpy:
    """Records (kind, numel) of every op the comm's CPU backend starts on its group
    (``_issue``: past the memory gate, where a batch's flattened ops go)."""

    def __init__(self, comm: Any) -> None:
        self.backend = comm._backends["cpu"]
        self.calls: list[tuple[str, int]] = []
        orig = self.backend._issue

        def issue(spec: OpSpec, work: ac.Work) -> None:
            t = spec.tensor if spec.tensor is not None else spec.output
            self.calls.append((spec.kind.value, 0 if t is None else t.numel()))
            orig(spec, work)

        self.backend._issue = issue

    def __enter__(self) -> _SubmitSpy:
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.backend._issue  # back to the class's method


async def _sum_check(comm: Any) -> None:
    """A plain collective after the test's batch: proves both ranks are in step."""
    t = torch.full((5,), float(comm.rank + 1))
    await comm.all_reduce(t)
    want = float(sum(r + 1 for r in range(comm.world_size)))
    _check("follow-up all_reduce", t, torch.full((5,), want))


# --------------------------------------------------------- rank functions
SIZES = [(1,), (7,), (256,), (3, 5), (1000,), (2, 2, 3)]


async def _mixed_batch(comm: Any) -> dict[str, Any]:
    r, ws = comm.rank, comm.world_size
    S, AVG, MAX = ac.ReduceOp.SUM, ac.ReduceOp.AVG, ac.ReduceOp.MAX
    checks: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    with _SubmitSpy(comm) as spy:
        async with comm.coalescing() as group:
            # all_reduce SUM, float32, many sizes (one flat group)
            for i, shape in enumerate(SIZES):
                t = _val(r, i, shape, torch.float32)
                comm.all_reduce(t)
                checks.append(
                    (f"sum f32 {shape}", t, _expect_reduce(S, i, shape, torch.float32, ws))
                )
            # broadcast from the last rank: its own flat group
            for i in range(3):
                t = _val(r, 10 + i, (4 + i,), torch.float32)
                comm.broadcast(t, ws - 1)
                checks.append((f"bcast {i}", t, _val(ws - 1, 10 + i, (4 + i,), torch.float32)))
            # AVG: native or emulated, float and int
            for i, dtype in enumerate([torch.float32, torch.float32, torch.int64, torch.int64]):
                t = _val(r, 20 + i, (6,), dtype)
                comm.all_reduce(t, AVG)
                checks.append((f"avg {dtype}", t, _expect_reduce(AVG, 20 + i, (6,), dtype, ws)))
            # MAX, int32, and SUM in other dtypes (each its own group)
            for i in range(2):
                t = _val(r, 30 + i, (9,), torch.int32) * (1 if r % 2 else -1)
                comm.all_reduce(t, MAX)
                want = torch.stack(
                    [_val(q, 30 + i, (9,), torch.int32) * (1 if q % 2 else -1) for q in range(ws)]
                ).amax(0)
                checks.append((f"max i32 {i}", t, want))
            for i, dtype in enumerate([torch.float64, torch.bfloat16, torch.int64, torch.float64]):
                t = _val(r, 40 + i, (3, 2), dtype)
                comm.all_reduce(t)
                checks.append((f"sum {dtype}", t, _expect_reduce(S, 40 + i, (3, 2), dtype, ws)))
            # p2p ring: never flattened
            send = _val(r, 50, (8,), torch.float32)
            recv = torch.zeros(8)
            comm.send(send, (r + 1) % ws)
            comm.recv(recv, (r - 1) % ws)
            checks.append(("recv", recv, _val((r - 1) % ws, 50, (8,), torch.float32)))
            # all_gather, two sizes and shapes
            for i, shape in enumerate([(3,), (2, 4)]):
                inp = _val(r, 60 + i, shape, torch.float32)
                out = torch.empty((ws * shape[0], *shape[1:]))
                comm.all_gather(out, inp)
                checks.append(
                    (
                        f"all_gather {shape}",
                        out,
                        torch.cat([_val(q, 60 + i, shape, torch.float32) for q in range(ws)]),
                    )
                )
            comm.barrier()
            # reduce_scatter, SUM (two members) and AVG (one member: submitted as is)
            for i, (op, shape) in enumerate([(S, (2,)), (S, (3, 2)), (AVG, (4,))]):
                inp = _val(r, 70 + i, (ws * shape[0], *shape[1:]), torch.float32)
                out = torch.empty(shape)
                comm.reduce_scatter(out, inp, op)
                full = _expect_reduce(op, 70 + i, (ws * shape[0], *shape[1:]), torch.float32, ws)
                checks.append((f"reduce_scatter {op.name} {shape}", out, full.chunk(ws)[r]))
            # more SUM f32 after everything else: joins the first group
            t = _val(r, 80, (11,), torch.float32)
            comm.all_reduce(t)
            checks.append(("late sum f32", t, _expect_reduce(S, 80, (11,), torch.float32, ws)))
        members = len(group.works)
        assert all(w.done() for w in group.works), "wait=True returned before every member finished"
    for name, got, want in checks:
        _check(name, got, want)
    await _sum_check(comm)
    return {"calls": spy.calls, "members": members}


def _mixed_expected_calls(rank: int, ws: int) -> list[tuple[str, int]]:
    f32_sum = sum(torch.Size(s).numel() for s in SIZES) + 11
    return [
        ("all_reduce", f32_sum),  # 6 sizes + the late one, flattened
        ("broadcast", 4 + 5 + 6),  # 3 broadcasts from one root
        ("all_reduce", 12),  # AVG float32 x2
        ("all_reduce", 12),  # AVG int64 x2
        ("all_reduce", 18),  # MAX int32 x2
        ("all_reduce", 12),  # SUM float64 x2 (1st and 4th)
        ("all_reduce", 6),  # SUM bfloat16 alone: as is
        ("all_reduce", 6),  # SUM int64 alone: as is
        ("send", 8),
        ("recv", 8),
        ("all_gather", 3 + 8),  # both inputs, flattened
        ("barrier", 0),
        ("reduce_scatter", ws * (2 + 6)),  # SUM x2, flattened
        ("reduce_scatter", ws * 4),  # AVG alone
    ]


async def _interleaved(comm: Any) -> dict[str, Any]:
    r, ws = comm.rank, comm.world_size
    mine = torch.full((4,), float(r + 1))
    theirs = torch.full((3,), float(10 * (r + 1)))

    async def other() -> torch.Tensor:
        # created inside the body, so it inherits the ContextVar: still not captured
        return await comm.all_reduce(theirs)

    async with comm.coalescing() as group:
        work = comm.all_reduce(mine)
        # If the other task's op were captured, it could not complete before the
        # batch is issued, and this wait would time out.
        out = await in_task(other, 20)
        assert not work.done(), "a recorded op ran before the batch exited"
        captured = list(group.works)
    assert captured == [work]
    _check("other task", out, torch.full((3,), float(10 * sum(range(1, ws + 1)))))
    # another thread in the body's context, while the body's task runs (it joins the thread
    # without awaiting): not captured either
    from_thread = torch.full((2,), 5.0)
    issued: list[ac.Work] = []
    async with comm.coalescing() as group3:
        comm.all_reduce(torch.ones(1))
        context = contextvars.copy_context()  # holds the batch
        thread = threading.Thread(
            target=context.run, args=(lambda: issued.append(comm.all_reduce(from_thread)),)
        )
        thread.start()
        thread.join(20)
    assert len(group3.works) == 1 and issued and issued[0] not in group3.works
    with anyio.fail_after(20):
        await issued[0]
    _check("other thread", from_thread, torch.full((2,), 5.0 * ws))
    _check("batched", mine, torch.full((4,), float(sum(range(1, ws + 1)))))
    # a task created before the body, running concurrently with it
    gate, finished = anyio.Event(), anyio.Event()
    later = torch.full((2,), 1.0)

    async def outside() -> None:
        await gate.wait()
        await comm.all_reduce(later)
        finished.set()

    batched = torch.full((2,), 2.0)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(outside)  # its task exists before the body starts
            await anyio.sleep(0)
            async with comm.coalescing() as group2:
                comm.all_reduce(batched)
                gate.set()
                await finished.wait()
    assert len(group2.works) == 1
    _check("outside task", later, torch.full((2,), float(ws)))
    _check("batched 2", batched, torch.full((2,), 2.0 * ws))
    await _sum_check(comm)
    return {"ok": True}


class _BodyError(Exception):
    pass


async def _body_raises(comm: Any) -> dict[str, Any]:
    r = comm.rank
    before_seq = comm.ledger.last_seq
    ts = [torch.full((3,), float(r + 1)) for _ in range(4)]
    with _SubmitSpy(comm) as spy:
        try:
            async with comm.coalescing() as group:
                for t in ts:
                    comm.all_reduce(t)
                comm.barrier()
                raise _BodyError(f"rank {r} body failed")
        except _BodyError as exc:
            raised = exc
        else:
            raise AssertionError("the body's exception did not propagate")
        assert spy.calls == [], f"a failed batch submitted {spy.calls}"
    works = group.works
    assert len(works) == 5
    for w in works:
        assert w.done()
        try:
            await w
        except _BodyError as exc:
            assert exc is raised
        else:
            raise AssertionError("a member of a failed batch succeeded")
    # untouched tensors, a usable communicator, seqs given back
    for t in ts:
        _check("untouched", t, torch.full((3,), float(r + 1)))
    assert comm.state == "ok" and comm.pending == 0
    assert comm.ledger.last_seq == before_seq, (comm.ledger.last_seq, before_seq)
    try:
        await group
    except _BodyError:
        pass
    else:
        raise AssertionError("await group of a failed batch succeeded")
    await _sum_check(comm)  # nothing of the batch was issued on any rank
    return {"seq_after": comm.ledger.last_seq - before_seq}


async def _body_raises_after_interleaved_op(comm: Any) -> int:
    """Another op took a seq meanwhile: the failed members' seqs stay a gap (same on every rank)."""
    before = comm.ledger.last_seq
    try:
        async with comm.coalescing():
            comm.all_reduce(torch.ones(2))
            await in_task(lambda: _sum_check(comm))
            raise _BodyError("late")
    except _BodyError:
        pass
    w = comm.all_reduce(torch.ones(1))
    await w
    assert comm.state == "ok"
    return w.seq - before


async def _body_timeout(comm: Any) -> str:
    ts = [torch.ones(4) for _ in range(3)]
    try:
        with anyio.fail_after(0.3):
            async with comm.coalescing() as group:
                for t in ts:
                    comm.all_reduce(t)
                await anyio.sleep(30)
    except TimeoutError:
        pass
    else:
        raise AssertionError("fail_after did not fire")
    for w in group.works:  # asyncio.CancelledError or trio.Cancelled
        assert w.done() and isinstance(w.exception(), anyio.get_cancelled_exc_class())
    assert comm.state == "ok" and comm.pending == 0
    await _sum_check(comm)
    return "ok"


async def _wait_false(comm: Any) -> list[list[float]]:
    r, ws = comm.rank, comm.world_size
    ts = [torch.full((i + 1,), float(r + i)) for i in range(5)]
    inp = torch.full((2,), float(r))
    out = torch.empty(2 * ws)
    async with comm.coalescing(wait=False) as group:
        for t in ts:
            comm.all_reduce(t)
        comm.all_gather(out, inp)
    assert len(group.works) == 6
    results = await group
    assert len(results) == 6 and all(a is b for a, b in zip(results, [*ts, out]))
    for i, t in enumerate(ts):
        _check(f"wait=False {i}", t, torch.full((i + 1,), float(sum(q + i for q in range(ws)))))
    _check("wait=False all_gather", out, torch.cat([torch.full((2,), float(q)) for q in range(ws)]))
    assert await group == results  # awaiting again gives the same results
    async with comm.coalescing(wait=False) as empty:
        pass
    assert await empty == [] and empty.works == []
    await _sum_check(comm)
    return [t.tolist() for t in ts]


async def _misuse(comm: Any) -> list[str]:
    seen: list[str] = []
    r, ws = comm.rank, comm.world_size
    t = torch.full((3,), float(r))
    async with comm.coalescing() as group:
        comm.all_reduce(t)
        try:
            async with comm.coalescing():
                pass
        except ac.InvalidArgument:
            seen.append("nested")
        try:
            await group
        except ac.InvalidArgument:
            seen.append("await-early")

        # a child task is not "nested": it may batch on its own
        async def child() -> torch.Tensor:
            c = torch.full((2,), 1.0)
            async with comm.coalescing():
                comm.all_reduce(c)
            return c

        c = await in_task(child)
        _check("child batch", c, torch.full((2,), float(ws)))
    _check("outer batch survived the misuse", t, torch.full((3,), float(sum(range(ws)))))
    try:
        async with group:
            pass
    except ac.InvalidArgument:
        seen.append("re-enter")
    try:
        comm.coalescing(wait="yes")  # type: ignore[arg-type]
    except ac.InvalidArgument:
        seen.append("bad-wait")
    await _sum_check(comm)
    return seen


async def _non_flattenable(comm: Any) -> dict[str, Any]:
    r, ws = comm.rank, comm.world_size
    checks: list[tuple[str, Any, Any]] = []
    with _SubmitSpy(comm) as spy:
        async with comm.coalescing() as group:
            # broadcasts from different roots: one per root, each as is
            bs = []
            for root in range(ws):
                b = _val(r, root, (3,), torch.float32)
                comm.broadcast(b, root)
                bs.append((root, b))
            red = _val(r, 5, (4,), torch.float32)
            comm.reduce(red, 0)
            a2a_in = _val(r, 6, (ws * 2,), torch.float32)
            a2a_out = torch.empty(ws * 2)
            comm.all_to_all(a2a_out, a2a_in)
            g_in = _val(r, 7, (2,), torch.float32)
            g_out = torch.empty(ws * 2) if r == 0 else None
            comm.gather(g_in, 0, g_out)
            s_out = torch.empty(2)
            s_in = _val(0, 8, (ws * 2,), torch.float32) if r == ws - 1 else None
            comm.scatter(s_out, ws - 1, s_in)
            comm.barrier()
            p = torch.zeros(5)
            if r == 0:
                comm.send(_val(0, 9, (5,), torch.float32), 1)
            elif r == 1:
                comm.recv(p, 0)
    for root, b in bs:
        checks.append((f"bcast root {root}", b, _val(root, root, (3,), torch.float32)))
    if r == 0:
        checks.append(
            (
                "reduce",
                red,
                torch.stack([_val(q, 5, (4,), torch.float32) for q in range(ws)]).sum(0),
            )
        )
        checks.append(
            ("gather", g_out, torch.cat([_val(q, 7, (2,), torch.float32) for q in range(ws)]))
        )
    want_a2a = torch.cat([_val(q, 6, (ws * 2,), torch.float32).chunk(ws)[r] for q in range(ws)])
    checks.append(("all_to_all", a2a_out, want_a2a))
    checks.append(("scatter", s_out, _val(0, 8, (ws * 2,), torch.float32).chunk(ws)[r]))
    if r == 1:
        checks.append(("recv", p, _val(0, 9, (5,), torch.float32)))
    for name, got, want in checks:
        _check(name, got, want)
    await _sum_check(comm)
    return {"calls": [k for k, _ in spy.calls], "members": len(group.works)}


async def _aborted_in_body(comm: Any) -> str:
    t = torch.ones(2)
    group = comm.coalescing()
    try:
        async with group:
            comm.all_reduce(t)
            comm.abort("test abort")
    except ac.CommAborted as exc:
        if not group.works:  # the peer aborted first and its news came before this rank's body
            assert "aborted by rank" in str(exc), repr(exc)
            return str(comm.state)
    else:
        raise AssertionError("exiting a batch of an aborted communicator did not raise")
    (w,) = group.works
    assert isinstance(w.exception(), ac.CommAborted)
    _check("not reduced", t, torch.ones(2))
    return comm.state


async def _single_op(comm: Any) -> list[tuple[str, int]]:
    t = torch.full((6,), float(comm.rank))
    with _SubmitSpy(comm) as spy:
        async with comm.coalescing():
            comm.all_reduce(t, ac.ReduceOp.AVG)
    _check("single AVG", t, torch.full((6,), sum(range(comm.world_size)) / comm.world_size))
    return spy.calls


async def _member_views(comm: Any) -> dict[str, Any]:
    """A batch's members are light Works over one pending entry: each keeps its own
    seq, result, callback and blocking wait."""
    import threading

    ts = [torch.full((3,), float(comm.rank + i)) for i in range(3)]
    if comm.rank == 1:
        await anyio.sleep(0.3)  # rank 0's batch stays in flight meanwhile
    async with comm.coalescing(wait=False) as group:
        for t in ts:
            comm.all_reduce(t)
    a, b, c = group.works
    in_flight = comm.pending
    seen: list[Any] = []
    b.add_done_callback(seen.append)
    blocked: list[Any] = []
    thread = threading.Thread(target=lambda: blocked.append(c.wait(20)))
    thread.start()
    results = await group
    await anyio.to_thread.run_sync(thread.join, 20)
    ws = comm.world_size
    for i, t in enumerate(ts):
        _check(f"member {i}", t, torch.full((3,), float(sum(r + i for r in range(ws)))))
    assert (
        results[0] is ts[0]
        and await a is ts[0]
        and blocked == [ts[2]]
        and a.done()
        and b.result() is ts[1]
    )
    for _ in range(100):  # the callback runs on the loop that added it
        if seen:
            break
        await anyio.sleep(0.01)
    assert seen == [b], seen
    assert [w.seq for w in group.works] == [a.seq, a.seq + 1, a.seq + 2]
    return {"in_flight": in_flight, "pending_after": comm.pending}


async def _batch_deadline(comm: Any) -> list[str]:
    """A batch has ONE deadline: its first pending member times out, the others abort."""
    if comm.rank == 1:  # never joins; the abort is rank 0's alone
        await anyio.sleep(1.5)
        return []
    async with comm.coalescing(wait=False) as group:
        comm.all_reduce(torch.ones(2))
        comm.broadcast(torch.ones(3), 0, timeout=0.4)  # the batch's deadline: its shortest timeout
        comm.all_reduce(torch.ones(4))
    out = []
    for w in group.works:
        with pytest.raises(ac.CommAborted if out else ac.CollectiveTimeout) as info:
            await w
        exc = info.value
        if out:
            assert isinstance(exc.__cause__, ac.CollectiveTimeout), repr(exc.__cause__)
        else:
            assert exc.seq == group.works[0].seq and exc.op == "all_reduce", (exc.seq, exc.op)
        out.append(type(exc).__name__)
    assert comm.state == "aborted" and comm.pending == 0
    return out


async def _recorded_when_issued(comm: Any) -> dict[str, Any]:
    """Members enter the flight record when their batch is issued, not at their calls;
    an op another task issued meanwhile (a higher seq, recorded first) keeps its record."""
    first = comm.all_reduce(torch.ones(2))
    await first
    async with comm.coalescing() as group:
        comm.all_reduce(torch.ones(3))
        await in_task(lambda: _sum_check(comm))  # seq + 2, issued and recorded at once
        comm.broadcast(torch.ones(4), 0)
        during = {r["seq"] for r in comm.flight_record()}
    member_seqs = [w.seq for w in group.works]
    records = {r["seq"]: r for r in comm.flight_record()}
    assert not during & set(member_seqs), f"members recorded before the batch was issued: {during}"
    assert sorted(records) == list(range(first.seq, first.seq + 4)), sorted(records)
    other = records[first.seq + 2]
    assert other["op"] == "all_reduce" and "batch" not in other and other["state"] == "done"
    for seq, op, shape in zip(member_seqs, ("all_reduce", "broadcast"), ([3], [4])):
        rec = records[seq]
        assert (rec["op"], rec["shape"], rec["batch"], rec["state"]) == (
            op,
            shape,
            member_seqs[0],
            "done",
        ), rec
        assert rec["issued_at"] >= other["issued_at"], (rec, other)
    try:
        async with comm.coalescing():
            comm.all_reduce(torch.ones(5))
            raise _BodyError("never issued")
    except _BodyError:
        pass
    assert max(r["seq"] for r in comm.flight_record()) == first.seq + 3  # nothing of it recorded
    await _sum_check(comm)
    return {"members": [s - first.seq for s in member_seqs]}


# ------------------------------------------------------------------- tests
@pytest.mark.parametrize("loop", LOOPS)
def test_members_are_views_over_one_pending_entry(loop: str) -> None:
    results = run_ranks(_member_views, world_size=2, timeout=RUN_TIMEOUT, loop=loop)
    assert results[0] == {
        "in_flight": 1,
        "pending_after": 0,
    }  # rank 1 was late: in flight as ONE op


@pytest.mark.parametrize("loop", LOOPS)
def test_batch_deadline_times_out_first_member_and_aborts_the_rest(loop: str) -> None:
    results = run_ranks(_batch_deadline, world_size=2, timeout=RUN_TIMEOUT, loop=loop)
    assert results[0] == ["CollectiveTimeout", "CommAborted", "CommAborted"]


@pytest.mark.parametrize("world_size,loop", RUNS)
def test_mixed_batch_is_flattened_and_correct(world_size: int, loop: str) -> None:
    results = run_ranks(_mixed_batch, world_size=world_size, timeout=RUN_TIMEOUT, loop=loop)
    for rank, res in enumerate(results):
        assert res["members"] == 6 + 3 + 4 + 2 + 4 + 2 + 2 + 1 + 3 + 1
        want = _mixed_expected_calls(rank, world_size)
        assert res["calls"] == want, (rank, res["calls"])


@pytest.mark.parametrize("world_size,loop", RUNS)
def test_other_tasks_are_not_captured(world_size: int, loop: str) -> None:
    assert (
        run_ranks(_interleaved, world_size=world_size, timeout=RUN_TIMEOUT, loop=loop)
        == [{"ok": True}] * world_size
    )


@pytest.mark.parametrize("world_size,loop", RUNS)
def test_body_exception_issues_nothing(world_size: int, loop: str) -> None:
    results = run_ranks(_body_raises, world_size=world_size, timeout=RUN_TIMEOUT, loop=loop)
    assert results == [{"seq_after": 1}] * world_size  # only the follow-up took a seq


@pytest.mark.parametrize("loop", LOOPS)
def test_body_exception_after_interleaved_op_leaves_seq_gap(loop: str) -> None:
    # seqs: batch member (1), the other task's op (2), the next op (3): member's seq is not reused
    assert run_ranks(
        _body_raises_after_interleaved_op, world_size=2, timeout=RUN_TIMEOUT, loop=loop
    ) == [3, 3]


@pytest.mark.parametrize("loop", LOOPS)
def test_timeout_around_body_cancels_batch(loop: str) -> None:
    assert run_ranks(_body_timeout, world_size=2, timeout=RUN_TIMEOUT, loop=loop) == ["ok", "ok"]


@pytest.mark.parametrize("world_size,loop", RUNS)
def test_wait_false_then_await_group(world_size: int, loop: str) -> None:
    results = run_ranks(_wait_false, world_size=world_size, timeout=RUN_TIMEOUT, loop=loop)
    assert results[0] == results[-1]


@pytest.mark.parametrize("loop", LOOPS)
def test_misuse_raises_invalid_argument(loop: str) -> None:
    results = run_ranks(_misuse, world_size=2, timeout=RUN_TIMEOUT, loop=loop)
    assert results == [["nested", "await-early", "re-enter", "bad-wait"]] * 2


@pytest.mark.parametrize("world_size,loop", RUNS)
def test_batch_of_non_flattenable_ops(world_size: int, loop: str) -> None:
    results = run_ranks(_non_flattenable, world_size=world_size, timeout=RUN_TIMEOUT, loop=loop)
    for rank, res in enumerate(results):
        p2p = {0: ["send"], 1: ["recv"]}.get(rank, [])
        want = (
            ["broadcast"] * world_size
            + ["reduce", "all_to_all", "gather", "scatter", "barrier"]
            + p2p
        )
        assert res["calls"] == want
        assert res["members"] == len(want)


@pytest.mark.parametrize("loop", LOOPS)
def test_abort_during_body_fails_members(loop: str) -> None:
    assert run_ranks(_aborted_in_body, world_size=2, timeout=RUN_TIMEOUT, loop=loop) == [
        "aborted",
        "aborted",
    ]


@pytest.mark.parametrize("loop", LOOPS)
def test_batch_of_one_is_submitted_as_is(loop: str) -> None:
    assert (
        run_ranks(_single_op, world_size=2, timeout=RUN_TIMEOUT, loop=loop)
        == [[("all_reduce", 6)]] * 2
    )


@pytest.mark.parametrize("loop", LOOPS)
def test_members_are_recorded_when_the_batch_is_issued(loop: str) -> None:
    assert (
        run_ranks(_recorded_when_issued, world_size=2, timeout=RUN_TIMEOUT, loop=loop)
        == [{"members": [1, 3]}] * 2
    )


def test_plan_is_deterministic_and_ordered() -> None:
    f32, f64 = torch.zeros(4), torch.zeros(4, dtype=torch.float64)
    specs = [
        OpSpec(OpKind.ALL_REDUCE, f32),
        OpSpec(OpKind.SEND, f32, peer=1),
        OpSpec(OpKind.ALL_REDUCE, f64),
        OpSpec(OpKind.BROADCAST, f32, peer=0),
        OpSpec(OpKind.ALL_REDUCE, f32, reduce_op=ac.ReduceOp.MAX),
        OpSpec(OpKind.ALL_REDUCE, f32),
        OpSpec(OpKind.BROADCAST, f32, peer=1),
        OpSpec(OpKind.BROADCAST, f32, peer=0),
        OpSpec(OpKind.BARRIER),
        OpSpec(OpKind.ALL_REDUCE, f64),
    ]
    assert plan(specs) == [[0, 5], [1], [2, 9], [3, 7], [4], [6], [8]]
    assert plan(specs) == plan(list(specs))


def test_batch_records_stay_bounded_and_keep_interleaved_ops() -> None:
    """``FlightRecorder.issued_batch``: a batch's members join the ring in one pass; the
    records they push out leave the index of unsettled ops, a batch longer than the
    ring keeps its last members only, and an op recorded meanwhile with a higher seq
    (another task's) stays."""
    from asynccoll._base.recorder import FlightRecorder
    from asynccoll._core.work import BatchWork, MemberWork

    def members(first: int, n: int, op: str = "all_reduce") -> list[MemberWork]:
        head = BatchWork(first, lambda e: e)
        return [MemberWork(op, first + i, None, None, head) for i in range(n)]

    spec = OpSpec(OpKind.ALL_REDUCE, torch.ones(3), reduce_op=ac.ReduceOp.SUM)
    rec = FlightRecorder(capacity=8)
    for seq in (1, 2, 3):
        rec.issued(seq, "all_reduce", spec, 1.0)  # never ended: open
    rec.issued(7, "all_reduce", spec, 2.0)  # another task's op, while the batch's body ran
    rec.issued_batch(members(4, 3), [spec] * 3, 3.0, 4)
    assert [r["seq"] for r in rec.snapshot()] == [1, 2, 3, 7, 4, 5, 6]
    assert rec.open_seqs() == [1, 2, 3, 4, 5, 6, 7]
    sends = members(8, 3, "send")
    rec.issued_batch(
        sends, [OpSpec(OpKind.SEND, torch.ones(2), peer=1)] * 3, 4.0, 8
    )  # pushes out seqs 1 and 2
    snap = rec.snapshot()
    assert [r["seq"] for r in snap] == [3, 7, 4, 5, 6, 8, 9, 10]
    assert rec.open_seqs() == [3, 4, 5, 6, 7, 8, 9, 10]
    assert [r.get("cseq") for r in snap[-4:]] == [6, None, None, None] and snap[-1]["batch"] == 8
    rec.issued(11, "all_reduce", spec, 5.0)
    assert rec.snapshot()[-1]["cseq"] == 11 - 3  # three p2p ops before it
    rec.ended_all(range(3, 12), "done", 6.0)
    long = members(12, 20)
    rec.issued_batch(long, [spec] * 20, 7.0, 12)  # longer than the ring
    assert [r["seq"] for r in rec.snapshot()] == list(range(24, 32))
    assert rec.open_seqs() == list(range(24, 32))
