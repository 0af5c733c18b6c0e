"""How an NCCL communicator begins and ends when NCCL fails, on the simulated GPU: init
errors mapped by type, finalize and revoke that fail, a communicator that becomes
unusable, shrinks interrupted, and the owned stop thread."""

from __future__ import annotations

import asyncio
import threading
import time
import types
from typing import Any

import nccl.core as nc
import pytest
import torch
import torch.distributed as dist
from nccl.bindings.nccl import NCCLError, Result

import asynccoll as ac
from asynccoll._backends import nccl
from asynccoll._base.ops import OpKind, OpSpec
from asynccoll.testing.simgpu import Rdv, SimCluster
from tests.support.simgpu_util import WAIT, comm_of, until

pytestmark = pytest.mark.timeout(120)


def submit(be: Any, t: Any, timeout: float = 30.0) -> ac.Work:
    w = ac.Work("all_reduce", 1)
    be.submit(OpSpec(OpKind.ALL_REDUCE, t, timeout=timeout), w)
    return w


def init_raising(sim: SimCluster, exc: BaseException) -> None:
    def fail(*a: Any, **k: Any) -> Any:
        raise exc

    sim.nccl.module.Communicator.init.side_effect = fail


# ======================================================================= init
@pytest.mark.parametrize(
    ("code", "expect"),
    [(Result.Timeout, ac.CollectiveTimeout), (Result.InternalError, ac.BackendUnavailable)],
)
def test_init_errors_are_mapped_by_type(code: Any, expect: type) -> None:
    with SimCluster() as sim:
        init_raising(sim, NCCLError(int(code)))
        with pytest.raises(expect):
            sim.backends(1)


@pytest.mark.parametrize(
    ("code", "expect"),
    [(Result.RemoteError, ac.PeerFailure), (Result.InvalidUsage, ac.BackendUnavailable)],
)
def test_an_init_that_reports_an_error_is_aborted(code: Any, expect: type) -> None:
    with SimCluster() as sim:
        real = sim.nccl.module.Communicator.init.side_effect

        def broken(*a: Any, **k: Any) -> Any:
            comm = real(*a, **k)
            sim.nccl.set_error(comm, int(code))
            return comm

        sim.nccl.module.Communicator.init.side_effect = broken
        # NCCL's own words (ncclGetLastError, e.g. "Duplicate GPU detected") name the cause.
        with pytest.raises(
            expect, match=f"NCCL error {int(code)}: .*: simulated NCCL error {int(code)}$"
        ):
            sim.backends(1)
        assert sim.nccl.live() == []  # the half-built communicator was aborted


def test_an_init_cancelled_by_its_task_leaves_nothing_behind() -> None:
    with SimCluster() as sim:

        async def main() -> None:
            task = asyncio.ensure_future(
                sim.create(Rdv(dist.HashStore(), 0, 2), timeout=30)
            )  # rank 1 never comes
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())
        until(lambda: sim.nccl.comms and sim.nccl.live() == [])


def test_device_choice_happens_on_the_callers_thread() -> None:
    with SimCluster() as sim:

        async def main() -> Any:
            torch.cuda.set_device(2)  # as a user calling torch.cuda.set_device(local_rank)
            return await sim.create(Rdv(dist.HashStore(), 0, 1), device=None)

        be = asyncio.run(main())
        assert be.device == torch.device("cuda", 2) and sim.nccl.state(comm_of(be)).device == 2
        be.close()


# ======================================================================== end
def test_a_failing_finalize_falls_back_to_abort() -> None:
    with SimCluster() as sim:
        (be,) = sim.backends(1)
        st = sim.nccl.state(comm_of(be))
        sim.nccl.fail_call(comm_of(be), "finalize", NCCLError(int(Result.InternalError)))
        be.close()
        assert st.aborted and not st.destroyed and sim.nccl.live() == []


def test_a_failing_revoke_falls_back_to_abort_and_cannot_shrink() -> None:
    with SimCluster() as sim:
        (be,) = sim.backends(1)
        st = sim.nccl.state(comm_of(be))
        sim.nccl.fail_call(comm_of(be), "revoke", NCCLError(int(Result.InternalError)))
        be.abort()
        until(lambda: st.aborted)
        assert not be.can_shrink and be.handle.state == "aborted"
        with pytest.raises(ac.CommAborted):
            be.shrink([1])
        with pytest.raises(ac.CommAborted):
            be.submit(OpSpec(OpKind.ALL_REDUCE, sim.gpu.tensor([1.0])), ac.Work("all_reduce", 1))
        be.close()
        assert "aborted" in repr(be)


def test_revoke_exists_from_nccl_2_28_7() -> None:
    with SimCluster() as sim:
        (be,) = sim.backends(1)
        for version, expect in (((2, 28, 6), False), ((2, 28, 7), True), ((2, 29, 0), True)):
            old = types.ModuleType(f"nccl.core({version})")
            old.__dict__.update(vars(sim.nccl.module))
            v = types.SimpleNamespace(major=version[0], minor=version[1], micro=version[2])
            old.get_version = lambda v=v: types.SimpleNamespace(
                libnccl=types.SimpleNamespace(version=v)
            )  # type: ignore[attr-defined]
            assert nccl.NcclLib(old).can_revoke(comm_of(be)) is expect, version
        be.close()


def test_an_unusable_communicator_fails_the_ops_in_flight() -> None:
    with SimCluster() as sim:
        be0, be1 = sim.backends(2)
        w = submit(be0, sim.gpu.tensor([1.0]))  # rank 1 never joins: in flight
        until(lambda: be0.busy())
        sim.nccl.fail_call(
            comm_of(be0), "get_async_error", nc.NcclInvalid("gone")
        )  # the health check
        with pytest.raises(ac.CommAborted, match="NCCL reported error"):
            w.wait(WAIT)
        be0.abort()
        be1.abort()
        be0.close()
        be1.close()


def test_a_release_without_close_aborts_and_leaves_the_lane() -> None:
    with SimCluster() as sim:
        (be,) = sim.backends(1)
        st = sim.nccl.state(comm_of(be))
        be.release()  # the communicator was garbage-collected
        assert st.aborted and not st.revoked  # nothing will shrink it: no revoke
        until(lambda: not any(t.name == "asynccoll-nccl-launch-0" for t in threading.enumerate()))
        be.close()


def test_a_stop_thread_is_owned_and_joined() -> None:
    with SimCluster(abort_drains=False) as sim:
        be0, be1 = sim.backends(2)
        submit(be0, sim.gpu.tensor([1.0]))
        until(lambda: be0.busy())
        be0.handle.abort_timeout = 0.3
        be0.abort()  # bounded: the revoke cannot quiesce, the abort waits for the kernel
        stops = [t for t in threading.enumerate() if t.name == "asynccoll-nccl-stop-0"]
        assert len(stops) == 1 and stops[0].is_alive()
        sim.nccl.drain_aborted()
        be0.close()
        stops[0].join(WAIT)
        assert not stops[0].is_alive()
        be1.close()


def test_a_finalize_that_does_not_complete_in_time_falls_back_to_abort() -> None:
    with SimCluster() as sim:
        be0, be1 = sim.backends(2)
        st = sim.nccl.state(comm_of(be0))
        submit(be0, sim.gpu.tensor([1.0]))  # rank 1 never joins: finalize cannot complete
        until(lambda: be0.busy())
        be0.handle.close_timeout = 0.3
        be0.close()
        assert "finalize" in st.calls and st.aborted and not st.destroyed
        assert be0.handle.close(broken=False) is False  # closed already
        be1.close()


def test_stopping_an_ended_communicator_is_a_no_op() -> None:
    with SimCluster() as sim:
        (be,) = sim.backends(1)
        be.abort()
        assert "revoked" in repr(be.handle) and be.handle.state == "revoked"
        be.release()  # nothing will shrink it: aborted now
        assert be.handle.communicator is None and be.handle.state == "aborted"
        deadline = time.monotonic() + 1
        with pytest.raises(ac.CommAborted):
            be.handle.shrink([1], True, deadline)
        with pytest.raises(ac.CommAborted):
            be.handle.grow(2, None, deadline)
        be.abort()  # idempotent
        be.close()


def test_a_shrink_interrupted_by_an_abort_ends_at_once() -> None:
    with SimCluster() as sim:
        bes = sim.backends(3)
        threading.Timer(0.3, bes[0].abort).start()
        t0 = time.monotonic()
        with pytest.raises(ac.CommAborted):
            bes[0].shrink([2], timeout=WAIT)  # rank 1 never calls it
        assert time.monotonic() - t0 < WAIT / 2
        for be in bes:
            be.abort()
            be.close()


# ==================================================================== shrink
def test_a_shrink_whose_parent_fails_raises_peer_failure() -> None:
    with SimCluster() as sim:
        bes = sim.backends(3)
        real = sim.nccl.state(comm_of(bes[0])).mock.shrink.side_effect

        def shrink_then_die(*a: Any, **k: Any) -> Any:
            child = real(*a, **k)
            sim.nccl.set_error(
                comm_of(bes[0]), int(Result.RemoteError)
            )  # a survivor died meanwhile
            return child

        sim.nccl.state(comm_of(bes[0])).mock.shrink.side_effect = shrink_then_die
        with pytest.raises(ac.PeerFailure):
            bes[0].shrink([2], timeout=5)
        for be in bes:
            be.abort()
            be.close()
        assert sim.nccl.live() == []  # the child's init went with its parent (childAbortFlag)


def test_shrink_arguments_are_checked() -> None:
    with SimCluster() as sim:
        bes = sim.backends(2)
        for bad in ([], [5], [0, 1]):
            with pytest.raises(ac.InvalidArgument):
                bes[1].shrink(bad)
        with pytest.raises(ac.InvalidArgument):
            bes[1].shrink([1])  # excluded from it
        for be in bes:
            be.close()


# ======================================================================= grow
def test_a_joiner_whose_grow_is_refused_gets_a_contract_error() -> None:
    with SimCluster() as sim:
        store = dist.HashStore()
        store.set("nccl-grow/mode", "grow")
        store.set("nccl-grow/uid", bytes(16).hex())  # an id no member ever took
        with pytest.raises(ac.BackendUnavailable):
            nccl.join_grown(store, 2, 3, 0, 5.0, lib=sim.lib())
        empty = dist.HashStore()
        with pytest.raises(ac.CollectiveTimeout):
            nccl.join_grown(empty, 2, 3, 0, 0.3, lib=sim.lib())
