"""torch.distributed on a communicator: the process group's collectives, its c10d Works,
the ``"asynccoll"`` backend name, DDP on it, and the faults it reports."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import asynccoll as ac
from asynccoll.testing import crash_later, run_ranks
from tests.support import paths
from tests.support.backends import auto_on_one_host

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------ collectives
async def collectives(comm: ac.Communicator) -> dict[str, Any]:
    pg = ac.process_group(comm)
    r, n = comm.rank, comm.world_size
    out: dict[str, Any] = {"name": pg.name(), "rank": pg.rank(), "size": pg.size()}

    t = torch.full((8,), float(r + 1))
    dist.all_reduce(t, group=pg)
    out["all_reduce"] = t.tolist()

    t = torch.full((3,), float(r + 1))
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg, async_op=True)
    fut = work.get_future()
    assert work.wait() is True
    assert work.is_completed() and work.is_success() and work.exception() is None
    out["max"] = t.tolist()
    out["future"] = [x.tolist() for x in fut.wait()]
    assert work.result()[0] is t

    chunks = [torch.empty(2) for _ in range(n)]
    dist.all_gather(chunks, torch.full((2,), float(r)), group=pg)
    out["all_gather"] = [c.tolist() for c in chunks]

    flat = torch.empty(2 * n)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(r)), group=pg)
    out["all_gather_into_tensor"] = flat.tolist()

    got = torch.empty(2)
    dist.reduce_scatter(got, [torch.full((2,), float(i + r)) for i in range(n)], group=pg)
    out["reduce_scatter"] = got.tolist()

    got = torch.empty(2)
    dist.reduce_scatter_tensor(got, torch.arange(2.0 * n) + r, group=pg)
    out["reduce_scatter_tensor"] = got.tolist()

    t = torch.full((2,), float(r))
    dist.broadcast(t, group_src=1, group=pg)
    out["broadcast"] = t.tolist()

    t = torch.full((2,), float(r + 1))
    dist.reduce(t, group_dst=0, group=pg)
    out["reduce"] = t.tolist() if r == 0 else None

    into = [torch.empty(1) for _ in range(n)] if r == 0 else None
    dist.gather(torch.tensor([float(r * 10)]), into, group_dst=0, group=pg)
    out["gather"] = [x.item() for x in into] if into is not None else None

    t = torch.empty(1)
    dist.scatter(
        t,
        [torch.tensor([float(i * 7)]) for i in range(n)] if r == 1 else None,
        group_src=1,
        group=pg,
    )
    out["scatter"] = t.item()

    t = torch.empty(n)
    dist.all_to_all_single(t, torch.arange(float(n)) + 10 * r, group=pg)
    out["all_to_all_single"] = t.tolist()

    outs = [torch.empty(1) for _ in range(n)]
    dist.all_to_all(outs, [torch.tensor([float(10 * r + i)]) for i in range(n)], group=pg)
    out["all_to_all"] = [x.item() for x in outs]

    t = torch.tensor([float(r)])
    if r == 0:
        dist.send(torch.tensor([42.0]), group_dst=1, group=pg)
    elif r == 1:
        pg.recv(
            [t], 0, 0
        ).wait()  # dist.recv returns the sender's global rank: the group is not torch's world
    out["p2p"] = t.item()

    dist.barrier(group=pg)

    outs = [[torch.empty(1), torch.empty(2)] for _ in range(n)]  # [rank][input]
    dist.all_gather_coalesced(
        outs, [torch.tensor([float(r)]), torch.full((2,), 10.0 + r)], group=pg
    )
    out["all_gather_coalesced"] = [[t.tolist() for t in o] for o in outs]

    # One issue order: an op issued through the group takes the next seq after the
    # communicator's own awaitable call, and both show in its flight record.
    own = comm.all_reduce(torch.ones(1))
    t = torch.ones(4)
    work = dist.all_reduce(t, group=pg, async_op=True)
    await own
    work.wait()
    record = comm.flight_record()
    out["last_two"] = [(e["op"], e["shape"], e["state"]) for e in record[-2:]]
    out["seq_follows"] = record[-1]["seq"] == own.seq + 1
    return out


def test_collectives_through_the_process_group() -> None:
    res = run_ranks(collectives, world_size=2, timeout=60)
    for r, got in enumerate(res):
        assert got["name"] == "asynccoll" and got["rank"] == r and got["size"] == 2
        assert got["all_reduce"] == [3.0] * 8
        assert got["max"] == [2.0] * 3 and got["future"] == [[2.0] * 3]
        assert got["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert got["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        # input chunk i on rank q holds i + q: chunk r summed is 2r + 1
        assert got["reduce_scatter"] == [2.0 * r + 1] * 2
        assert got["reduce_scatter_tensor"] == [4.0 * r + 1, 4.0 * r + 3]
        assert got["broadcast"] == [1.0, 1.0]
        assert got["scatter"] == 7.0 * r
        assert got["all_to_all_single"] == [float(r), 10.0 + r]
        assert got["all_to_all"] == [float(r), 10.0 + r]
        assert got["last_two"] == [("all_reduce", [1], "done"), ("all_reduce", [4], "done")]
        assert got["seq_follows"]
        assert got["all_gather_coalesced"] == [[[0.0], [10.0, 10.0]], [[1.0], [11.0, 11.0]]]
    assert res[0]["reduce"] == [3.0, 3.0] and res[0]["gather"] == [0.0, 10.0]
    assert res[1]["p2p"] == 42.0


# ------------------------------------------------------------------- DDP
def batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(16, 12, generator=gen), torch.randn(16, 3, generator=gen))
        for _ in range(steps)
    ]


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3)
    )


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


async def ddp_equal(ctx: Any, in_thread: bool) -> list[bool]:
    """DDP on the asynccoll group and DDP on torch's own Gloo group, same start, same data:
    the parameters after each step, compared bit for bit."""
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("torch/", ctx.store),
        rank=ctx.rank,
        world_size=ctx.world_size,
    )
    comm = await ac.init(
        "gloo", rank=ctx.rank, world_size=ctx.world_size, store=dist.PrefixStore("ac/", ctx.store)
    )
    try:
        ours_module, theirs_module = net(), net()
        # bucket_cap_mb small: several buckets, so several ops in flight during backward
        ours = DDP(ours_module, process_group=ac.process_group(comm), bucket_cap_mb=0.001)
        theirs = DDP(theirs_module, bucket_cap_mb=0.001)
        opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
        opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.1)
        same = []
        for x, y in batches(ctx.rank, 4):
            if in_thread:  # backward off the loop thread
                await asyncio.to_thread(step, ours, opt_ours, x, y)
            else:  # backward on the loop thread: the futures must not need the loop
                step(ours, opt_ours, x, y)
            step(theirs, opt_theirs, x, y)
            same.append(
                all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
            )
        moved = not torch.equal(next(ours.parameters()), next(net().parameters()))
        assert moved, "the parameters did not move: the comparison is vacuous"
        assert comm.flight_record()[-1]["op"] == "all_reduce"
        return same
    finally:
        await comm.close()
        dist.destroy_process_group()


@pytest.mark.parametrize("in_thread", [False, True], ids=["loop_thread", "worker_thread"])
def test_ddp_on_the_group_is_bit_equal_to_ddp_on_gloo(in_thread: bool) -> None:
    res = run_ranks(ddp_equal, world_size=2, backend=None, timeout=90, args=(in_thread,))
    assert res == [[True] * 4, [True] * 4]


async def backend_name(ctx: Any) -> dict[str, Any]:
    """``dist.init_process_group("asynccoll")``: the default group runs on a communicator;
    DDP on it equals DDP on a Gloo group of the same ranks."""
    dist.init_process_group("asynccoll", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size)
    try:
        world = dist.group.WORLD
        assert world is not None
        gloo = dist.new_group(backend="gloo")
        t = torch.full((4,), float(ctx.rank + 1))
        dist.all_reduce(t)  # the default group
        dist.broadcast(t, src=1)  # global ranks work on torch's own world
        ours = DDP(net())
        theirs = DDP(net(), process_group=gloo)
        opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
        opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.1)
        for x, y in batches(ctx.rank, 3):
            step(ours, opt_ours, x, y)
            step(theirs, opt_theirs, x, y)
        same = all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
        comm = world.comm  # type: ignore[attr-defined]
        return {
            "backend": dist.get_backend(),
            "sum": t.tolist(),
            "same": same,
            "comm_ops": len(comm.flight_record()),
            "comm_backend": comm.backend,
        }
    finally:
        dist.destroy_process_group()


@auto_on_one_host(2)
def test_init_process_group_with_the_backend_name() -> None:
    res = run_ranks(backend_name, world_size=2, backend=None, timeout=90)
    for got in res:
        assert got["backend"] == "asynccoll" and got["comm_backend"] == "auto"
        assert got["sum"] == [3.0] * 4 and got["same"]
        assert got["comm_ops"] > 6  # the all_reduce, the broadcast, DDP's syncs and buckets


# ----------------------------------------------------------------- faults
async def kill_and_shrink(comm: ac.Communicator, fatal: int) -> dict[str, Any] | None:
    """Rank 2 dies in DDP step ``fatal``; the survivors' step raises PeerFailure naming it,
    they shrink, rebuild DDP on the new group and train on.

    Step 1 (the second) syncs in the forward pass (DDP rebuilds its buckets after the
    first step: a broadcast it waits for); from step 2 on, only the backward's bucket
    all-reduces communicate, and their failure reaches the caller through the futures
    that DDP's reducer waits for."""
    module = net()
    model = DDP(module, process_group=ac.process_group(comm), bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(comm.rank, fatal + 4)
    for x, y in data[:fatal]:
        step(model, opt, x, y)
    if comm.rank == 2:
        crash_later(0.2)
        time.sleep(5)  # dies in this step, before its backward
    start = time.monotonic()
    ranks: tuple[int, ...] | None = None
    try:
        step(model, opt, *data[fatal])
    except ac.PeerFailure as exc:
        assert isinstance(exc, dist.DistBackendError)
        ranks = exc.ranks
    elapsed = time.monotonic() - start
    assert ranks is not None, "the step did not fail"
    # The recipe: drop the old DDP (its reducer's hooks stay on the parameters while it
    # lives; an exception kept alive keeps it too), shrink, rebuild on the new group.
    del model, opt
    gc.collect()
    new = await comm.shrink()
    try:
        model = DDP(module, process_group=ac.process_group(new))  # syncs from the new rank 0
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in data[fatal + 1 :]:
            step(model, opt, x, y)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        high, low = flat.clone(), flat.clone()
        await new.all_reduce(high, ac.ReduceOp.MAX)
        await new.all_reduce(low, ac.ReduceOp.MIN)
        return {
            "ranks": ranks,
            "elapsed": elapsed,
            "new_size": new.world_size,
            "equal": torch.equal(high, low),
        }
    finally:
        await new.close()


@pytest.mark.parametrize("fatal", [1, 2], ids=["in_forward_sync", "in_backward"])
def test_peer_killed_during_a_ddp_step_then_shrink_and_train_on(fatal: int) -> None:
    res = run_ranks(kill_and_shrink, world_size=3, timeout=90, lost=[2], args=(fatal,))
    for got in res[:2]:
        assert got is not None
        assert got["ranks"] == (2,)
        assert got["elapsed"] < 10.0, got  # the liveness bound, not torch's 30 minutes
        assert got["new_size"] == 2 and got["equal"]
    assert res[2] is None


async def refused_at_issue(comm: ac.Communicator) -> bool | None:
    """Rank 1 dies between two DDP steps; rank 0's next step issues after Gloo saw the
    connection close, so the bucket's all_reduce is refused at issue, on this thread."""
    module = net()
    model = DDP(module, process_group=ac.process_group(comm))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batches(comm.rank, 1)[0]
    step(model, opt, x, y)
    if comm.rank == 1:
        crash_later(0.0)
        time.sleep(5)
    time.sleep(1.0)  # no heartbeat (Gloo's default): only the transport knows
    try:
        step(model, opt, x, y)
    except ac.PeerFailure:
        pass
    alive = weakref.ref(model)
    del model, opt
    gc.collect()
    return alive() is None


@pytest.mark.timeout(120)
def test_an_op_refused_at_issue_keeps_no_frame_of_the_step_alive() -> None:
    """The failed op's error (held by the aborted communicator) must not hold the
    caller's frames: they hold the DDP, whose hooks would fire beside a rebuilt one's
    ("marked as ready twice", seen in the shrink example)."""
    res = run_ranks(refused_at_issue, world_size=2, timeout=90, lost=[1])
    assert res[0] is True  # the old DDP was collected
    assert res[1] is None


# ------------------------------------------- deadlines, abort, fingerprints
async def contract(ctx: Any, case: str) -> dict[str, Any]:
    comm = await ac.init(
        "gloo",
        rank=ctx.rank,
        world_size=ctx.world_size,
        store=ctx.store,
        timeout=2.0,
        check="fingerprint" if case == "mismatch" else None,
    )
    pg = ac.process_group(comm)
    try:
        start = time.monotonic()
        if case == "mismatch":  # rank 1 reduces a different shape: both ranks are told
            with pytest.raises(ac.CollectiveMismatch) as caught:
                dist.all_reduce(torch.ones(4 + ctx.rank), group=pg)
            assert isinstance(caught.value, dist.DistBackendError)
            return {"fields": caught.value.fields, "state": comm.state}
        if ctx.rank == 1:  # never joins
            await asyncio.sleep(4.0)
            return {}
        work = dist.all_reduce(torch.ones(4), group=pg, async_op=True)
        assert not work.is_completed() and work.exception() is None
        if case == "abort":
            threading.Timer(0.3, pg.abort).start()
            with pytest.raises(ac.CommAborted) as aborted:
                work.wait()
            error: BaseException = aborted.value
        else:  # the communicator's deadline (2 s), not c10d's 30 minutes
            with pytest.raises(ac.CollectiveTimeout) as timed_out:
                work.wait()
            error = timed_out.value
        assert isinstance(error, dist.DistBackendError)
        assert work.is_completed() and not work.is_success()
        assert isinstance(work.exception(), type(error))
        with pytest.raises(RuntimeError, match=type(error).__name__):
            work.get_future().wait()  # a failed future (torch keeps the text)
        record = comm.flight_record()[-1]
        return {
            "elapsed": time.monotonic() - start,
            "record": (record["op"], record["state"]),
            "state": comm.state,
        }
    finally:
        comm.abort()
        await comm.close()


@pytest.mark.parametrize("case", ["deadline", "abort", "mismatch"])
def test_deadline_abort_and_fingerprint_apply_to_the_group(case: str) -> None:
    res = run_ranks(contract, world_size=2, backend=None, timeout=60, args=(case,))
    if case == "mismatch":
        assert res[0]["fields"] == res[1]["fields"] == ("shape",)
        return
    got = res[0]
    assert got["state"] == "aborted"
    if case == "deadline":
        assert 1.5 < got["elapsed"] < 6.0 and got["record"] == ("all_reduce", "timed out")
    else:
        assert got["elapsed"] < 2.0 and got["record"] == ("all_reduce", "aborted")


# ------------------------------------------------------------------ FSDP2
def fsdp_steps(group: Any, rank: int) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    model = net()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches(rank, 3):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    # Each rank's shards (DTensor's full_tensor() runs torch's functional collectives,
    # which need a C++ backend: see docs/guides/torch.md).
    shards = [p.to_local().detach() for p in model.parameters()]  # type: ignore[attr-defined]
    return losses + shards


async def fsdp_equal(ctx: Any) -> list[bool]:
    """FSDP2 (``fully_shard``) on a CPU DeviceMesh of the asynccoll group and of a Gloo
    group of the same ranks: the losses and the parameter shards, bit for bit."""
    dist.init_process_group("asynccoll", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size)
    try:
        world = dist.group.WORLD
        ours = fsdp_steps(world, ctx.rank)
        theirs = fsdp_steps(dist.new_group(backend="gloo"), ctx.rank)
        comm = world.comm  # type: ignore[union-attr]
        ops = {e["op"] for e in comm.flight_record()}
        assert {"all_gather", "reduce_scatter"} <= ops, ops
        assert not torch.equal(ours[0], ours[2]), "the loss did not move: a vacuous comparison"
        return [torch.equal(a, b) for a, b in zip(ours, theirs)]
    finally:
        dist.destroy_process_group()


@auto_on_one_host(2)
def test_fsdp2_on_the_group_equals_fsdp2_on_gloo() -> None:
    res = run_ranks(fsdp_equal, world_size=2, backend=None, timeout=90)
    assert res[0] == res[1] == [True] * 9  # 3 losses, 6 parameters


# ---------------------------------------------------------------- example
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ddp_shrink_example_runs_under_the_launch_recipe() -> None:
    """examples/ddp_shrink.py: an external store and one torchrun per rank; rank 2 dies,
    the survivors shrink, rebuild DDP and finish with equal parameters."""
    root = paths.ROOT
    proc = subprocess.Popen(
        [sys.executable, str(root / "examples" / "ddp_shrink.py")],
        cwd=root,
        # This checkout first, in every process (torchrun's workers run the script from
        # examples/, where the installed asynccoll would come first).
        env=paths.child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=200)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of the example may outlive it
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out
    assert "PeerFailure naming rank(s) [2]" in out, out
    assert "survivors finished 20 steps on 2 ranks" in out, out
    assert "parameters equal across survivors: True" in out, out
