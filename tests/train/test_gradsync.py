"""GradSync (API.md §9) against torch DDP, in the same rank processes, on Gloo.

Each rank builds a torch.distributed group (``init_process_group`` on its own store
prefix, destroyed at the end: the test kit reuses worker processes) and an
asynccoll communicator, trains one copy of a model with DDP and an identical copy
with GradSync on the same batches, and checks that the parameters agree after
every step (to float32 rounding: at world size 3 the buckets differ from DDP's, so
Gloo may sum in another order).
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import copy
import dataclasses
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import asynccoll as ac
from asynccoll.testing import run_ranks
from tests.support.backends import LOOPS

IN, HID, OUT, BATCH = 8, 16, 4, 6


@dataclasses.dataclass(frozen=True)
class Case:
    """One training scenario, run by DDP and by GradSync."""

    steps: int = 4
    uneven: int = 0  # rank r gets steps + uneven * r batches, inside join()
    accumulate: int = 1  # micro-batches per step (all but the last under no_sync)
    unused: bool = False  # a branch used on some ranks/steps only, and one never used
    thread: bool = False  # backward in a worker thread
    bucket_mb: float = 0.0005  # small: several buckets even for this model
    zero_grad_none: bool = True
    grad_views: bool = True
    step_in_wait: bool = False  # ``await sync.wait(opt)``: the optimizer stepped bucket by bucket
    adam: bool = False  # AdamW instead of SGD with momentum


class Net(torch.nn.Module):
    def __init__(self, unused: bool) -> None:
        super().__init__()
        self.a = torch.nn.Linear(IN, HID)
        self.b = torch.nn.Linear(HID, HID)
        self.extra = torch.nn.Linear(HID, HID)  # used only where ``use_extra``
        if unused:
            self.never = torch.nn.Linear(HID, HID)  # never used: its grad stays None
        self.c = torch.nn.Linear(HID, OUT)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = torch.relu(self.b(h))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.c(h)


def batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def use_extra(case: Case, rank: int, step: int) -> bool:
    return not case.unused or (rank + step) % 2 == 0


def n_steps(case: Case, rank: int) -> int:
    return case.steps + case.uneven * rank


@contextlib.asynccontextmanager
async def groups(ctx: Any) -> Any:
    """A torch.distributed default group and an asynccoll communicator on this run's store."""
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("torch/", ctx.store),
        rank=ctx.rank,
        world_size=ctx.world_size,
    )
    try:
        comm = await ac.init(
            "gloo",
            rank=ctx.rank,
            world_size=ctx.world_size,
            store=dist.PrefixStore("ac/", ctx.store),
        )
        try:
            yield comm
        finally:
            await comm.close()
    finally:
        dist.destroy_process_group()


def optimizer(case: Case, params: Any) -> torch.optim.Optimizer:
    if case.adam:
        return torch.optim.AdamW(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train_ddp(model: Net, case: Case, rank: int) -> list[list[torch.Tensor]]:
    ddp = DDP(model, find_unused_parameters=case.unused)
    opt = optimizer(case, ddp.parameters())
    snapshots = []
    with ddp.join() if case.uneven else contextlib.nullcontext():
        for step in range(n_steps(case, rank)):
            for micro in range(case.accumulate):
                x, y = batch(rank, step, micro)
                last = micro == case.accumulate - 1
                with contextlib.nullcontext() if last else ddp.no_sync():
                    out = ddp(x, use_extra(case, rank, step))
                    torch.nn.functional.mse_loss(out, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=case.zero_grad_none)
            snapshots.append([p.detach().clone() for p in model.parameters()])
    snapshots.append([p.detach().clone() for p in model.parameters()])
    return snapshots


async def train_gradsync(comm: ac.Communicator, model: Net, case: Case) -> list[list[torch.Tensor]]:
    sync = ac.GradSync(comm, model, bucket_mb=case.bucket_mb, grad_views=case.grad_views)
    assert len(sync.bucket_sizes) > 1
    opt = optimizer(case, model.parameters())
    snapshots = []
    try:
        joined = sync.join() if case.uneven else contextlib.nullcontext()
        async with joined:
            for step in range(n_steps(case, comm.rank)):
                for micro in range(case.accumulate):
                    x, y = batch(comm.rank, step, micro)
                    last = micro == case.accumulate - 1
                    with contextlib.nullcontext() if last else sync.no_sync():
                        loss = torch.nn.functional.mse_loss(
                            model(x, use_extra(case, comm.rank, step)), y
                        )
                        if case.thread:
                            await anyio.to_thread.run_sync(loss.backward)
                        else:
                            loss.backward()
                if case.step_in_wait:
                    await sync.wait(opt)
                else:
                    await sync.wait()
                    opt.step()
                opt.zero_grad(set_to_none=case.zero_grad_none)
                snapshots.append([p.detach().clone() for p in model.parameters()])
        snapshots.append([p.detach().clone() for p in model.parameters()])
        if case.uneven:
            assert joined.authoritative_rank == comm.world_size - 1  # type: ignore[union-attr]
    finally:
        sync.close()
    return snapshots


async def compare_with_ddp(ctx: Any, case: Case) -> dict[str, Any]:
    async with groups(ctx) as comm:
        torch.manual_seed(0)
        ours = Net(case.unused)
        theirs = copy.deepcopy(ours)
        start = [p.detach().clone() for p in ours.parameters()]
        ref = train_ddp(theirs, case, ctx.rank)
        got = await train_gradsync(comm, ours, case)
        assert len(got) == len(ref), (len(got), len(ref))
        worst = 0.0
        for step, (a, b) in enumerate(zip(got, ref)):
            for i, (pa, pb) in enumerate(zip(a, b)):
                worst = max(worst, float((pa - pb).abs().max()))
                where = f"step {step} param {i}"
                torch.testing.assert_close(
                    pa, pb, rtol=1e-5, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}"
                )
        # The parameters moved (the comparison is not vacuous), and every rank ends equal.
        moved = float((got[-1][0] - start[0]).abs().max())
        assert moved > 1e-4, moved
        final = torch.cat([p.reshape(-1) for p in got[-1]])
        spread = final.clone()
        await comm.all_reduce(spread, ac.ReduceOp.MAX)
        low = final.clone()
        await comm.all_reduce(low, ac.ReduceOp.MIN)
        assert torch.equal(spread, low), "ranks ended with different parameters"
        never_none = ours.never.weight.grad is None if case.unused else None
        return {"worst": worst, "never_grad_none": never_none, "steps": len(got) - 1}


CASES = {
    "even": Case(),
    "uneven": Case(uneven=2),
    "no_sync": Case(accumulate=3),
    "unused": Case(unused=True),
    "thread": Case(thread=True),
    "uneven_thread_unused": Case(uneven=1, thread=True, unused=True, accumulate=2),
    "zero_grad_keep": Case(unused=True, zero_grad_none=False),
    "zero_grad_keep_no_views": Case(
        unused=True, zero_grad_none=False, grad_views=False, accumulate=2
    ),
    "no_views_uneven": Case(uneven=1, grad_views=False),
    "step_in_wait": Case(step_in_wait=True, unused=True),
    "step_in_wait_adamw_uneven": Case(step_in_wait=True, adam=True, uneven=1),
    "uneven_one_rank_empty": Case(steps=0, uneven=3, accumulate=2),
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_parameters_equal_ddp(name: str, world_size: int) -> None:
    case = CASES[name]
    results = run_ranks(
        compare_with_ddp, world_size=world_size, backend=None, timeout=90, args=(case,)
    )
    for r in results:
        assert r["worst"] < 1e-5
        if case.unused:
            assert r["never_grad_none"] or not case.zero_grad_none
    if world_size == 2:
        # 1/2 is exact and two addends commute: DDP's numbers bit for bit.
        assert all(r["worst"] == 0.0 for r in results), results


@pytest.mark.parametrize("thread", [False, True], ids=["loop-backward", "thread-backward"])
@pytest.mark.parametrize("loop", LOOPS)
def test_thread_and_loop_backward_under_each_loop(loop: str, thread: bool) -> None:
    case = Case(uneven=1, thread=thread, accumulate=2, unused=True)
    results = run_ranks(
        compare_with_ddp, world_size=2, backend=None, timeout=90, loop=loop, args=(case,)
    )
    assert [r["steps"] for r in results] == [4, 5]


# ------------------------------------------------------------------ behaviour
async def behaviour(comm: ac.Communicator) -> dict[str, Any]:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(3)]
    params = [p for layer in layers for p in layer.parameters()]
    sync = ac.GradSync(comm, params, bucket_mb=16 * 17 * 4 / 2**20, op=ac.ReduceOp.SUM)
    out: dict[str, Any] = {"buckets": len(sync.bucket_sizes)}

    def loss_of(x: torch.Tensor, skip_last: bool = False) -> torch.Tensor:
        h = torch.relu(layers[1](layers[0](x)))
        return (h if skip_last else layers[2](h)).square().sum()

    # Every bucket is issued during backward (all parameters used): nothing is left for wait().
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(comm.rank))
    local = torch.autograd.grad(loss_of(x), params)  # this rank's gradients (no hook fires)
    seq0 = comm.all_reduce(torch.zeros(1)).seq
    loss_of(x).backward()
    out["issued_in_backward"] = comm.all_reduce(torch.zeros(1)).seq - seq0 - 1
    await sync.wait()
    # SUM: the result is the sum of every rank's local gradient.
    for p, g in zip(params, local):
        total = g.clone()
        await comm.all_reduce(total)
        torch.testing.assert_close(p.grad, total)
    for p in params:
        p.grad = None

    # Buckets go in a fixed order (reverse parameter order): a parameter without gradient
    # (the last layer's: the first bucket) holds every bucket back until wait().
    seq0 = comm.all_reduce(torch.zeros(1)).seq
    loss_of(x, skip_last=True).backward()
    out["issued_without_last_layer"] = comm.all_reduce(torch.zeros(1)).seq - seq0 - 1
    await sync.wait()
    out["unused_grad_none"] = layers[2].weight.grad is None  # no rank used it: left untouched

    # Misuse is reported where it happens; the GradSync stays usable.
    loss_of(x).backward()
    with pytest.raises(ac.InvalidArgument):
        with sync.no_sync():
            pass
    try:
        loss_of(x).backward()
    except RuntimeError as exc:  # as torch DDP raises; typed: a GradSyncError (an InvalidArgument)
        out["twice"] = "twice" in str(exc) and isinstance(exc, ac.GradSyncError)
    with pytest.raises(ac.InvalidArgument, match="twice") as info:
        await sync.wait()
    assert isinstance(info.value, ac.GradSyncError) and isinstance(info.value, RuntimeError)
    with sync.no_sync():
        with pytest.raises(ac.InvalidArgument):
            await sync.wait()
    for p in params:
        p.grad = None
    loss_of(x).backward()
    await sync.wait()

    # wait(opt): every bucket's parameters stepped once, and the optimizer's other ones too.
    for p in params:
        p.grad = None
    extra = torch.nn.Parameter(torch.ones(3))
    extra.grad = torch.ones(3)
    opt = torch.optim.SGD([*params, extra], lr=0.5)
    before = [p.detach().clone() for p in params]
    loss_of(x).backward()
    await sync.wait(opt)
    for p, b in zip(params, before):
        torch.testing.assert_close(p.detach(), b - 0.5 * p.grad)
    out["extra_stepped"] = extra.detach().tolist() == [0.5, 0.5, 0.5]

    # close(): the hooks are gone, backward communicates nothing.
    sync.close()
    sync.close()
    seq0 = comm.all_reduce(torch.zeros(1)).seq
    loss_of(x).backward()
    out["issued_after_close"] = comm.all_reduce(torch.zeros(1)).seq - seq0 - 1
    with pytest.raises(ac.InvalidArgument):
        await sync.wait()
    with pytest.raises(ac.InvalidArgument):
        sync.join()
    return out


def test_buckets_issued_during_backward_misuse_and_close() -> None:
    for r in run_ranks(behaviour, world_size=2, timeout=60):
        assert r["buckets"] == 3
        assert r["issued_in_backward"] == 3
        assert r["issued_without_last_layer"] == 0
        assert r["unused_grad_none"] is True
        assert r["twice"] is True
        assert r["issued_after_close"] == 0
        assert r["extra_stepped"] is True


async def bad_arguments(comm: ac.Communicator) -> int:
    model = torch.nn.Linear(4, 4)
    checks = [
        lambda: ac.GradSync(comm, model, op=ac.ReduceOp.MAX),
        lambda: ac.GradSync(comm, model, bucket_mb=0),
        lambda: ac.GradSync(comm, model, bucket_mb=True),
        lambda: ac.GradSync(comm, []),
        lambda: ac.GradSync(comm, [torch.zeros(3)]),  # nothing requires grad
        lambda: ac.GradSync(comm, [model.weight * 2]),  # not a leaf
        lambda: ac.GradSync(comm, 42),
    ]
    for check in checks:
        with pytest.raises(ac.InvalidArgument):
            check()
    sync = ac.GradSync(comm, model)
    j = sync.join()
    async with j:
        with pytest.raises(ac.InvalidArgument):
            async with sync.join():
                pass
    with pytest.raises(ac.InvalidArgument):
        async with j:
            pass
    sync.close()
    await comm.barrier()  # the communicator is still usable
    return len(checks)


def test_bad_arguments_raise_invalid_argument() -> None:
    assert run_ranks(bad_arguments, world_size=2, timeout=60) == [7, 7]


async def sparse_gradient(comm: ac.Communicator) -> list[bool]:
    emb = torch.nn.Embedding(4, 2, sparse=True)
    sync = ac.GradSync(comm, emb)
    with pytest.raises(ac.GradSyncError, match="sparse") as info:
        emb(torch.tensor([1, 2])).sum().backward()  # raised by GradSync's hook, through autograd
    emb.weight.grad = None
    await sync.wait()  # the GradSync and the communicator stay usable
    sync.close()
    await comm.barrier()
    return [
        isinstance(info.value, t) for t in (ac.InvalidArgument, ac.AsyncCollError, RuntimeError)
    ]


def test_a_sparse_gradient_is_a_typed_error() -> None:
    assert run_ranks(sparse_gradient, world_size=2, timeout=60) == [[True, True, True]] * 2


def test_gradsync_raises_only_contract_errors() -> None:
    """Every error GradSync raises derives from AsyncCollError (``_base/errors.py``'s
    promise): no module of ``_train/`` builds a builtin exception."""
    train = Path(ac.__file__).parent / "_train"
    found = []
    for path in sorted(train.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                obj = getattr(builtins, node.func.id, None)
                if isinstance(obj, type) and issubclass(obj, BaseException):
                    found.append(f"{path.name}:{node.lineno} {node.func.id}")
    assert not found, found


async def gradient_memory(comm: ac.Communicator, grad_views: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net(unused=False)
    sync = ac.GradSync(comm, model, bucket_mb=0.0005, grad_views=grad_views)
    out: dict[str, Any] = {}
    for step in range(2):
        x, y = batch(comm.rank, step, 0)
        local = torch.autograd.grad(
            torch.nn.functional.mse_loss(model(x), y), list(model.parameters())
        )
        torch.nn.functional.mse_loss(model(x), y).backward()
        out["grads_between"] = [p.grad is not None for p in model.parameters()]
        if not grad_views:
            out["local_kept"] = all(
                torch.equal(p.grad, g) for p, g in zip(model.parameters(), local)
            )
        await sync.wait()
        out["grads_after"] = [p.grad is not None for p in model.parameters()]
        model.zero_grad()
    sync.close()
    return out


@pytest.mark.parametrize("grad_views", [True, False])
def test_backward_frees_each_gradient_once_it_is_in_its_bucket(grad_views: bool) -> None:
    """With grad_views, each gradient backward produced is dropped as soon as it is in
    its bucket (``.grad`` is None until ``wait()`` makes it the reduced view), so a
    step holds one or two gradients besides the buckets instead of all of them: the
    next parameter's gradient reuses the memory (kept to the end, a step's gradients
    were freed together and every step paged them in again). Without, ``.grad`` keeps
    the local gradient until ``wait()`` writes the reduced one into it."""
    for r in run_ranks(gradient_memory, world_size=2, timeout=60, args=(grad_views,)):
        assert all(r["grads_after"]), r
        if grad_views:  # .grad held the only reference to what backward allocated
            assert not any(r["grads_between"]), r
        else:
            assert all(r["grads_between"]) and r["local_kept"], r


# ------------------------------------------------------------------ bucket rebuild
class RegisteredBackwards(torch.nn.Module):
    """Layers registered in the reverse of their use: reverse registration order is wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.l3 = torch.nn.Linear(8, 8)
        self.l2 = torch.nn.Linear(8, 8)
        self.l1 = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


async def rebuild(comm: ac.Communicator) -> dict[str, Any]:
    torch.manual_seed(0)
    model = RegisteredBackwards()
    sync = ac.GradSync(comm, model, bucket_mb=1e-9)  # one parameter per bucket
    before = sync.bucket_order
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(comm.rank))
    for _ in range(3):
        model(x).square().sum().backward()
        await sync.wait()
    sync.close()
    return {"before": before, "after": sync.bucket_order}


def test_buckets_rebuilt_in_ready_order_after_first_step() -> None:
    results = run_ranks(rebuild, world_size=2, timeout=60)
    assert results[0] == results[1]
    # Parameters: l3.weight, l3.bias, l2.weight, l2.bias, l1.weight, l1.bias.
    assert results[0]["before"] == [[5], [4], [3], [2], [1], [0]]  # reverse registration: l1 first
    after = [b[0] for b in results[0]["after"]]
    assert sorted(after[:2]) == [0, 1] and sorted(after[2:4]) == [2, 3], (
        after
    )  # l3, then l2, then l1


# ------------------------------------------------------------------ faults
async def peer_dies_mid_training(comm: ac.Communicator, thread: bool) -> str:
    from asynccoll.testing import crash

    torch.manual_seed(0)
    model = Net(unused=False)
    sync = ac.GradSync(comm, model, bucket_mb=0.0005)
    with pytest.raises(ac.CommAborted):
        for step in range(100):
            if comm.rank == 1 and step == 3:
                crash("exit")
            x, y = batch(comm.rank, step, 0)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if thread:
                await anyio.to_thread.run_sync(
                    loss.backward
                )  # a hook may raise there: the comm is aborted
            else:
                loss.backward()
            await sync.wait()  # or here: PeerFailure
            model.zero_grad()
    # The GradSync fails fast afterwards too, and closes.
    model.zero_grad()
    with pytest.raises(ac.CommAborted):
        torch.nn.functional.mse_loss(model(x), y).backward()
        await sync.wait()
    sync.close()
    return comm.state


@pytest.mark.parametrize("thread", [False, True], ids=["loop-backward", "thread-backward"])
def test_peer_death_raises_instead_of_hanging(thread: bool) -> None:
    results = run_ranks(peer_dies_mid_training, world_size=2, timeout=60, args=(thread,), lost=(1,))
    assert results[0] == "aborted"


def test_bucket_assignment() -> None:
    from asynccoll._train.buckets import assign

    kib = [torch.zeros(256) for _ in range(8)]  # 1 KiB each (float32)
    # Growing limits: 1 KiB, then 2, 4, ... up to the cap (3 KiB here).
    assert assign(kib, list(range(8)), 1024, 3072) == [[0], [1, 2], [3, 4, 5], [6, 7]]
    # The walk follows ``order``; dtypes never share a bucket; buckets sorted by their first member.
    mixed = [
        torch.zeros(256),
        torch.zeros(512, dtype=torch.bfloat16),
        torch.zeros(256),
        torch.zeros(256),
    ]
    assert assign(mixed, [3, 2, 1, 0], 2048, 2048) == [[3, 2], [1], [0]]
    assert assign(mixed, [3, 2, 1, 0], 1 << 20, 1 << 20) == [[3, 2, 0], [1]]
