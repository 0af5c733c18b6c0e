"""How the NCCL backend launches ops, on the simulated GPU: a group is launched whole or not
at all, its arguments are resolved before it starts, the communicators of a device launch in
issue order, and every thread works on its communicator's device.

Everything but the vendor libraries is real: the Communicator, NcclBackend, NcclLib,
CudaRuntime and ``streams`` run on the doubles of ``torch.cuda``,
``cuda.bindings.driver`` and nccl4py. Rank r uses cuda:r.
"""

from __future__ import annotations

import threading
from typing import Any

import nccl.core as nc
import pytest

import asynccoll as ac
from asynccoll._base.ops import OpKind, OpSpec
from asynccoll.testing.simgpu import SimCluster
from tests.support.simgpu_util import WAIT, close_all, comm_of, submit, until

pytestmark = pytest.mark.timeout(120)


# ====================================================================== groups
def test_a_call_failing_inside_a_group_launches_nothing() -> None:
    # nccl4py refuses the broadcast before NCCL sees it; ncclGroupSimulateEnd (the old
    # "discard") launches the all_reduce already in the group on this rank alone.
    with SimCluster() as sim:
        (be,) = sim.backends(1)
        st = sim.nccl.state(comm_of(be))
        sim.nccl.fail_call(comm_of(be), "broadcast", nc.NcclInvalid("boom"))
        a, b = sim.gpu.tensor([1.0]), sim.gpu.tensor([2.0])
        works = [ac.Work("all_reduce", 1), ac.Work("broadcast", 2)]
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


def test_every_argument_is_resolved_before_the_group_starts() -> None:
    # bool AVG (NCCL has no bool; AVG of bools has no meaning) used to pass the backend's
    # check and run as MIN; now the whole batch is refused at the call, nothing started.
    with SimCluster() as sim:
        (be,) = sim.backends(1)
        st = sim.nccl.state(comm_of(be))
        f, flag = sim.gpu.tensor([1.0]), sim.gpu.tensor([True, False])
        specs = [
            OpSpec(OpKind.ALL_REDUCE, f, timeout=10),
            OpSpec(OpKind.ALL_REDUCE, flag, reduce_op=ac.ReduceOp.AVG, timeout=10),
        ]
        with pytest.raises(ac.InvalidArgument, match="AVG"):
            be.submit_batch(specs, [ac.Work("all_reduce", 1), ac.Work("all_reduce", 2)])
        assert st.launches == []
        submit(be, OpKind.ALL_REDUCE, f).wait(WAIT)  # still usable
        be.close()


# ================================================================ launch order
def test_communicators_of_a_device_launch_in_issue_order() -> None:
    # Rank 0's first launch on A is stuck inside NCCL (ncclInProgress); rank 0 then issues on B. One launch
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
        until(lambda: sim.nccl.in_progress(comm_of(a0)) == 1)
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


# ================================================================ devices
def test_every_thread_works_on_its_communicators_device() -> None:
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
