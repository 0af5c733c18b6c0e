"""The NCCL backend end to end on the simulated GPU: streams, wait_stream, allocator, faults, lifecycle.

Everything but CUDA and libnccl is real (Communicator, NcclBackend, NcclLib,
EventPool, EventWatcher). ``gpu.errors`` (allocator hazards, NCCL contract
breaches such as kernels on a stream before ncclInProgress cleared) must stay
empty in every test.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from typing import Any

import nccl.core as nc
import pytest
import torch
import torch.distributed as dist

import asynccoll as ac
import streams
from asynccoll._backends import nccl
from asynccoll._base.ops import OpKind, OpSpec
from asynccoll.testing.simgpu import SimCluster
from tests.support.simgpu_util import WAIT, close_all, comm_of, submit, until

pytestmark = pytest.mark.timeout(120)


def on_device(index: int, fn: Any, *args: Any) -> threading.Thread:
    """``fn(*args)`` on a new thread that works on ``cuda:index`` (as a user thread would)."""

    def main() -> None:
        torch.cuda.set_device(index)
        fn(*args)

    t = threading.Thread(target=main, daemon=True)
    t.start()
    return t


# ================================================================ stream ordering
def test_op_waits_for_the_callers_stream_and_wait_stream_orders_a_later_kernel() -> None:
    with SimCluster() as sim:
        gpu = sim.gpu

        async def body(comm: Any) -> list[float]:
            r = comm.rank
            user, side = gpu.stream(f"user{r}"), gpu.stream(f"side{r}")
            t = gpu.tensor(torch.zeros(4), stream=user)
            hold = gpu.latch()
            gpu.kernel(
                user, lambda: t.as_subclass(torch.Tensor).fill_(r + 1), hold=hold, name=f"long{r}"
            )
            with gpu.use_stream(user):
                w = comm.all_reduce(t)
            w.wait_stream(side)
            with gpu.use_stream(side):
                t.mul_(10)  # a kernel on `side`: must run after the all_reduce
            nccl_comm = comm._backends["cuda"].handle.communicator
            await asyncio.to_thread(
                until, lambda: sim.nccl.pushed(nccl_comm) == 1
            )  # on the comm stream
            gpu.idle()
            assert not w.done() and gpu.host(t).tolist() == [0.0] * 4  # held behind the long kernel
            hold.open()
            await asyncio.wait_for(w, WAIT)
            side.synchronize()
            return gpu.host(t).tolist()

        assert sim.run_comms(2, body) == [[30.0] * 4] * 2
        assert gpu.errors == []


def test_wait_stream_on_a_settled_work_and_by_handle() -> None:
    with SimCluster() as sim:
        gpu = sim.gpu
        (be,) = sim.backends(1)
        t = gpu.tensor([1.0])
        w = submit(be, OpKind.ALL_REDUCE, t)
        s = gpu.stream("by-handle")
        w.wait_stream(s.cuda_stream)  # an int handle (e.g. from CuPy)
        w.wait(WAIT)
        w.wait_stream(s)  # settled: nothing to wait for
        s.synchronize()
        close_all(be)
        assert gpu.errors == []


def test_wait_stream_on_a_queued_op_is_deadlock_free_with_one_hardware_queue() -> None:
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
        w = ac.Work("all_gather", 1)
        be.submit(OpSpec(OpKind.ALL_GATHER, x, output=out, timeout=30.0), w)
        until(lambda: sim.nccl.in_progress(comm_of(be)) == 1)  # the launch is stuck in NCCL
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


def test_wait_stream_on_a_launched_op_waits_on_its_event() -> None:
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


def test_abort_never_leaves_a_stream_waiting_on_the_device() -> None:
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
        w2 = submit(be0, OpKind.ALL_REDUCE, gpu.tensor([2.0]))  # its launch stays ncclInProgress
        until(lambda: sim.nccl.in_progress(c0) == 1)
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


def test_the_comm_stream_is_not_one_of_torchs_pool_streams() -> None:
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


# ============================================================ allocator safety
def test_tensors_of_an_aborted_op_are_protected_by_record_stream() -> None:
    with SimCluster(abort_drains=False) as sim:
        gpu = sim.gpu
        be0, be1 = sim.backends(2)
        t = gpu.tensor(torch.ones(8))
        # rank 0's own simulator state, read now: the creation order of the ranks' comms (threads) varies
        state0 = sim.nccl.state(be0.handle.communicator)
        w = submit(be0, OpKind.ALL_REDUCE, t)  # rank 1 never joins: stuck on the comm stream
        until(lambda: bool(state0.launches))
        gpu.idle()
        assert not w.done()
        del t
        gc.collect()
        be0.handle.abort_timeout = 0.3
        be0.abort()  # bounded: ncclCommAbort still waits for the kernel to leave the stream
        be0.close()  # bounded too: the backend drops its references; the kernel is still there
        gc.collect()
        assert state0.launches[0].pushed
        assert gpu.errors == []  # record_stream(comm stream): the allocator defers the reuse
        sim.nccl.drain_aborted()
        be1.close()
        assert gpu.errors == []


def test_failed_op_keeps_its_tensors_until_abort() -> None:
    with SimCluster(inprogress_polls=10**9) as sim:  # never leaves ncclInProgress
        (be,) = sim.backends(1)
        t = sim.gpu.tensor([1.0])
        w = submit(be, OpKind.ALL_REDUCE, t, timeout=0.2)
        with pytest.raises(ac.CollectiveTimeout):
            w.wait(WAIT)
        assert be.stuck == 1  # NCCL may still launch it: its tensors stay referenced
        be.abort()
        assert be.stuck == 0
        be.close()


def test_no_pinned_allocation_or_stream_memory_operation_mid_traffic() -> None:
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


# ===================================================================== faults
def test_abort_while_stuck_is_bounded_and_fails_the_work() -> None:
    with SimCluster() as sim:
        gpu = sim.gpu

        async def body(comm: Any) -> str:
            if comm.rank == 1:
                sim.nccl.hang(comm._backends["cuda"].handle.communicator)
            t = gpu.tensor([1.0, 2.0])
            w = comm.all_reduce(t)
            gpu.idle()
            await asyncio.sleep(0.05)
            assert not w.done()
            comm.abort("test")
            with pytest.raises(ac.CommAborted):
                await asyncio.wait_for(w, WAIT)
            return comm.state

        assert sim.run_comms(2, body) == ["aborted", "aborted"]
        assert all(st.aborted for st in sim.nccl.comms) and sim.nccl.live() == []
        assert gpu.errors == []


def test_abort_while_a_launch_is_stuck_in_progress() -> None:
    # NCCL's launch thread is stuck (a non-blocking communicator: the call returned, the
    # communicator stays ncclInProgress), and NCCL's own abort/revoke joins that thread.
    with SimCluster() as sim:
        (be,) = sim.backends(1)
        stuck = sim.gpu.latch()
        st = sim.nccl.state(be.handle.communicator)
        sim.nccl.block_calls(be.handle.communicator, stuck)
        w = submit(be, OpKind.ALL_REDUCE, sim.gpu.tensor([1.0]))
        until(lambda: sim.nccl.in_progress(be.handle.communicator) == 1)
        be.handle.abort_timeout = 0.5
        t0 = time.monotonic()
        be.abort()  # bounded although NCCL's own abort (or revoke) is stuck too
        assert time.monotonic() - t0 < 2.0
        assert be.handle.stopping and not w.done()  # the communicator failed it, never as a success
        stuck.open()
        until(lambda: st.revoked or st.aborted)  # the stop goes ahead once NCCL lets it
        be.close()
        assert st.aborted and not w.done()


class Recorder:
    """A sink that records what the backend reports."""

    def __init__(self) -> None:
        self.succeeded: list[Any] = []
        self.failed: list[Any] = []

    def succeed(self, target: Any, value: Any = None) -> None:
        self.succeeded.append(target)

    def succeed_all(self, targets: Any) -> None:
        self.succeeded.extend(targets)

    def fail(self, target: Any, exc: BaseException) -> None:
        self.failed.append((target, exc))


def test_no_success_is_reported_after_abort() -> None:
    # The watcher is inside the done event's synchronize when abort comes; the aborted
    # kernel then leaves the stream and the event fires: that is no success. (The stop
    # thread is held after ncclCommAbort returned, so the watcher's callback comes first.)
    with SimCluster() as sim:
        be0, be1 = sim.backends(2)
        sink = Recorder()
        be0.bind(sink)
        st = sim.nccl.state(be0.handle.communicator)
        real_abort = st.mock.abort.side_effect
        held = threading.Event()

        def abort_then_hold() -> None:
            real_abort()
            held.wait(WAIT)

        st.mock.abort.side_effect = abort_then_hold
        submit(be0, OpKind.ALL_REDUCE, sim.gpu.tensor([1.0]))  # rank 1 never joins
        until(be0.busy)
        threading.Event().wait(0.1)  # the watcher is inside the done event's synchronize
        be0.handle.use_revoke = False
        be0.handle.abort_timeout = 0.3
        be0.abort()
        until(lambda: st.aborted)
        sim.gpu.synchronize()
        threading.Event().wait(0.2)  # the watcher's callback ran
        assert sink.succeeded == []
        held.set()
        close_all(be0, be1)


def test_dead_peer_is_peer_failure_with_the_nccl_code() -> None:
    with SimCluster() as sim:
        be0, be1 = sim.backends(2)
        w = submit(be0, OpKind.ALL_REDUCE, sim.gpu.tensor([1.0]))
        until(lambda: bool(sim.nccl.state(be0.handle.communicator).launches))
        sim.nccl.kill(be1.handle.communicator)
        with pytest.raises(ac.PeerFailure) as info:
            w.wait(WAIT)
        assert (
            isinstance(info.value.__cause__, nccl.NcclError)
            and info.value.__cause__.status == nccl.REMOTE_ERROR
        )
        be0.abort()
        be1.abort()
        close_all(be0, be1)


def test_async_error_fails_later_ops_without_calling_nccl() -> None:
    with SimCluster() as sim:
        (be,) = sim.backends(1)
        st = sim.nccl.state(be.handle.communicator)
        sim.nccl.set_error(be.handle.communicator, nccl.INVALID_ARGUMENT)
        w = submit(be, OpKind.ALL_REDUCE, sim.gpu.tensor([1.0]))
        with pytest.raises(ac.CommAborted):
            w.wait(WAIT)
        n = len(st.calls)
        w2 = submit(be, OpKind.ALL_REDUCE, sim.gpu.tensor([1.0]))
        with pytest.raises(ac.CommAborted):
            w2.wait(WAIT)
        assert [c for c in st.calls[n:] if c not in ("get_async_error", "get_last_error")] == []
        be.close()
        assert st.aborted  # close() aborts a communicator that reported an error


# ============================================================ groups, lifecycle
def test_coalesced_ops_are_one_nccl_group() -> None:
    with SimCluster() as sim:
        gpu = sim.gpu

        async def body(comm: Any) -> list[Any]:
            st = sim.nccl.state(comm._backends["cuda"].handle.communicator)
            a, b = gpu.tensor([1.0 + comm.rank]), gpu.tensor([10.0 * (comm.rank + 1)])
            before = len(st.launches)
            async with comm.coalescing():
                comm.all_reduce(a)
                comm.broadcast(b, 1)
            assert len(st.launches) == before + 1 and len(st.launches[-1].ops) == 2
            return [gpu.host(a).item(), gpu.host(b).item()]

        assert sim.run_comms(2, body) == [[3.0, 20.0]] * 2
        assert gpu.errors == []


def test_init_close_cycles_leak_nothing() -> None:
    with SimCluster() as sim:
        before = threading.active_count()

        async def body(comm: Any) -> float:
            t = sim.gpu.tensor([1.0])
            await comm.all_reduce(t)
            await comm.barrier()
            return sim.gpu.host(t).item()

        for _ in range(3):
            assert sim.run_comms(2, body) == [2.0, 2.0]
        assert sim.nccl.live() == [] and all(st.destroyed for st in sim.nccl.comms)
        # every comm stream went back for reuse: 3 cycles made one per rank, no more
        assert streams.own_streams().created == 2
        until(lambda: threading.active_count() <= before + 1)
        assert sim.gpu.errors == []


def test_create_times_out_and_aborts_the_half_built_comm() -> None:
    with SimCluster() as sim:
        import torch.distributed as dist

        from asynccoll.testing.simgpu import Rdv

        with pytest.raises(ac.CollectiveTimeout):
            asyncio.run(sim.create(Rdv(dist.HashStore(), 0, 2), timeout=0.3))  # rank 1 never comes
        until(lambda: sim.nccl.comms and sim.nccl.live() == [])


def test_every_communicator_is_non_blocking() -> None:
    with SimCluster() as sim:
        bes = sim.backends(2)
        assert [st.blocking for st in sim.nccl.comms] == [False, False]
        close_all(*bes)


def test_two_communicators_on_one_device_use_their_own_streams() -> None:
    with SimCluster() as sim:
        gpu = sim.gpu
        a0, a1 = sim.backends(2)
        b0, b1 = sim.backends(2)
        streams_ = {id(be.runtime.comm_stream) for be in (a0, a1, b0, b1)}
        assert len(streams_) == 4
        ts = {
            be: gpu.tensor([float(i + 1)], device=be.device)
            for i, be in enumerate((a0, a1, b0, b1))
        }
        works = []
        for _ in range(5):  # both launchers run concurrently
            for be in (a0, b0, a1, b1):
                works.append(submit(be, OpKind.ALL_REDUCE, ts[be]))
        for w in works:
            w.wait(WAIT)
        for be in (a0, a1, b0, b1):
            st = sim.nccl.state(be.handle.communicator)
            assert {la.stream.handle for la in st.launches} == {be.runtime.comm_stream.cuda_stream}
        assert [gpu.host(ts[be]).item() for be in (a0, a1)] == [3.0 * 2**4] * 2
        assert [gpu.host(ts[be]).item() for be in (b0, b1)] == [7.0 * 2**4] * 2
        close_all(a0, a1, b0, b1)
        assert gpu.errors == []


def test_auto_backend_mixes_cpu_gloo_and_cuda_nccl() -> None:
    with SimCluster() as sim:
        gpu = sim.gpu

        async def body(comm: Any) -> list[Any]:
            assert comm._backends["cuda"].name == "nccl" and comm._backends["cpu"].name == "gloo"
            c = torch.tensor([1.0 + comm.rank])
            g = gpu.tensor([10.0 * (comm.rank + 1)])
            wc, wg = comm.all_reduce(c), comm.all_reduce(g)
            await wc
            await wg
            return [c.item(), gpu.host(g).item()]

        assert sim.run_comms(2, body, backend="auto") == [[3.0, 30.0]] * 2
        assert gpu.errors == []


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
def test_nccl_init_ops_and_close_on_every_loop(loop: str) -> None:
    """API.md §10: NCCL's init (off the loop, bounded) and its Works on each loop; on
    trio the init once failed with "no running event loop" (found on the real GPU)."""
    with SimCluster() as sim:
        gpu = sim.gpu

        async def body(comm: Any) -> float:
            g = gpu.tensor([1.0 + comm.rank])
            await comm.all_reduce(g)
            return float(gpu.host(g).item())

        assert sim.run_comms(2, body, loop=loop) == [3.0, 3.0]
        assert gpu.errors == []


def test_init_checks_nccl_and_picks_the_device_off_the_loop() -> None:
    """Loading libnccl (the availability check) and initializing CUDA
    (``torch.cuda.current_device()``) stay off the loop's thread: on an H100 a process's
    first ``init("nccl")`` stalled the loop 15-30 ms (the GPU test, which does both before
    it measures, still sees that stall: see docs/verified.md)."""
    import dataclasses
    from unittest import mock

    from asynccoll._bootstrap.init import init_with

    with SimCluster() as sim:
        seen: list[str] = []
        factories = sim.factories()
        checked = dataclasses.replace(
            factories, nccl_missing=lambda: seen.append(threading.current_thread().name) or None
        )

        async def main() -> str:
            loop_thread = threading.current_thread().name
            with (
                mock.patch.object(torch.cuda, "is_initialized", return_value=False),
                mock.patch.object(
                    torch.cuda, "current_device", side_effect=AssertionError("initializes CUDA")
                ),
            ):
                async with init_with(
                    checked,
                    "nccl",
                    rank=0,
                    world_size=1,
                    store=dist.HashStore(),
                    timeout=20,
                    heartbeat=0,
                ) as comm:
                    assert comm.device == torch.device("cuda", 0)
            return loop_thread

        loop_thread = asyncio.run(main())
        assert seen and loop_thread not in seen, seen


# ====================================================================== shrink
@pytest.mark.parametrize("abort_pending", [False, True])
def test_shrink_excludes_ranks_renumbers_and_passes_the_flag(abort_pending: bool) -> None:
    with SimCluster() as sim:
        gpu = sim.gpu
        bes = sim.backends(3)
        new: dict[int, Any] = {}

        def survivor(r: int) -> None:
            new[r] = bes[r].shrink([1], abort_pending)

        threads = [threading.Thread(target=survivor, args=(r,)) for r in (0, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        assert [(new[r].rank, new[r].world_size) for r in (0, 2)] == [(0, 2), (1, 2)]
        flag = nc.CommShrinkFlag.ABORT if abort_pending else nc.CommShrinkFlag.DEFAULT
        for r in (0, 2):
            args = sim.nccl.state(bes[r].handle.communicator).mock.shrink.call_args.args
            assert list(args[0]) == [1] and args[1].blocking is False and args[2] is flag
            assert new[r].runtime.comm_stream is not bes[r].runtime.comm_stream
        ts = [gpu.tensor([1.0], device=new[0].device), gpu.tensor([5.0], device=new[2].device)]
        ws = [submit(new[r], OpKind.ALL_REDUCE, t) for r, t in zip((0, 2), ts)]
        for w in ws:
            w.wait(WAIT)
        assert [gpu.host(t).item() for t in ts] == [6.0, 6.0]
        with pytest.raises(ac.InvalidArgument):
            bes[1].shrink([1])
        close_all(new[0], new[2], *bes)
        assert gpu.errors == []


def test_shrink_defaults_to_abort_when_ops_are_in_flight() -> None:
    with SimCluster() as sim:
        bes = sim.backends(2)
        submit(bes[0], OpKind.ALL_REDUCE, sim.gpu.tensor([1.0]))  # rank 1 never joins
        until(lambda: bool(sim.nccl.state(bes[0].handle.communicator).launches))
        solo = bes[0].shrink([1])
        assert (
            sim.nccl.state(bes[0].handle.communicator).mock.shrink.call_args.args[2]
            is nc.CommShrinkFlag.ABORT
        )
        assert (solo.rank, solo.world_size) == (0, 1)
        bes[0].abort()
        close_all(solo, *bes)
        assert sim.gpu.errors == []
