"""``comm.shrink()`` on NCCL: revoke on abort, then ``ncclCommShrink`` (simulated GPU).

The NCCL below is :class:`asynccoll.testing.simgpu.SimNccl` (autospecs of nccl4py's
real ``Communicator``); everything above it is real: ``asynccoll.init``, the
Communicator, its ledger, ``_faults/shrink.py``, ``NcclBackend``, ``NcclLib``.

Ranks are threads (``SimCluster.run_comms``) with heartbeats off, so a peer's
death reaches the survivors only as NCCL's ``RemoteError`` (a ``PeerFailure``
that names no rank): ``failed_ranks`` is empty and the tests pass ``exclude``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import nccl.core as nc
import pytest

import asynccoll as ac
from asynccoll._base.ops import OpKind, OpSpec
from asynccoll.testing.simgpu import SimCluster

pytestmark = pytest.mark.timeout(120)
WAIT = 20.0
ABORT, DEFAULT = nc.CommShrinkFlag.ABORT, nc.CommShrinkFlag.DEFAULT


def nccl_state(sim: SimCluster, comm: Any) -> Any:
    return sim.nccl.state(comm._backends["cuda"].handle.communicator)


def death_and_shrink(
    sim: SimCluster,
    stall_revoke_on: int | None = None,
    exclude: list[int] | None = [2],  # noqa: B006 - never mutated
    **run: Any,
) -> list[Any]:
    """3 ranks; rank 2 dies after one all_reduce; the survivors see a failure and
    shrink. Returns, per survivor: (parent state, failed_ranks, new rank/size, result)."""
    gpu = sim.gpu
    dead = threading.Event()
    first = threading.Barrier(3)  # every rank saw its first all_reduce complete

    async def body(comm: Any) -> Any:
        st = nccl_state(sim, comm)
        t = gpu.tensor([float(comm.rank + 1)])
        await asyncio.wait_for(comm.all_reduce(t), WAIT)
        assert gpu.host(t).item() == 6.0
        # Without this, rank 2's abort news (heartbeats on) could fail a survivor's first
        # all_reduce before its watcher reported the completion (seen once in ~3 runs).
        await asyncio.to_thread(first.wait, WAIT)
        if comm.rank == stall_revoke_on:
            sim.nccl.stall_revoke(comm._backends["cuda"].handle.communicator)
        if comm.rank == 2:
            sim.nccl.kill(comm._backends["cuda"].handle.communicator)
            dead.set()
            comm.abort("rank 2 died")  # nothing more comes from this rank
            return None
        await asyncio.to_thread(dead.wait, WAIT)
        # NCCL's RemoteError (PeerFailure), or rank 2's abort news (heartbeats on)
        with pytest.raises(ac.PeerFailure if not run else ac.CommAborted):
            await asyncio.wait_for(comm.all_reduce(gpu.tensor([1.0])), WAIT)
        assert comm.state == "aborted"
        failed = comm.failed_ranks
        new = await asyncio.wait_for(comm.shrink(exclude=exclude), WAIT)
        try:
            x = gpu.tensor([float(10 * (comm.rank + 1))])
            await asyncio.wait_for(new.all_reduce(x), WAIT)
            return st, failed, (new.rank, new.world_size), gpu.host(x).item(), nccl_state(sim, new)
        finally:
            await new.close()

    return sim.run_comms(3, body, **run)[:2]


# ================================================================ after a failure
def test_dead_rank_survivors_revoke_then_shrink_with_abort_no_fresh_init() -> None:
    with SimCluster() as sim:
        out = death_and_shrink(sim)
        for r, (st, failed, shape, value, child) in enumerate(out):
            assert set(failed) <= {2}  # never a live rank (NCCL's RemoteError names none)
            assert shape == (r, 2) and value == 30.0
            # abort revoked the communicator (no ncclCommAbort), then ncclCommShrink(ABORT)
            assert "revoke" in st.calls and "shrink" in st.calls
            assert st.calls.index("revoke") < st.calls.index("shrink")
            assert "abort" not in st.calls[: st.calls.index("shrink")]
            assert st.shrink_flags == [ABORT]
            args = st.mock.shrink.call_args.args
            assert list(args[0]) == [2] and args[2] is ABORT and args[1].blocking is False
            assert "finalize" not in st.calls  # invalid after revoke
            assert st.aborted  # the revoked parent is freed once the child is ready
            assert child.world.key[1] == "shrink"  # the new communicator is the shrunk child
        assert sim.nccl.module.Communicator.init.call_count == 3  # no fresh init
        assert sim.nccl.live() == []
        assert sim.gpu.errors == []


def test_with_heartbeats_shrink_without_exclude_drops_the_dead_rank() -> None:
    # failed_ranks stays empty here (NCCL names no rank; a thread "dying" in the
    # simulator is no process death for the liveness probe), so shrink() settles
    # the set by agreement: rank 2 never proposes and is excluded after the grace
    # period (half the timeout). The NCCL part is the same: revoke, shrink(ABORT).
    with SimCluster() as sim:
        out = death_and_shrink(sim, exclude=None, heartbeat=0.25, timeout=4.0)
        for r, (st, failed, shape, value, _child) in enumerate(out):
            assert set(failed) <= {2} and shape == (r, 2) and value == 30.0
            assert st.calls.index("revoke") < st.calls.index("shrink") and st.shrink_flags == [
                ABORT
            ]
        assert sim.nccl.module.Communicator.init.call_count == 3
        assert sim.nccl.live() == [] and sim.gpu.errors == []


def test_planned_shrink_of_a_healthy_comm_uses_default() -> None:
    with SimCluster() as sim:
        gpu = sim.gpu
        done = threading.Event()

        async def body(comm: Any) -> Any:
            t = gpu.tensor([float(comm.rank + 1)])
            await asyncio.wait_for(comm.all_reduce(t), WAIT)
            if comm.rank == 2:  # leaves the group: takes no part in the shrink
                await asyncio.to_thread(done.wait, WAIT)
                return None
            st = nccl_state(sim, comm)
            new = await asyncio.wait_for(comm.shrink(exclude=[2]), WAIT)
            try:
                x = gpu.tensor([float(comm.rank + 2)])
                await asyncio.wait_for(new.all_reduce(x), WAIT)
                return st, (new.rank, new.world_size), gpu.host(x).item()
            finally:
                await new.close()
                if comm.rank == 0:
                    done.set()

        out = sim.run_comms(3, body)[:2]
        for r, (st, shape, value) in enumerate(out):
            assert shape == (r, 2) and value == 5.0
            assert st.calls.index("revoke") < st.calls.index("shrink")
            assert st.shrink_flags == [DEFAULT]
        assert sim.nccl.module.Communicator.init.call_count == 3
        assert sim.nccl.live() == []
        assert gpu.errors == []


def test_shrink_after_a_user_abort_without_failures_builds_a_new_communicator() -> None:
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


# ===================================================================== fallbacks
def test_without_revoke_abort_is_ncclcommabort_and_shrink_inits_afresh() -> None:
    with SimCluster(revoke=False) as sim:
        out = death_and_shrink(sim)
        for r, (st, _failed, shape, value, child) in enumerate(out):
            assert shape == (r, 2) and value == 30.0
            assert "abort" in st.calls and st.shrink_flags == []
            assert child.world.key[1] != "shrink"
        assert sim.nccl.module.Communicator.init.call_count == 3 + 2  # a fresh init per survivor
        assert sim.nccl.live() == []
        assert sim.gpu.errors == []


def test_a_hanging_revoke_falls_back_to_abort_and_every_survivor_inits_afresh() -> None:
    # Rank 1's revoke never quiesces: its abort stays bounded (ncclCommAbort after
    # half of abort_timeout) and, since rank 1 cannot shrink, rank 0 does not wait
    # in ncclCommShrink for it: both build a new communicator.
    with SimCluster() as sim:
        out = death_and_shrink(sim, stall_revoke_on=1)
        st0, st1 = out[0][0], out[1][0]
        assert st1.calls.index("revoke") < st1.calls.index("abort") and st1.aborted
        assert "revoke" in st0.calls and st0.aborted  # revoked, then freed unshrunk
        assert st0.shrink_flags == st1.shrink_flags == []
        assert [o[2:4] for o in out] == [((0, 2), 30.0), ((1, 2), 30.0)]
        assert sim.nccl.module.Communicator.init.call_count == 5
        assert sim.nccl.live() == []
        assert sim.gpu.errors == []


def test_abort_with_a_stalled_revoke_is_bounded_and_cannot_shrink() -> None:
    with SimCluster() as sim:
        be0, be1 = sim.backends(2)
        be0.handle.abort_timeout = 0.4
        st = sim.nccl.state(be0.handle.communicator)
        w = ac.Work("all_reduce", 1)
        be0.submit(
            OpSpec(OpKind.ALL_REDUCE, sim.gpu.tensor([1.0]), timeout=30.0), w
        )  # rank 1 never joins
        sim.nccl.stall_revoke(be0.handle.communicator)
        done = threading.Event()

        def abort() -> None:
            be0.abort()
            done.set()

        threading.Thread(target=abort, daemon=True).start()
        assert done.wait(WAIT)  # bounded although the revoke never completes
        for _ in range(int(WAIT / 0.01)):  # the fallback ncclCommAbort follows the revoke's bound
            if st.aborted:
                break
            threading.Event().wait(0.01)
        assert st.calls.index("revoke") < st.calls.index("abort") and st.aborted
        assert not be0.can_shrink
        with pytest.raises(ac.CommAborted):
            be0.shrink([1])
        be1.abort()
        be0.close()
        be1.close()
        assert sim.nccl.live() == [] and sim.gpu.errors == []


def test_a_revoked_backend_is_shrinkable_and_close_aborts_it() -> None:
    with SimCluster() as sim:
        be0, be1 = sim.backends(2)
        be0.abort()
        st = sim.nccl.state(be0.handle.communicator)
        assert be0.can_shrink and st.revoked and not st.aborted and "revoke" in st.calls
        be0.close()  # finalize after revoke is invalid: close aborts it
        assert st.aborted and "finalize" not in st.calls
        be1.close()
        assert sim.nccl.live() == [] and sim.gpu.errors == []
