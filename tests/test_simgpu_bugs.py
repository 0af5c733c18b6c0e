"""The ten bugs of issue 17, each a test on the simulated GPU that failed on the code
before the fix (the NCCL backend as of fad72c6, run against this simulator).

Everything but the vendor libraries is real: the Communicator, NcclBackend, NcclLib,
CudaRuntime and ``streams`` run on the doubles of ``torch.cuda``,
``cuda.bindings.driver`` and nccl4py. Rank r uses cuda:r.
"""

from __future__ import annotations

import asyncio
import threading
import types
from typing import Any

import nccl.core as nc
import pytest
import torch

import asynccoll as ac
from asynccoll._backends.nccl import NcclLib
from asynccoll._base.ops import OpKind, OpSpec, ReduceOp
from asynccoll._core.work import Work
from asynccoll.testing.simgpu import SimCluster
from tests.support.simgpu_util import WAIT, submit, until

pytestmark = pytest.mark.timeout(120)


def comm_of(be: Any) -> Any:
    return be.handle.communicator


def on_device(index: int, fn: Any, *args: Any) -> threading.Thread:
    """``fn(*args)`` on a new thread that works on ``cuda:index`` (as a user thread would)."""

    def main() -> None:
        torch.cuda.set_device(index)
        fn(*args)

    t = threading.Thread(target=main, daemon=True)
    t.start()
    return t


def close_all(*bes: Any) -> None:
    for be in bes:
        be.close()


# ==================================================== 1. a failed group is launched
def test_1_a_call_failing_inside_a_group_launches_nothing() -> None:
    # nccl4py refuses the broadcast before NCCL sees it; ncclGroupSimulateEnd (the old
    # "discard") launches the all_reduce already in the group on this rank alone.
    with SimCluster() as sim:
        (be,) = sim.backends(1)
        st = sim.nccl.state(comm_of(be))
        sim.nccl.fail_call(comm_of(be), "broadcast", nc.NcclInvalid("boom"))
        a, b = sim.gpu.tensor([1.0]), sim.gpu.tensor([2.0])
        works = [Work("all_reduce", 1), Work("broadcast", 2)]
        be.submit_batch(
            [
                OpSpec(OpKind.ALL_REDUCE, a, timeout=10),
                OpSpec(OpKind.BROADCAST, b, peer=0, timeout=10),
            ],
            works,
        )
        for w in works:
            with pytest.raises(ac.CommAborted):
                w.wait(WAIT)
        assert st.launches == []  # neither op ran: NCCL took the group error
        be.close()
        assert sim.gpu.errors == []


def test_1_every_argument_is_resolved_before_the_group_starts() -> None:
    # bool AVG (NCCL has no bool; AVG of bools has no meaning) used to pass the backend's
    # check and run as MIN; now the whole batch is refused at the call, nothing started.
    with SimCluster() as sim:
        (be,) = sim.backends(1)
        st = sim.nccl.state(comm_of(be))
        f, flag = sim.gpu.tensor([1.0]), sim.gpu.tensor([True, False])
        specs = [
            OpSpec(OpKind.ALL_REDUCE, f, timeout=10),
            OpSpec(OpKind.ALL_REDUCE, flag, reduce_op=ReduceOp.AVG, timeout=10),
        ]
        with pytest.raises(ac.InvalidArgument, match="AVG"):
            be.submit_batch(specs, [Work("all_reduce", 1), Work("all_reduce", 2)])
        assert st.launches == []
        submit(be, OpKind.ALL_REDUCE, f).wait(WAIT)  # still usable
        be.close()


# ============================================ 2. abort's release of the gate undone
def test_2_abort_never_leaves_a_stream_waiting_on_the_device() -> None:
    # Before: wait_stream enqueued cuStreamWaitValue32(gate >= 2) on `side`; abort wrote the
    # gate from the host, then the aborted job 1's cuStreamWriteValue32(1) ran and moved
    # it back; `side` reached its wait afterwards and blocked forever.
    with SimCluster(sync_limit=5.0) as sim:
        gpu = sim.gpu
        be0, be1 = sim.backends(2)
        side = gpu.stream("side")
        hold = gpu.latch()
        gpu.kernel(side, lambda: None, hold=hold)  # side is busy when the abort happens
        c0 = comm_of(be0)
        submit(be0, OpKind.ALL_REDUCE, gpu.tensor([1.0]))  # rank 1 never joins: stuck
        until(lambda: sim.nccl.pushed(c0) == 1)
        stuck = gpu.latch()
        sim.nccl.block_calls(c0, stuck)
        w2 = submit(be0, OpKind.ALL_REDUCE, gpu.tensor([2.0]))  # the lane sits in its NCCL call
        until(lambda: be0.handle.calling)
        waiter = on_device(0, w2.wait_stream, side)
        be0.handle.abort_timeout = 0.5
        be0.abort()
        waiter.join(5.0)
        assert not waiter.is_alive()  # the abort ended the wait for the launch
        sim.nccl.block_calls(c0, None)
        stuck.open()
        hold.open()
        gpu.idle()
        assert side.query(), f"side still waits: {gpu.busy()}"
        be1.abort()
        close_all(be0, be1)


# ================================================ 3. gate waits invisible to CUDA
def test_3_wait_stream_on_a_queued_op_is_deadlock_free_with_one_hardware_queue() -> None:
    # CUDA_DEVICE_MAX_CONNECTIONS=1: a wait enqueued before its producer (the old gate wait
    # for a job the launcher had not issued) blocks the only queue, holding the NCCL kernel
    # that would release it. Now wait_stream waits on the host for the launch, then makes
    # the stream wait on the op's completion event (visible to CUDA).
    with SimCluster(hw_queues=1, sync_limit=5.0) as sim:
        gpu = sim.gpu
        (be,) = sim.backends(1)
        stuck = gpu.latch()
        sim.nccl.block_calls(comm_of(be), stuck)
        x = gpu.tensor([3.0])
        out = gpu.tensor([0.0])
        w = Work("all_gather", 1)
        be.submit(OpSpec(OpKind.ALL_GATHER, x, output=out, timeout=30.0), w)
        until(lambda: be.handle.calling)
        side = gpu.stream("side")

        def user() -> None:  # program order on one thread: wait_stream, then work on `side`
            w.wait_stream(side)
            with torch.cuda.stream(side):
                out.mul_(10)  # must come after the all_gather wrote `out`

        waiter = on_device(0, user)
        waiter.join(0.2)
        sim.nccl.block_calls(comm_of(be), None)
        stuck.open()
        waiter.join(WAIT)
        assert not waiter.is_alive()
        w.wait(WAIT)
        side.synchronize()
        assert gpu.host(out).item() == 30.0
        assert sim.gpu.driver.value_waits == 0
        be.close()
        assert gpu.errors == []


def test_3_wait_stream_on_a_launched_op_waits_on_its_event() -> None:
    with SimCluster(hw_queues=1) as sim:
        gpu = sim.gpu

        async def body(comm: Any) -> float:
            t = gpu.tensor([float(comm.rank + 1)])
            w = comm.all_reduce(t)
            side = gpu.stream("side")
            w.wait_stream(side)
            with gpu.use_stream(side):
                t.add_(100)
            await w
            side.synchronize()
            return gpu.host(t).item()

        assert sim.run_comms(2, body) == [103.0, 103.0]
        assert sim.gpu.driver.value_waits == 0  # a dependency CUDA sees: stream.wait_event
        assert gpu.errors == []


# ======================================== 4. the comm stream from torch's pool
def test_4_the_comm_stream_is_not_one_of_torchs_pool_streams() -> None:
    with SimCluster() as sim:
        bes = sim.backends(2)
        pool = {
            torch.cuda.Stream(device=d, priority=p).cuda_stream
            for d in (0, 1)
            for p in (0, -1, -2, -3)
            for _ in range(32)
        }
        mine = {be.runtime.comm_stream.cuda_stream for be in bes}
        assert len(mine) == 2 and not mine & pool
        close_all(*bes)


# ================================================ 5. shrink with nothing to exclude
def test_5_shrink_after_a_user_abort_without_failures_builds_a_new_communicator() -> None:
    with SimCluster() as sim:
        gpu = sim.gpu

        async def body(comm: Any) -> float:
            await comm.all_reduce(gpu.tensor([1.0]))
            comm.abort("user")
            new = await asyncio.wait_for(comm.shrink(), WAIT)  # nobody failed: excludes nothing
            try:
                x = gpu.tensor([float(new.rank + 1)])
                await asyncio.wait_for(new.all_reduce(x), WAIT)
                return gpu.host(x).item()
            finally:
                await new.close()

        assert sim.run_comms(2, body) == [3.0, 3.0]
        assert all(st.shrink_flags == [] for st in sim.nccl.comms)  # no ncclCommShrink([])
        assert sim.gpu.errors == []


# ================================== 6. watcher and abort threads never set the device
def test_6_every_thread_works_on_its_communicators_device() -> None:
    with SimCluster() as sim:
        gpu = sim.gpu

        async def body(comm: Any) -> float:
            t = gpu.tensor([1.0])
            for _ in range(3):
                await comm.all_reduce(t)
            return gpu.host(t).item()

        assert sim.run_comms(2, body) == [8.0, 8.0]
        bes = sim.backends(2)
        submit(bes[1], OpKind.ALL_REDUCE, gpu.tensor([1.0], device=1))  # rank 0 never joins
        until(lambda: sim.nccl.pushed(comm_of(bes[1])) == 1)
        bes[1].abort()  # its stop thread, the watcher and the launch thread all use cuda:1
        close_all(*bes)
        assert [e for e in gpu.errors if "primary context" in e] == []


# ================================================================= 7. fp8 below sm_90
def test_7_fp8_reductions_are_refused_at_the_call_below_sm90() -> None:
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


# ======================================== 8. racing launch threads of one device
def test_8_communicators_of_a_device_launch_in_issue_order() -> None:
    # Rank 0's first launch on A sits inside NCCL; rank 0 then issues on B. One launch
    # thread per communicator let B launch first on cuda:0 while cuda:1 launched A first:
    # two orders, the NCCL_LAUNCH_ORDER_IMPLICIT deadlock (a launch-order error here).
    with SimCluster() as sim:
        gpu = sim.gpu
        a0, a1 = sim.backends(2)
        b0, b1 = sim.backends(2)
        stuck = gpu.latch()
        sim.nccl.block_calls(comm_of(a0), stuck)
        ts = {
            be: gpu.tensor([float(i + 1)], device=be.device)
            for i, be in enumerate((a0, a1, b0, b1))
        }
        works = [submit(a0, OpKind.ALL_REDUCE, ts[a0])]
        until(lambda: a0.handle.calling)
        works += [submit(b0, OpKind.ALL_REDUCE, ts[b0]), submit(a1, OpKind.ALL_REDUCE, ts[a1])]
        until(lambda: bool(sim.nccl.state(comm_of(a1)).launches))  # cuda:1 launched A first
        works.append(submit(b1, OpKind.ALL_REDUCE, ts[b1]))
        gpu.idle()
        threading.Event().wait(0.2)
        sim.nccl.block_calls(comm_of(a0), None)
        stuck.open()
        for w in works:
            w.wait(WAIT)
        assert [gpu.host(ts[be]).item() for be in (a0, a1, b0, b1)] == [3.0, 3.0, 7.0, 7.0]
        assert [e for e in gpu.errors if "launch order" in e] == []
        threads = {t.name for t in threading.enumerate() if "nccl-launch" in t.name}
        assert threads == {"asynccoll-nccl-launch-0", "asynccoll-nccl-launch-1"}  # one per device
        close_all(a0, a1, b0, b1)
        assert gpu.errors == []


# ================================================= 9. pinned memory mid-traffic
def test_9_no_pinned_allocation_or_stream_memory_operation_mid_traffic() -> None:
    with SimCluster() as sim:
        gpu = sim.gpu

        async def body(comm: Any) -> float:
            t = gpu.tensor([1.0])
            w = comm.all_reduce(t)
            w.wait_stream(gpu.stream("side"))
            await w
            return gpu.host(t).item()

        assert sim.run_comms(2, body) == [2.0, 2.0]
        assert sim.gpu.driver.host_allocs == [] and gpu.errors == []
    with SimCluster(stream_mem_ops=False) as sim:  # a device without stream memory operations

        async def body2(comm: Any) -> float:
            t = sim.gpu.tensor([1.0])
            w = comm.all_reduce(t)
            w.wait_stream(sim.gpu.stream("side"))
            await w
            return sim.gpu.host(t).item()

        assert sim.run_comms(2, body2) == [2.0, 2.0]
        assert sim.gpu.errors == []


# ========================================================== 10. revoke since 2.28.7
def test_10_revoke_exists_from_nccl_2_28_7() -> None:
    with SimCluster() as sim:
        (be,) = sim.backends(1)
        for version, expect in (((2, 28, 6), False), ((2, 28, 7), True), ((2, 29, 0), True)):
            old = types.ModuleType(f"nccl.core({version})")
            old.__dict__.update(vars(sim.nccl.module))
            v = types.SimpleNamespace(major=version[0], minor=version[1], micro=version[2])
            old.get_version = lambda v=v: types.SimpleNamespace(
                libnccl=types.SimpleNamespace(version=v)
            )  # type: ignore[attr-defined]
            assert NcclLib(old).can_revoke(comm_of(be)) is expect, version
        be.close()
