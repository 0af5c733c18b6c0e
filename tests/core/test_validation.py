"""Bad tensor arguments: a typed error at the call on every rank, never a crash, an abort or garbage.

Each case here once crashed a rank (0-d reduce_scatter output: SIGSEGV in Gloo), hung
the non-roots (0-d gather/scatter chunks were refused on the root only), aborted the
communicator (dtypes Gloo cannot run fail inside the op), or returned garbage
(``all_to_all(t, t)``). Runs on real Gloo ranks under asyncio, uvloop and trio.
"""

from __future__ import annotations

import pytest
import torch

import asynccoll as ac
from asynccoll._backends import nccl
from asynccoll._core import validate
from asynccoll.testing import run_ranks
from tests.support.backends import LOOPS

R = ac.ReduceOp


def _refused(comm: ac.Communicator, call, match: str | None = None) -> str:  # type: ignore[no-untyped-def]
    """``call()`` raises InvalidArgument, takes no sequence number, leaves comm ok."""
    seq = comm.ledger.last_seq
    with pytest.raises(ac.InvalidArgument, match=match) as info:
        call()
    assert comm.ledger.last_seq == seq and comm.state == "ok" and comm.pending == 0
    return str(info.value)


async def zero_dim_chunks(comm: ac.Communicator) -> list[list[float]]:
    r, ws = comm.rank, comm.world_size
    got = []
    # reduce_scatter into a 0-d output: Gloo used to SIGSEGV both processes.
    out = torch.tensor(0.0)
    res = await comm.reduce_scatter(out, torch.arange(ws, dtype=torch.float32) + r)
    assert res is out and out.dim() == 0
    got.append([out.item()])
    # 0-d input to all_gather / gather, 0-d output of scatter, on every rank.
    ag = torch.zeros(ws)
    await comm.all_gather(ag, torch.tensor(float(r + 1)))
    got.append(ag.tolist())
    g = torch.zeros(ws) if r == 0 else None
    await comm.gather(torch.tensor(float(r + 10)), 0, g)
    got.append(g.tolist() if g is not None else [])
    s = torch.tensor(-1.0)
    await comm.scatter(s, 0, torch.arange(ws, dtype=torch.float32) * 2 if r == 0 else None)
    got.append([s.item()])
    # Empty tensors run on every op (measured: Gloo takes them).
    e = torch.zeros(0, 3)
    await comm.all_reduce(e)
    await comm.broadcast(e, 0)
    await comm.all_gather(torch.zeros(0, 3), e)
    await comm.reduce_scatter(torch.zeros(0, 3), torch.zeros(0, 3))
    await comm.all_to_all(torch.zeros(0, 3), e)
    await comm.gather(e, 0, torch.zeros(0, 3) if r == 0 else None)
    await comm.scatter(torch.zeros(0, 3), 0, torch.zeros(0, 3) if r == 0 else None)
    t = torch.ones(2)
    await comm.all_reduce(t)
    assert t.tolist() == [float(ws)] * 2
    return got


@pytest.mark.parametrize("loop", LOOPS)
def test_zero_dim_chunks_work_on_every_rank(loop: str) -> None:
    results = run_ranks(zero_dim_chunks, world_size=2, backend="gloo", timeout=60, loop=loop)
    # reduce_scatter of [0+r, 1+r] summed over r: [1, 3]; rank r keeps element r.
    assert results[0] == [[1.0], [1.0, 2.0], [10.0, 11.0], [0.0]]
    assert results[1] == [[3.0], [1.0, 2.0], [], [2.0]]


async def own_arguments_alike(comm: ac.Communicator) -> int:
    """Checks a rank can make about its own arguments fail the same on root and non-root."""
    ws = comm.world_size
    strided = torch.ones(4, 2).t()
    conj = torch.ones(2, dtype=torch.complex64).conj()
    quant = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)
    cases = [
        lambda: comm.gather(quant, 0, torch.zeros(2 * ws) if comm.rank == 0 else None),
        lambda: comm.scatter(quant, 0, torch.zeros(2 * ws) if comm.rank == 0 else None),
        lambda: comm.all_reduce(quant),
        lambda: comm.broadcast(quant, 0),
        lambda: comm.gather(strided, 0, torch.zeros(4 * ws, 2).t() if comm.rank == 0 else None),
        lambda: comm.gather(
            conj, 0, torch.zeros(2 * ws, dtype=torch.complex64) if comm.rank == 0 else None
        ),
        lambda: comm.scatter(strided, 0, torch.zeros(4 * ws, 2) if comm.rank == 0 else None),
        lambda: comm.scatter(
            conj, 0, torch.zeros(2 * ws, dtype=torch.complex64) if comm.rank == 0 else None
        ),
        lambda: comm.gather(torch.ones(2), dst=0, output=torch.zeros(2 * ws), timeout=float("inf")),
        lambda: comm.broadcast(torch.ones(2), 0, timeout=float("nan")),
    ]
    for case in cases:
        _refused(comm, case)
    t = torch.ones(2)
    await comm.all_reduce(t)
    assert t.tolist() == [float(ws)] * 2
    return len(cases)


@pytest.mark.parametrize("loop", LOOPS)
def test_root_and_non_root_reject_alike(loop: str) -> None:
    assert run_ranks(own_arguments_alike, world_size=2, backend="gloo", timeout=60, loop=loop) == [
        10,
        10,
    ]


async def unsupported_dtypes(comm: ac.Communicator) -> int:
    ws = comm.world_size
    n = 0
    bad_reduce = [
        (dt, op)
        for dt in (
            torch.uint16,
            torch.uint32,
            torch.uint64,
            torch.int16,
            torch.float8_e4m3fn,
            torch.float8_e5m2,
        )
        for op in R
    ] + [(dt, op) for dt in (torch.complex64, torch.complex128) for op in (R.PROD, R.MIN, R.MAX)]
    bad_reduce += [(torch.bool, R.AVG), (torch.complex32, R.AVG)]
    for dt, op in bad_reduce:
        msg = _refused(comm, lambda dt=dt, op=op: comm.all_reduce(torch.zeros(4, dtype=dt), op))
        assert "bool" in msg or "supports" in msg, msg
        _refused(comm, lambda dt=dt, op=op: comm.reduce(torch.zeros(4, dtype=dt), 0, op))
        _refused(
            comm,
            lambda dt=dt, op=op: comm.reduce_scatter(
                torch.zeros(2, dtype=dt), torch.zeros(2 * ws, dtype=dt), op
            ),
        )
        n += 3
    # What Gloo reduces for complex: SUM and AVG.
    c = torch.full((2,), 1 + 2j, dtype=torch.complex64)
    await comm.all_reduce(c, R.AVG)
    assert c.tolist() == [1 + 2j] * 2
    # Data movement of dtypes Gloo lacks travels as bytes, with the right values.
    for dt in (
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.int16,
        torch.float8_e4m3fn,
        torch.complex64,
    ):
        mine = (torch.arange(3) + 10 * comm.rank).to(dt)
        out = torch.zeros(3 * ws, dtype=dt)
        await comm.all_gather(out, mine)
        want = torch.cat([(torch.arange(3) + 10 * r).to(dt) for r in range(ws)])
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), (dt, out)
        b = mine.clone()
        await comm.broadcast(b, 1)
        assert torch.equal(b.view(torch.uint8), (torch.arange(3) + 10).to(dt).view(torch.uint8)), dt
        a2a = torch.zeros(2 * ws, dtype=dt)
        await comm.all_to_all(a2a, torch.full((2 * ws,), comm.rank + 1).to(dt))
        assert torch.equal(a2a, torch.cat([torch.full((2,), r + 1).to(dt) for r in range(ws)])), dt
        n += 3
    assert comm.state == "ok"
    return n


@pytest.mark.parametrize("loop", LOOPS)
def test_unsupported_dtypes_are_invalid_argument_and_others_move_as_bytes(loop: str) -> None:
    results = run_ranks(unsupported_dtypes, world_size=2, backend="gloo", timeout=90, loop=loop)
    assert results[0] == results[1] > 100


def test_nccl_table_matches_nccl4py_enums() -> None:
    """Every dtype in nccl4py's DataType enum is reducible with every RedOp in the table,
    but fp8 with AVG: NCCL has no fp8 ncclAvg (enqueue.cc hostToDevRedOp; an H100 with
    NCCL 2.28.9 returned ncclInvalidArgument), so the table refuses it at the call."""
    bindings = pytest.importorskip("nccl.bindings.nccl")
    names = {
        "Int8": "int8",
        "Uint8": "uint8",
        "Int32": "int32",
        "Uint32": "uint32",
        "Int64": "int64",
        "Uint64": "uint64",
        "Float16": "float16",
        "Float32": "float32",
        "Float64": "float64",
        "Bfloat16": "bfloat16",
        "Float8e4m3": "float8_e4m3fn",
        "Float8e5m2": "float8_e5m2",
    }
    members = [m.name for m in bindings.DataType if m.name != "NumTypes"]
    assert sorted(members) == sorted(names), (
        "nccl4py's DataType changed: update the NCCL backend's caps"
    )
    ops = {m.name.upper() for m in bindings.RedOp if m.name in ("Sum", "Prod", "Max", "Min", "Avg")}
    assert ops == {op.name for op in R}
    caps = nccl.NcclBackend.caps  # what the backend declares, and validate asks
    fp8 = {"Float8e4m3", "Float8e5m2"}
    for name in members:
        for op in R:
            if name in fp8 and op is R.AVG:
                with pytest.raises(ac.InvalidArgument, match="with ReduceOp.AVG"):
                    validate.reduce_op(op, getattr(torch, names[name]), caps)
                continue
            assert validate.reduce_op(op, getattr(torch, names[name]), caps) is op
    with pytest.raises(ac.InvalidArgument, match="nccl cannot reduce .* supports"):
        validate.reduce_op(R.MAX, torch.complex64, caps)


async def aliasing(comm: ac.Communicator) -> int:
    r, ws = comm.rank, comm.world_size
    t = torch.arange(2.0 * ws)
    _refused(comm, lambda: comm.all_to_all(t, t), "overlap")
    big = torch.zeros(4 * ws)
    _refused(comm, lambda: comm.all_to_all(big[: 2 * ws], big[ws : 3 * ws]), "overlap")
    _refused(comm, lambda: comm.all_gather(big[: 2 * ws], big[1:3]), "chunk")
    _refused(comm, lambda: comm.reduce_scatter(big[1:3], big[: 2 * ws]), "chunk")
    if r == 0:
        _refused(comm, lambda: comm.gather(big[:2], 0, big[: 2 * ws]), "overlap")
        _refused(comm, lambda: comm.scatter(big[:2], 0, big[: 2 * ws]), "overlap")
    # In place (NCCL's definition): this rank's chunk of the larger buffer.
    out = torch.zeros(2 * ws)
    mine = out[2 * r : 2 * r + 2]
    mine.fill_(r + 1)
    await comm.all_gather(out, mine)
    assert out.tolist() == [float(q + 1) for q in range(ws) for _ in range(2)]
    inp = torch.arange(2.0 * ws) + 10 * r
    await comm.reduce_scatter(inp[2 * r : 2 * r + 2], inp)
    want = sum(torch.arange(2.0 * ws) + 10 * q for q in range(ws))
    assert inp[2 * r : 2 * r + 2].tolist() == want[2 * r : 2 * r + 2].tolist()
    # all_to_all into a separate buffer: the right values every time.
    for _ in range(3):
        src = torch.arange(2.0 * ws) + 10 * r
        dst = torch.zeros(2 * ws)
        await comm.all_to_all(dst, src)
        assert dst.tolist() == [10.0 * q + 2 * r + k for q in range(ws) for k in range(2)]
    return 1


@pytest.mark.parametrize("loop", LOOPS)
def test_overlapping_output_and_input_rejected_or_in_place(loop: str) -> None:
    assert run_ranks(aliasing, world_size=2, backend="gloo", timeout=60, loop=loop) == [1, 1]


def test_timeouts_must_be_finite() -> None:
    for bad in (float("inf"), float("nan"), -1, 0, 1e300, "5", True):
        with pytest.raises(ac.InvalidArgument):
            validate.timeout(bad, 60.0)
    assert validate.timeout(None, 60.0) == 60.0
    assert validate.timeout(5, 60.0) == 5.0


async def coalesced_conversions(comm: ac.Communicator) -> list[object]:
    """The same conversions (0-d chunks, byte views, complex sums) inside a coalesced batch."""
    r, ws = comm.rank, comm.world_size
    c = torch.full((3,), 1 + 1j * (r + 1), dtype=torch.complex64)
    u = torch.zeros(2 * ws, dtype=torch.uint16)
    f8 = torch.zeros(2 * ws, dtype=torch.float8_e4m3fn)
    rs = torch.tensor(0.0)
    ag = torch.zeros(ws)
    async with comm.coalescing():
        comm.all_reduce(c)
        comm.all_gather(u, torch.full((2,), 1000 + r, dtype=torch.uint16))
        comm.all_gather(f8, torch.full((2,), r + 1.0).to(torch.float8_e4m3fn))
        comm.reduce_scatter(rs, torch.arange(ws, dtype=torch.float32) + r)
        comm.all_gather(ag, torch.tensor(float(r)))
    return [c.tolist(), u.to(torch.int64).tolist(), f8.float().tolist(), rs.item(), ag.tolist()]


@pytest.mark.parametrize("loop", LOOPS)
def test_conversions_inside_coalescing(loop: str) -> None:
    results = run_ranks(coalesced_conversions, world_size=2, backend="gloo", timeout=60, loop=loop)
    common = [[2 + 3j] * 3, [1000, 1000, 1001, 1001], [1.0, 1.0, 2.0, 2.0]]
    assert results[0] == common + [1.0, [0.0, 1.0]]
    assert results[1] == common + [3.0, [0.0, 1.0]]
