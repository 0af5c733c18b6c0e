"""The simulated NCCL's rules, each against the NCCL source line it follows (see
``asynccoll/testing/simgpu/comm.py`` and ``nccl.py``), on raw nccl4py-shaped calls."""

from __future__ import annotations

import threading
import time
from typing import Any

import nccl.core as nc
import pytest
import torch
from nccl.bindings.nccl import NCCLError, Result

from asynccoll._backends.nccl import NcclLib
from asynccoll.testing.simgpu import SimCluster

pytestmark = pytest.mark.timeout(60)
ABORT, DEFAULT = nc.CommShrinkFlag.ABORT, nc.CommShrinkFlag.DEFAULT


def ready(*comms: Any) -> None:
    deadline = time.monotonic() + 10
    while any(c.get_async_error() == Result.InProgress for c in comms):
        assert time.monotonic() < deadline, "still ncclInProgress"
    assert all(c.get_async_error() == Result.Success for c in comms)


def world(sim: SimCluster, n: int) -> list[Any]:
    """``n`` ready non-blocking communicators, rank r on cuda:r."""
    lib = sim.lib()
    uid = lib.unique_id()
    comms = []
    for r in range(n):
        with torch.cuda.device(r):
            comms.append(lib.init(n, r, uid))
    ready(*comms)
    return comms


def streams_of(sim: SimCluster, n: int) -> list[int]:
    return [sim.gpu.stream(f"s{r}", device=r).cuda_stream for r in range(n)]


# ===================================================== nccl4py autospec strictness
def test_sim_communicator_has_exactly_nccl4pys_interface() -> None:
    with SimCluster() as sim:
        (comm,) = world(sim, 1)
        assert isinstance(comm, nc.Communicator)  # autospec passes isinstance checks
        t = sim.gpu.tensor([1.0])
        (s,) = streams_of(sim, 1)
        with pytest.raises(AttributeError):
            comm.all_reduce(t, t, nc.NcclRedOp.SUM)  # misspelled (nccl4py: allreduce)
        with pytest.raises(TypeError):
            comm.allreduce(t, t, nc.NcclRedOp.SUM, 0)  # stream is keyword-only
        with pytest.raises(TypeError):
            comm.broadcast(t, t, root=0, strm=1)  # unknown keyword
        with pytest.raises(TypeError):
            comm.reduce(t, t, 0, nc.NcclRedOp.SUM, stream=s)  # root/op swapped
        with pytest.raises(TypeError):
            sim.nccl.module.group_end(True)  # simulate is keyword-only
        with pytest.raises(AttributeError):
            sim.nccl.module.Communicator.init_rank  # noqa: B018 - not an nccl4py name
        with pytest.raises(nc.NcclInvalid):  # nccl4py's own check: a tensor of another device
            comm.allreduce(
                sim.gpu.tensor([1.0], device=1),
                sim.gpu.tensor([1.0], device=1),
                nc.NcclRedOp.SUM,
                stream=s,
            )
        comm.abort()
        with pytest.raises(nc.NcclInvalid):
            comm.get_async_error()  # aborted: nccl4py's null communicator


def test_sim_nccl_reports_real_result_codes_and_in_progress() -> None:
    with SimCluster(inprogress_polls=3) as sim:
        lib = sim.lib()
        uid = lib.unique_id()
        c0 = lib.init(2, 0, uid)
        assert c0.get_async_error() is Result.InProgress  # rank 1 has not arrived
        with torch.cuda.device(1):
            c1 = lib.init(2, 1, uid)
        assert c0.get_async_error() is Result.Success and c1.get_async_error() is Result.Success
        t = sim.gpu.tensor([1.0])
        c0.allreduce(t, t, nc.NcclRedOp.SUM, stream=streams_of(sim, 1)[0])
        assert [c0.get_async_error() for _ in range(3)] == [
            Result.InProgress,
            Result.InProgress,
            Result.Success,
        ]
        c0.abort()
        c1.abort()
        assert sim.nccl.live() == []


# ================================================================== groups
def test_simulate_end_launches_a_non_blocking_group() -> None:
    # group.cc:762-764/852-857: a non-blocking group goes to groupLaunchNonBlocking,
    # which calls groupLaunch without the simulation info.
    with SimCluster() as sim:
        (comm,) = world(sim, 1)
        st = sim.nccl.state(comm)
        t = sim.gpu.tensor([1.0])
        nc_ = sim.nccl.module
        nc_.group_start()
        comm.allreduce(t, t, nc.NcclRedOp.SUM, stream=streams_of(sim, 1)[0])
        info = nc_.group_end(simulate=True)
        assert isinstance(info, nc.GroupSimInfo) and len(st.launches) == 1  # launched anyway
        ready(comm)
        comm.abort()


def test_a_failed_nccl_call_fails_the_group_and_launches_nothing() -> None:
    with SimCluster() as sim:
        (comm,) = world(sim, 1)
        st = sim.nccl.state(comm)
        t = sim.gpu.tensor([1.0])
        (s,) = streams_of(sim, 1)
        nc_ = sim.nccl.module
        nc_.group_start()
        comm.allreduce(t, t, nc.NcclRedOp.SUM, stream=s)
        with pytest.raises(NCCLError):
            comm.send(t, 5, stream=s)  # argcheck.cc ArgsCheck: invalid root/peer
        with pytest.raises(NCCLError) as info:
            nc_.group_end()
        assert info.value.status == Result.InvalidArgument and st.launches == []
        assert comm.get_async_error() == Result.InvalidArgument  # enqueue.cc:3170, non-blocking
        # nccl4py's own refusal (before NCCL) leaves the group as it was: the rest launches
        nc_.group_start()
        comm2 = world(sim, 1)[0]
        comm2.allreduce(t, t, nc.NcclRedOp.SUM, stream=s)
        with pytest.raises(nc.NcclInvalid):
            comm2.allreduce(sim.gpu.tensor([1], dtype=torch.int16), t, nc.NcclRedOp.SUM, stream=s)
        nc_.group_end()
        assert len(sim.nccl.state(comm2).launches) == 1
        ready(comm2)
        comm.abort()
        comm2.abort()


# ===================================================================== fp8
def test_fp8_reductions_need_sm90() -> None:
    fp8 = torch.float8_e4m3fn
    for cap, ok in (((9, 0), True), ((8, 9), False)):
        with SimCluster(capability=cap) as sim:
            (comm,) = world(sim, 1)
            (s,) = streams_of(sim, 1)
            t = sim.gpu.tensor(torch.ones(2).to(fp8))
            out = sim.gpu.tensor(torch.zeros(2).to(fp8))
            comm.allgather(t, out, stream=s)  # data movement: any device
            ready(comm)
            if ok:
                comm.allreduce(t, t, nc.NcclRedOp.SUM, stream=s)
            else:
                with pytest.raises(NCCLError) as info:
                    comm.allreduce(t, t, nc.NcclRedOp.SUM, stream=s)  # enqueue.cc:3029
                assert info.value.status == Result.InvalidArgument
                assert (
                    comm.get_async_error() == Result.InvalidArgument
                )  # the communicator is broken
            comm.abort()


def test_fp8_avg_is_invalid_on_any_device() -> None:
    """NCCL has no fp8 ncclAvg (enqueue.cc hostToDevRedOp; measured on an H100, NCCL 2.28.9)."""
    with SimCluster(capability=(9, 0)) as sim:
        (comm,) = world(sim, 1)
        (s,) = streams_of(sim, 1)
        t = sim.gpu.tensor(torch.ones(2).to(torch.float8_e4m3fn))
        comm.allreduce(t, t, nc.NcclRedOp.MAX, stream=s)  # other reductions: fine on sm_90
        ready(comm)
        with pytest.raises(NCCLError) as info:
            comm.allreduce(t, t, nc.NcclRedOp.AVG, stream=s)
        assert info.value.status == Result.InvalidArgument
        comm.abort()


def test_a_data_call_while_the_last_launch_is_in_progress_is_invalid() -> None:
    # init.cc:422-433 ncclCommEnsureReady: "Attempt to use communicator before the
    # previous operation returned ncclSuccess" (enqueue.cc:3141).
    with SimCluster() as sim:
        (comm,) = world(sim, 1)
        (s,) = streams_of(sim, 1)
        t = sim.gpu.tensor([1.0])
        comm.allreduce(t, t, nc.NcclRedOp.SUM, stream=s)
        with pytest.raises(NCCLError) as info:
            comm.allreduce(t, t, nc.NcclRedOp.SUM, stream=s)
        assert info.value.status == Result.InvalidArgument
        assert comm.get_async_error() == Result.InvalidArgument  # enqueue.cc:3170
        assert any("while its last launch is InProgress" in e for e in sim.gpu.errors)
        sim.gpu.errors.clear()
        comm.abort()


def test_a_stuck_launch_of_a_non_blocking_communicator_stays_in_progress() -> None:
    # group.cc:825-857: the launch runs on a thread NCCL starts, the call returns
    # InProgress; abort joins that thread (init.cc:3036-3041 → 422-426, group.cc:902-908).
    with SimCluster(sync_limit=5.0) as sim:
        (comm,) = world(sim, 1)
        (s,) = streams_of(sim, 1)
        t = sim.gpu.tensor([1.0])
        stuck = sim.gpu.latch()
        sim.nccl.block_calls(comm, stuck)
        comm.allreduce(t, t, nc.NcclRedOp.SUM, stream=s)  # returns: nothing blocks the caller
        assert all(comm.get_async_error() == Result.InProgress for _ in range(10))
        assert sim.nccl.in_progress(comm) == 1 and sim.nccl.pushed(comm) == 0
        done = threading.Event()
        threading.Thread(target=lambda: (comm.abort(), done.set()), daemon=True).start()
        assert not done.wait(0.3)  # joins NCCL's stuck launch thread
        stuck.open()
        assert done.wait(10) and sim.nccl.state(comm).aborted
        assert sim.nccl.pushed(comm) == 0  # the aborted launch never reached its stream
        assert sim.gpu.errors == []


def test_a_stuck_launch_of_a_blocking_communicator_blocks_the_call() -> None:
    # group.cc:858-864: a blocking group is launched on the caller's thread.
    with SimCluster(sync_limit=5.0) as sim:
        lib = sim.lib()
        uid = lib._nc.UniqueId.from_bytes(lib.unique_id())
        comm = lib._nc.Communicator.init(1, 0, uid, nc.NCCLConfig(blocking=True))
        (s,) = streams_of(sim, 1)
        t = sim.gpu.tensor([1.0])
        stuck = sim.gpu.latch()
        sim.nccl.block_calls(comm, stuck)
        done = threading.Event()
        call = lambda: (comm.allreduce(t, t, nc.NcclRedOp.SUM, stream=s), done.set())  # noqa: E731
        threading.Thread(target=call, daemon=True).start()
        assert not done.wait(0.3)
        stuck.open()
        assert done.wait(10)
        comm.abort()


# ====================================================================== revoke
def test_sim_revoke_follows_ncclcommrevoke() -> None:
    with SimCluster() as sim:
        a, b = world(sim, 2)
        st = sim.nccl.state(a)
        with pytest.raises(TypeError):
            a.revoke(0, 1)  # the real signature: revoke(self, flags=0)
        with pytest.raises(NCCLError):
            a.revoke(1)  # init.cc:2971 flags must be NCCL_REVOKE_DEFAULT
        a.revoke()
        with pytest.raises(NCCLError) as info:
            a.revoke()  # init.cc:2983 a second revoke
        assert info.value.status == Result.InvalidArgument
        polls = [a.get_async_error() for _ in range(4)]
        assert polls[0] == Result.InProgress and polls[-1] == Result.Success
        with pytest.raises(NCCLError):
            a.finalize()
        assert any("finalize() after revoke()" in e for e in sim.gpu.errors)
        sim.gpu.errors.clear()
        b.finalize()
        with pytest.raises(NCCLError):
            b.revoke()  # init.cc:2977 revoke after finalize
        a.abort()
        b.abort()
        assert st.aborted and sim.nccl.live() == [] and sim.gpu.errors == []


def test_revoke_stays_in_progress_until_the_device_work_drained() -> None:
    with SimCluster(abort_drains=False) as sim:
        a, _b = world(sim, 2)
        t = sim.gpu.tensor([1.0])
        a.allreduce(t, t, nc.NcclRedOp.SUM, stream=streams_of(sim, 1)[0])  # rank 1 never joins
        ready(a)
        sim.gpu.idle()
        a.revoke()
        assert all(
            a.get_async_error() == Result.InProgress for _ in range(10)
        )  # commRevokeAsync syncs
        sim.nccl.drain_aborted()
        ready(a)
        a.abort()
        _b.abort()


# ============================================================== abort
def test_abort_waits_for_the_communicators_device_stream() -> None:
    # init.cc ncclCommAbort -> commReclaim -> commDestroySync: device stream synchronised.
    with SimCluster(abort_drains=False) as sim:
        a, b = world(sim, 2)
        t = sim.gpu.tensor([1.0])
        a.allreduce(t, t, nc.NcclRedOp.SUM, stream=streams_of(sim, 1)[0])  # rank 1 never joins
        ready(a)
        done = threading.Event()
        threading.Thread(target=lambda: (a.abort(), done.set()), daemon=True).start()
        assert not done.wait(0.3)  # still waiting for its kernel to leave the stream
        sim.nccl.drain_aborted()
        assert done.wait(10) and sim.nccl.state(a).aborted
        b.abort()


# ====================================================================== shrink
def test_shrink_rules() -> None:
    with SimCluster() as sim:
        a, b, c = world(sim, 3)
        cfg = sim.lib().config()
        with pytest.raises(NCCLError) as info:
            a.shrink([], cfg, DEFAULT)  # init.cc:3086 excludeRanksCount > 0
        assert info.value.status == Result.InvalidArgument
        with pytest.raises(NCCLError):
            a.shrink([0], cfg, DEFAULT)  # init.cc:3090 an excluded rank calls it
        ca = a.shrink([2], cfg, DEFAULT)
        with pytest.raises(nc.NcclInvalid):
            ca.get_async_error()  # *newcomm stays NULL until the parent's job ends
        assert a.get_async_error() == Result.InProgress  # rank 1 has not called it yet
        with torch.cuda.device(1):
            cb = b.shrink([2], cfg, DEFAULT)
        ready(a, b)  # the parents' jobs end: the children are filled
        ready(ca, cb)
        assert sim.nccl.state(cb).rank == 1 and sim.nccl.state(cb).world.nranks == 2
        for x in (a, b, c, ca, cb):
            x.abort()


# ======================================================================== grow
def test_grow_rules() -> None:
    # init.cc:3222-3370 and nccl.h: roles, one id per grow, rank numbering.
    with SimCluster() as sim:
        lib = sim.lib()
        a, b = world(sim, 2)
        with pytest.raises(NCCLError):
            a.grow(2, None)  # init.cc:3233 nRanks must exceed the parent's
        uid = lib.grow_id(a)
        with pytest.raises(NCCLError) as info:
            a.get_unique_id()  # nccl.h: not while a previous id is unconsumed
        assert info.value.status == Result.InvalidUsage
        with pytest.raises(nc.NcclInvalid):
            a.grow(
                3, nc.UniqueId.from_bytes(uid), rank=2
            )  # nccl4py: a new rank needs a null communicator
        ga = lib.grow(a, 3, uid)  # the root passes the id
        with torch.cuda.device(1):
            gb = lib.grow(b, 3, None)  # other members pass none
        with pytest.raises(NCCLError):
            lib.join_grow(3, 3, uid)  # init.cc:3285 rank >= nRanks
        with torch.cuda.device(2):
            gc = lib.join_grow(3, 2, uid)  # a new rank: Communicator().grow(nranks, id, rank=)
        assert a.get_async_error() == Result.InProgress or True  # the job ends once everyone joined
        ready(a, b)
        ready(ga, gb, gc)
        states = [sim.nccl.state(x) for x in (ga, gb, gc)]
        assert [s.rank for s in states] == [0, 1, 2] and {s.world.nranks for s in states} == {3}
        assert [s.device for s in states] == [0, 1, 2]
        with pytest.raises(NCCLError):
            lib.grow(a, 4, uid)  # consumed: the magic no longer matches
        with torch.cuda.device(3):
            with pytest.raises(NCCLError):
                lib.join_grow(4, 3, uid)
        for x in (a, b, ga, gb, gc):
            x.abort()


def test_grow_can_be_missing_from_nccl4py() -> None:
    with SimCluster(grow=False) as sim:
        (comm,) = world(sim, 1)
        assert not hasattr(comm, "grow") and not sim.lib().can_grow(comm)
        comm.abort()


# ============================================================== launch order
def test_launch_order_across_communicators_of_a_device_is_checked() -> None:
    with SimCluster() as sim:
        a0, a1 = world(sim, 2)
        b0, b1 = world(sim, 2)
        s0, s1 = streams_of(sim, 2)
        t0, t1 = sim.gpu.tensor([1.0], device=0), sim.gpu.tensor([1.0], device=1)
        S = nc.NcclRedOp.SUM
        a0.allreduce(t0, t0, S, stream=s0)
        b0.allreduce(t0, t0, S, stream=s0)
        b1.allreduce(t1, t1, S, stream=s1)  # cuda:1 launches B before A
        a1.allreduce(t1, t1, S, stream=s1)
        ready(a0, b0, a1, b1)
        assert any("launch order" in e for e in sim.gpu.errors), sim.gpu.errors
        sim.gpu.errors.clear()
        for x in (a0, a1, b0, b1):
            x.abort()


def test_revoke_and_grow_need_a_recent_libnccl() -> None:
    import types

    with SimCluster() as sim:
        (comm,) = world(sim, 1)
        lib = sim.lib()
        assert lib.can_revoke(comm) and lib.can_grow(comm)  # the installed libnccl (2.32)
        for version, revoke, grow in (
            ((2, 28, 6), False, False),
            ((2, 28, 7), True, False),
            ((2, 29, 2), True, True),
        ):
            old = types.ModuleType(f"nccl.core({version})")
            old.__dict__.update(vars(sim.nccl.module))
            v = types.SimpleNamespace(major=version[0], minor=version[1], micro=version[2])
            old.get_version = lambda v=v: types.SimpleNamespace(
                libnccl=types.SimpleNamespace(version=v)
            )  # type: ignore[attr-defined]
            assert (NcclLib(old).can_revoke(comm), NcclLib(old).can_grow(comm)) == (revoke, grow), (
                version
            )
        comm.abort()
