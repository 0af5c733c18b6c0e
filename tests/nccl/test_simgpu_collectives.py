"""Every collective x reduce op x dtype through ``asynccoll.init(backend="nccl")`` on the simulated GPU.

The real Communicator, NcclBackend, NcclLib, CudaRuntime and ``streams`` run; only the
vendor libraries are simulated: ``torch.cuda`` and ``cuda.bindings.driver`` (doubles on a
``SimGPU``) and nccl4py (autospecs, ``SimNccl``). World sizes 1-3, ranks as threads,
rank r on cuda:r.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import asynccoll as ac
from asynccoll.testing.simgpu import SimCluster

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
]
OPS = list(ac.ReduceOp)


def value(rank: int, dtype: torch.dtype, n: int = 6) -> torch.Tensor:
    base = (torch.arange(n) % 3) + rank + 1
    if dtype is torch.bool:
        return (torch.arange(n) + rank) % 2 == 0
    if dtype.is_complex:
        return torch.complex(base.double(), -base.double()).to(dtype)
    return base.to(dtype)


def ops_for(dtype: torch.dtype) -> list[ac.ReduceOp]:
    if dtype is torch.bool:
        return [ac.ReduceOp.SUM, ac.ReduceOp.PROD, ac.ReduceOp.MIN, ac.ReduceOp.MAX]
    if dtype.is_complex:
        return [ac.ReduceOp.SUM, ac.ReduceOp.AVG]
    return OPS


def expect(op: ac.ReduceOp, xs: list[torch.Tensor]) -> torch.Tensor:
    dt = xs[0].dtype
    if dt is torch.bool:
        st = torch.stack(xs)
        return st.any(0) if op in (ac.ReduceOp.SUM, ac.ReduceOp.MAX) else st.all(0)
    if dt.is_complex:
        st = torch.stack([x.to(torch.complex128) for x in xs])
        return (st.sum(0) if op is ac.ReduceOp.SUM else st.sum(0) / len(xs)).to(dt)
    wide = torch.float64 if dt.is_floating_point else torch.int64
    st = torch.stack([x.to(wide) for x in xs])
    if op is ac.ReduceOp.SUM:
        r = st.sum(0)
    elif op is ac.ReduceOp.PROD:
        r = st.prod(0)
    elif op is ac.ReduceOp.MIN:
        r = st.amin(0)
    elif op is ac.ReduceOp.MAX:
        r = st.amax(0)
    else:
        r = (
            st.sum(0) / len(xs)
            if dt.is_floating_point
            else torch.div(st.sum(0), len(xs), rounding_mode="floor")
        )
    return r.to(dt)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a = a.as_subclass(torch.Tensor)
    if a.dtype is torch.bool and bool((a.view(torch.uint8) > 1).any()):
        return False  # a bool byte other than 0/1 (e.g. a uint8 SUM of bools) is garbage
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return a.shape == b.shape and torch.allclose(
            a.to(torch.complex128), b.to(torch.complex128), rtol=1e-2
        )
    return torch.equal(a, b)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ws", [1, 2, 3])
def test_every_collective_every_op_every_dtype(ws: int) -> None:
    with SimCluster() as sim:
        gpu = sim.gpu

        async def body(comm: Any) -> list[str]:
            r, bad = comm.rank, []
            assert comm.backend == "nccl" and comm.device == torch.device("cuda", r)
            for dt in DTYPES:
                xs = [value(k, dt) for k in range(ws)]
                for op in ops_for(dt):
                    t = gpu.tensor(xs[r])
                    got = await comm.all_reduce(t, op)
                    if got is not t or not same(t, expect(op, xs)):
                        bad.append(f"all_reduce {dt} {op.name}: {gpu.host(t).tolist()}")
                    for root in range(ws):
                        t = gpu.tensor(xs[r])
                        await comm.reduce(t, root, op)
                        if r == root and not same(t, expect(op, xs)):
                            bad.append(f"reduce {dt} {op.name} root {root}: {gpu.host(t).tolist()}")
                    big = [torch.cat([value(k * 10 + j, dt) for j in range(ws)]) for k in range(ws)]
                    out = gpu.tensor(torch.zeros(6, dtype=dt))
                    await comm.reduce_scatter(out, gpu.tensor(big[r]), op)
                    want = expect(op, big)[r * 6 : (r + 1) * 6]
                    if not same(out, want):
                        bad.append(
                            f"reduce_scatter {dt} {op.name}: {gpu.host(out).tolist()} != {want.tolist()}"
                        )
                for root in range(ws):
                    t = gpu.tensor(xs[r])
                    await comm.broadcast(t, root)
                    if not same(t, xs[root]):
                        bad.append(f"broadcast {dt} root {root}")
                out = gpu.tensor(torch.zeros(6 * ws, dtype=dt))
                await comm.all_gather(out, gpu.tensor(xs[r]))
                if not same(out, torch.cat(xs)):
                    bad.append(f"all_gather {dt}")
                mine = torch.cat([value(r * 10 + j, dt) for j in range(ws)])
                out = gpu.tensor(torch.zeros(6 * ws, dtype=dt))
                await comm.all_to_all(out, gpu.tensor(mine))
                want = torch.cat([value(k * 10 + r, dt) for k in range(ws)])
                if not same(out, want):
                    bad.append(f"all_to_all {dt}: {gpu.host(out).tolist()}")
                for root in range(ws):
                    out = gpu.tensor(torch.zeros(6 * ws, dtype=dt)) if r == root else None
                    await comm.gather(gpu.tensor(xs[r]), root, out)
                    if r == root and not same(out, torch.cat(xs)):
                        bad.append(f"gather {dt} root {root}: {gpu.host(out).tolist()}")
                    out = gpu.tensor(torch.zeros(6, dtype=dt))
                    src = (
                        gpu.tensor(torch.cat([value(root * 10 + j, dt) for j in range(ws)]))
                        if r == root
                        else None
                    )
                    await comm.scatter(out, root, src)
                    if not same(out, value(root * 10 + r, dt)):
                        bad.append(f"scatter {dt} root {root}")
            if ws > 1:  # a ring of send/recv
                t = gpu.tensor(value(r, torch.float32))
                inbox = gpu.tensor(torch.zeros(6))
                if r % 2 == 0:
                    await comm.send(t, (r + 1) % ws)
                    await comm.recv(inbox, (r - 1) % ws)
                else:
                    await comm.recv(inbox, (r - 1) % ws)
                    await comm.send(t, (r + 1) % ws)
                if not same(inbox, value((r - 1) % ws, torch.float32)):
                    bad.append(f"send/recv into {r}: {gpu.host(inbox).tolist()}")
            await comm.barrier()
            return bad

        results = sim.run_comms(ws, body, timeout=60)
        assert results == [[]] * ws
        assert gpu.errors == []
        assert sim.nccl.live() == []  # every communicator was finalized and destroyed
        assert all(st.destroyed for st in sim.nccl.comms)


def test_fp8_reductions_are_refused_at_the_call_below_sm90() -> None:
    fp8 = torch.float8_e4m3fn
    with SimCluster(capability=(8, 0)) as sim:
        gpu = sim.gpu

        async def body(comm: Any) -> Any:
            t = gpu.tensor(torch.ones(4).to(fp8))
            with pytest.raises(
                ac.InvalidArgument, match="float8_e4m3fn"
            ):  # validate.py asks be.caps
                comm.all_reduce(t)
            out = gpu.tensor(torch.zeros(8).to(fp8))
            await comm.all_gather(out, t)  # moving fp8 is fine on any device
            x = gpu.tensor([1.0])
            await comm.all_reduce(x)  # the communicator is still usable
            return comm.state, gpu.host(x).item()

        assert sim.run_comms(2, body) == [("ok", 2.0)] * 2
        assert gpu.errors == []
    with SimCluster(capability=(9, 0)) as sim:

        async def body90(comm: Any) -> float:
            t = sim.gpu.tensor(torch.ones(4).to(fp8))
            await comm.all_reduce(t)
            # NCCL has no fp8 AVG on any device (found on an H100): refused at the call,
            # not a broken communicator later
            with pytest.raises(ac.InvalidArgument, match="float8_e4m3fn with ReduceOp.AVG"):
                comm.all_reduce(t, ac.ReduceOp.AVG)
            return float(sim.gpu.host(t).float()[0])

        assert sim.run_comms(2, body90) == [2.0, 2.0]


def test_recv_any_is_refused_at_the_call_on_nccl() -> None:
    """NCCL receives from a named peer only: ``recv_any`` (Gloo's any-source receive)
    is ``InvalidArgument`` at the call, and nothing was issued."""
    with SimCluster() as sim:
        gpu = sim.gpu

        async def body(comm: Any) -> Any:
            with pytest.raises(ac.InvalidArgument, match="named peer only"):
                comm.recv_any(gpu.tensor([0.0]))
            x = gpu.tensor([1.0])
            await comm.all_reduce(x)  # the ranks still agree: nothing was issued
            return comm.state, gpu.host(x).item()

        assert sim.run_comms(2, body) == [("ok", 2.0)] * 2
        assert gpu.errors == []
