"""The simulated GPU itself (streams, events, gates, allocator, nccl4py autospecs), and the
``streams`` package (EventPool, EventWatcher, wait_event) running on its events."""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import nccl.core as nc
import pytest
import torch

import streams
from asynccoll.testing.simgpu import SimCluster, SimGPU, SimTensor

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def gpu() -> Any:
    g = SimGPU()
    yield g
    g.close()


# ====================================================================== device
def test_sim_tensors_look_like_cuda_tensors(gpu: SimGPU) -> None:
    t = gpu.tensor([1.0, 2.0])
    assert isinstance(t, SimTensor) and t.is_cuda and not t.is_cpu and t.device == torch.device("cuda", 0)
    v = t.view(torch.uint8)
    assert isinstance(v, SimTensor) and v.is_cuda


def test_stream_is_fifo_and_events_follow_records(gpu: SimGPU) -> None:
    s = gpu.stream()
    hold = gpu.latch()
    order: list[str] = []
    gpu.kernel(s, lambda: order.append("a"), hold=hold)
    ev = gpu.event()
    assert ev.query()  # never recorded: complete, as in CUDA
    ev.record(s)
    gpu.kernel(s, lambda: order.append("b"))
    gpu.idle()
    assert order == [] and not ev.query()
    hold.open()
    ev.synchronize()
    s.synchronize()
    assert order == ["a", "b"] and ev.query()


def test_wait_event_waits_for_the_record_current_at_call_time(gpu: SimGPU) -> None:
    a, b = gpu.stream("a"), gpu.stream("b")
    ev = gpu.event()
    b.wait_event(ev)  # not recorded yet: orders nothing (the CUDA trap wait_stream must avoid)
    ran: list[str] = []
    gpu.kernel(b, lambda: ran.append("early"))
    hold = gpu.latch()
    gpu.kernel(a, lambda: ran.append("long"), hold=hold)
    ev.record(a)
    b.wait_event(ev)
    gpu.kernel(b, lambda: ran.append("after"))
    gpu.idle()
    assert ran == ["early"]
    hold.open()
    b.synchronize()
    assert ran == ["early", "long", "after"]


def test_gate_is_a_cyclic_32_bit_geq_wait(gpu: SimGPU) -> None:
    g, s = gpu.gate(), gpu.stream()
    ran: list[int] = []
    g.wait(s, 2)
    gpu.kernel(s, lambda: ran.append(2))
    other = gpu.stream()
    g.signal(other, 1)
    other.synchronize()
    gpu.idle()
    assert ran == []
    g.signal(other, 2)
    s.synchronize()
    assert ran == [2]
    g.host_write(0xFFFFFFFF)
    g.wait(s, 0x7FFFFFF0)  # (0xFFFFFFFF - 0x7FFFFFF0) wraps negative: not reached
    gpu.kernel(s, lambda: ran.append(3))
    gpu.idle()
    assert ran == [2]
    g.host_write(0x7FFFFFF0)
    s.synchronize()
    assert ran == [2, 3]


def test_in_place_ops_on_a_current_stream_are_kernels(gpu: SimGPU) -> None:
    s = gpu.stream()
    t = gpu.tensor([1.0])
    hold = gpu.latch()
    gpu.kernel(s, lambda: None, hold=hold)
    with gpu.use_stream(s):
        t.add_(1)
    assert gpu.host(t).item() == 1.0
    hold.open()
    s.synchronize()
    assert gpu.host(t).item() == 2.0


def test_allocator_reports_a_free_while_another_stream_uses_the_tensor(gpu: SimGPU) -> None:
    s = gpu.stream("other")
    hold = gpu.latch()
    t = gpu.tensor(torch.ones(4))
    gpu.kernel(s, lambda: None, hold=hold, uses=[t])
    del t
    gc.collect()
    assert len(gpu.errors) == 1 and "record_stream(other)" in gpu.errors[0]
    gpu.errors.clear()
    u = gpu.tensor(torch.ones(4))
    gpu.kernel(s, lambda: None, hold=hold, uses=[u])
    u.record_stream(s)  # covered: the allocator would defer the reuse
    del u
    gc.collect()
    assert gpu.errors == []
    hold.open()


# ===================================================================== streams
def test_event_pool_with_a_factory_reuses_events(gpu: SimGPU) -> None:
    pool = streams.EventPool(0, factory=gpu.event)
    a = pool.acquire()
    pool.release(a)
    assert pool.acquire() is a and pool.created == 1
    with pytest.raises(ValueError):
        streams.EventPool("cuda:0", factory=gpu.event)


def test_event_watcher_runs_callbacks_in_order_after_completion(gpu: SimGPU) -> None:
    w = streams.EventWatcher("sim", mode="poll")
    s1, s2 = gpu.stream(), gpu.stream()
    hold = gpu.latch()
    gpu.kernel(s1, lambda: None, hold=hold)
    e1, e2 = gpu.event(), gpu.event()
    e1.record(s1)
    e2.record(s2)  # completes first, but is reported after e1
    seen: list[str] = []
    done = threading.Event()
    w.watch(e1, seen.append, "e1")
    w.watch(e2, lambda x: (seen.append(x), done.set()), "e2")
    gpu.idle()
    assert seen == [] and e2.query()
    hold.open()
    assert done.wait(10)
    assert seen == ["e1", "e2"]
    w.close()


def test_wait_event_awaits_a_simulated_event(gpu: SimGPU) -> None:
    s = gpu.stream()
    hold = gpu.latch()
    gpu.kernel(s, lambda: None, hold=hold)
    ev = gpu.event()
    ev.record(s)

    async def main() -> bool:
        watcher = streams.EventWatcher("sim2")
        task = asyncio.ensure_future(streams.wait_event(ev, watcher=watcher))
        await asyncio.sleep(0.05)
        early = task.done()
        hold.open()
        await asyncio.wait_for(task, 10)
        watcher.close()
        return early

    assert asyncio.run(main()) is False


# ===================================================== nccl4py autospec strictness
def test_sim_communicator_has_exactly_nccl4pys_interface() -> None:
    with SimCluster() as sim:
        bes = sim.backends(1)
        comm = bes[0]._comm
        assert isinstance(comm, nc.Communicator)  # autospec passes isinstance checks
        t = sim.gpu.tensor([1.0])
        with pytest.raises(AttributeError):
            comm.all_reduce(t, t, nc.NcclRedOp.SUM)  # misspelled (nccl4py: allreduce)
        with pytest.raises(TypeError):
            comm.allreduce(t, t, nc.NcclRedOp.SUM, 0)  # stream is keyword-only
        with pytest.raises(TypeError):
            comm.broadcast(t, t, root=0, strm=1)  # unknown keyword
        with pytest.raises(TypeError):
            comm.reduce(t, t, 0, nc.NcclRedOp.SUM, stream=bes[0]._rt.comm_stream.cuda_stream)  # root/op swapped
        with pytest.raises(TypeError):
            sim.nccl.module.group_end(True)  # simulate is keyword-only
        with pytest.raises(AttributeError):
            sim.nccl.module.Communicator.init_rank  # noqa: B018 - not an nccl4py name
        bes[0].close()
        with pytest.raises(nc.NcclInvalid):
            comm.get_async_error()  # destroyed: nccl4py's null communicator


def test_sim_nccl_reports_real_result_codes_and_in_progress() -> None:
    from nccl.bindings.nccl import Result

    with SimCluster(inprogress_polls=3) as sim:
        lib = sim.lib()
        uid = lib.unique_id()
        c0 = lib.init(2, 0, uid)
        assert c0.get_async_error() is Result.InProgress  # rank 1 has not arrived
        c1 = lib.init(2, 1, uid)
        assert c0.get_async_error() is Result.Success and c1.get_async_error() is Result.Success
        rt = sim.runtime()
        t = sim.gpu.tensor([1.0])
        c0.allreduce(t, t, nc.NcclRedOp.SUM, stream=rt.comm_stream.cuda_stream)
        assert [c0.get_async_error() for _ in range(3)] == [Result.InProgress, Result.InProgress, Result.Success]
        c0.abort()
        c1.abort()
        assert sim.nccl.live() == []
