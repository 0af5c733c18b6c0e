"""Tests of ``asynccoll.testing``: run_ranks, its pool of worker processes, and fault injection.

The rank functions are module-level so worker processes can import them by name.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist

import asynccoll as ac
from asynccoll.testing import (
    RankContext,
    RankPool,
    RanksTimedOut,
    RemoteTraceback,
    crash,
    crash_later,
    freeze,
    run_ranks,
    skip_collective,
)
from tests.support.paths import ROOT


def _gone(pid: int, within: float = 5.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if not psutil.pid_exists(pid):
            return True
        time.sleep(0.05)
    return not psutil.pid_exists(pid)


@pytest.fixture
def pool():
    with RankPool(2) as p:
        yield p
    for pid in p.pids:
        assert _gone(pid)


# --------------------------------------------------------------- rank functions
async def _sum_of_ranks(comm: Any, scale: float) -> tuple[int, int, float]:
    t = torch.tensor([float(comm.rank + 1)])
    await comm.all_reduce(t)
    return comm.rank, comm.world_size, t.item() * scale


async def _loop_module(comm: Any) -> str:
    return type(asyncio.get_running_loop()).__module__


async def _context(ctx: RankContext) -> tuple[Any, ...]:
    fresh = not ctx.store.check(["shared"])
    if ctx.rank == 0:
        ctx.store.set("shared", "from-0")
    seen = ctx.store.get("shared").decode()
    return (
        ctx.rank,
        ctx.world_size,
        ctx.master_addr,
        ctx.timeout,
        isinstance(ctx.store, dist.PrefixStore),
        fresh,
        seen,
    )


async def _own_communicator(ctx: RankContext) -> float:
    async with ac.init(
        "gloo", rank=ctx.rank, world_size=ctx.world_size, store=ctx.store, timeout=20
    ) as comm:
        t = torch.tensor([10.0 * (ctx.rank + 1)])
        await comm.all_reduce(t)
        return t.item()


async def _pid(comm: Any) -> int:
    return os.getpid()


async def _raise_on_rank1(comm: Any) -> int:
    if comm.rank == 1:
        raise KeyError("bad rank one")
    return comm.rank


async def _raise_on_every_rank(ctx: RankContext) -> None:
    raise ValueError(f"failure number {ctx.rank}")


async def _timed_out_on_rank1(ctx: RankContext) -> None:
    if ctx.rank == 1:
        raise ac.CollectiveTimeout(
            "all_reduce (seq 3) on rank 1 did not complete within its deadline", 3, "all_reduce"
        )
    cause = ac.CollectiveTimeout(
        "all_reduce (seq 3) on rank 1 did not complete within its deadline", 3, "all_reduce"
    )
    raise ac.CommAborted("aborted by rank 1") from cause


class _NeedsTwoArgs(Exception):
    def __init__(self, a: str, b: str) -> None:
        super().__init__(a)


async def _raise_unpicklable(ctx: RankContext) -> None:
    if ctx.rank == 0:
        raise _NeedsTwoArgs("odd exception", "b")


async def _unpicklable_result(ctx: RankContext) -> Any:
    return (lambda: None) if ctx.rank == 1 else 0


async def _sleep_forever_on_rank1(ctx: RankContext) -> int:
    if ctx.rank == 1:
        await asyncio.sleep(3600)
    return ctx.rank


async def _freeze_rank1(ctx: RankContext) -> int:
    if ctx.rank == 1:
        freeze()
        await asyncio.sleep(3600)
    return ctx.rank


async def _crash_rank1(ctx: RankContext, how: str) -> int:
    if ctx.rank == 1:
        crash(how, code=3)
    return ctx.rank


async def _lost_rank_returns(ctx: RankContext) -> int:
    if ctx.rank == 1:
        ctx.store.set("done", "1")
        return 11
    ctx.store.wait(["done"])
    await asyncio.sleep(0.3)
    return 10


async def _killed_mid_collective(comm: Any) -> Any:
    if comm.rank == 1:
        crash_later(0.3)
        await asyncio.sleep(3600)
    start = time.monotonic()
    try:
        await comm.all_reduce(torch.ones(4), timeout=20)
    except ac.AsyncCollError as exc:
        return type(exc).__name__, time.monotonic() - start
    return "completed", time.monotonic() - start


async def _skip_one(comm: Any) -> Any:
    if comm.rank == 0:
        t = torch.tensor([1.0])
        await comm.all_reduce(t)
        return t.item()
    skip_collective(comm, n=1)
    skipped = torch.tensor([10.0])
    await comm.all_reduce(skipped)  # settled locally; rank 0 never sees it
    real = torch.tensor([2.0])
    await comm.all_reduce(real)  # pairs with rank 0's only all_reduce
    return skipped.item(), real.item()


async def _abort_and_return(comm: Any) -> int:
    comm.abort("test")
    return comm.rank


# ----------------------------------------------------------------------- tests
def test_results_by_rank_with_args():
    assert run_ranks(_sum_of_ranks, args=(2.0,)) == [(0, 2, 6.0), (1, 2, 6.0)]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_event_loop_choice(loop):
    modules = run_ranks(_loop_module, loop=loop)
    assert len(modules) == 2
    assert all(m.split(".")[0] == loop for m in modules), modules


def test_backend_none_gives_a_context_with_a_fresh_store():
    for _ in range(2):  # the second run must not see the first run's keys
        results = run_ranks(_context, backend=None, timeout=30)
        assert [r[:5] + r[6:] for r in results] == [
            (r, 2, "127.0.0.1", 30.0, True, "from-0") for r in range(2)
        ]
        assert results[0][5] is True  # rank 0 looks before it sets: a fresh store each run
    assert run_ranks(_own_communicator, backend=None) == [30.0, 30.0]


def test_remote_exception_reraised_with_rank_and_traceback():
    with pytest.raises(KeyError) as info:
        run_ranks(_raise_on_rank1)
    exc = info.value
    assert exc.rank == 1
    cause = exc.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "_raise_on_rank1" in cause.text and "rank 1" in cause.text
    assert "bad rank one" in cause.text


def test_several_failures_lowest_rank_wins_and_others_are_listed():
    with pytest.raises(ValueError, match="failure number 0") as info:
        run_ranks(_raise_on_every_rank, backend=None)
    assert info.value.rank == 0
    assert "rank 1: ValueError: failure number 1" in info.value.__cause__.text


def test_the_rank_whose_own_op_failed_wins_over_the_news_of_its_abort():
    """A CollectiveTimeout is a CommAborted too, but it is the rank's own failure: it is
    the one re-raised, not the lower rank's CommAborted that only reports the abort."""
    with pytest.raises(ac.CollectiveTimeout) as info:
        run_ranks(_timed_out_on_rank1, backend=None)
    assert info.value.rank == 1 and info.value.seq == 3
    assert "rank 0: CommAborted: aborted by rank 1" in info.value.__cause__.text


def test_exception_that_does_not_unpickle_becomes_runtime_error():
    with pytest.raises(RuntimeError, match="_NeedsTwoArgs: odd exception") as info:
        run_ranks(_raise_unpicklable, backend=None)
    assert "_raise_unpicklable" in info.value.__cause__.text


def test_unpicklable_result_is_an_error():
    with pytest.raises(TypeError, match="rank 1 returned a value that cannot be pickled"):
        run_ranks(_unpicklable_result, backend=None)


def test_stuck_rank_times_out_with_its_stack_and_is_killed(pool, capfd):
    stuck_pid = pool.pids[1]
    start = time.monotonic()
    with pytest.raises(RanksTimedOut) as info:
        run_ranks(_sleep_forever_on_rank1, backend=None, timeout=2, pool=pool)
    assert time.monotonic() - start < 2 + 5
    assert info.value.ranks == (1,)
    assert "_sleep_forever_on_rank1" in str(info.value)
    assert "Thread" in info.value.stacks[1]  # faulthandler's dump of every thread
    assert "_sleep_forever_on_rank1" in capfd.readouterr().err
    assert _gone(stuck_pid)
    assert stuck_pid not in pool.pids
    assert run_ranks(_pid, pool=pool) == pool.pids  # the pool works again


def test_frozen_rank_times_out(pool):
    frozen_pid = pool.pids[1]
    start = time.monotonic()
    with pytest.raises(RanksTimedOut) as info:
        run_ranks(_freeze_rank1, backend=None, timeout=2, pool=pool)
    assert time.monotonic() - start < 2 + 5
    assert info.value.ranks == (1,)
    assert "_freeze_rank1" in str(info.value)
    assert _gone(frozen_pid)


def test_workers_reused_then_replaced_after_failure(pool):
    first = run_ranks(_pid, pool=pool)
    assert first == pool.pids
    assert run_ranks(_pid, pool=pool) == first  # same processes
    with pytest.raises(KeyError):
        run_ranks(_raise_on_rank1, pool=pool)
    assert all(_gone(pid) for pid in first)  # rank 0 succeeded, yet it was replaced too
    second = run_ranks(_pid, pool=pool)
    assert second == pool.pids and not set(second) & set(first)


def test_aborted_communicator_replaces_workers(pool):
    before = pool.pids
    assert run_ranks(_abort_and_return, pool=pool) == [0, 1]
    assert not set(pool.pids) & set(before)


@pytest.mark.parametrize(
    "how, says", [("exit", "exited with code 3"), ("sigkill", "SIGKILL"), ("sigterm", "SIGTERM")]
)
def test_unexpected_death_is_reported(pool, how, says):
    with pytest.raises(RuntimeError, match="rank 1") as info:
        run_ranks(_crash_rank1, backend=None, args=(how,), pool=pool)
    assert says in str(info.value)


def test_lost_rank_frozen_returns_early_and_is_cleaned_up(pool):
    frozen_pid = pool.pids[1]
    start = time.monotonic()
    assert run_ranks(_freeze_rank1, backend=None, lost=(1,), timeout=30, pool=pool) == [0, None]
    assert time.monotonic() - start < 10
    assert _gone(frozen_pid)


def test_lost_rank_that_crashes_or_returns(pool):
    assert run_ranks(_crash_rank1, backend=None, args=("exit",), lost=(1,), pool=pool) == [0, None]
    assert run_ranks(_lost_rank_returns, backend=None, lost=(1,), pool=pool) == [10, 11]


def test_crash_later_kills_a_rank_mid_collective(pool):
    victim = pool.pids[1]
    results = run_ranks(_killed_mid_collective, lost=(1,), timeout=40, pool=pool)
    assert results[1] is None
    name, elapsed = results[0]
    assert name in ("PeerFailure", "CommAborted"), results
    assert elapsed < 10
    assert _gone(victim)


def test_skip_collective_skips_exactly_n_ops():
    assert run_ranks(_skip_one) == [3.0, (10.0, 3.0)]


def test_invalid_arguments_are_refused_in_the_caller():
    def nested_fn(comm):  # not async
        return 1

    async def local_async(comm):
        return 1

    with pytest.raises(TypeError, match="async def"):
        run_ranks(nested_fn)
    with pytest.raises(TypeError, match="picklable"):
        run_ranks(local_async)
    with pytest.raises(ValueError, match="loop"):
        run_ranks(_pid, loop="curio")
    with pytest.raises(ValueError, match="lost rank"):
        run_ranks(_pid, lost=(5,))


def test_close_leaves_no_process():
    with RankPool(2) as p:
        pids = run_ranks(_pid, pool=p)
        assert pids == p.pids
    assert p.closed
    assert all(_gone(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        run_ranks(_pid, pool=p)
    forgotten = RankPool(2)
    pids = forgotten.pids
    del forgotten
    gc.collect()
    assert all(_gone(pid) for pid in pids)  # a pool nobody closed stops its workers when collected


_ORPHAN = textwrap.dedent(
    """
    import multiprocessing.forkserver, os, signal, sys
    sys.path[:0] = [{root!r}]
    multiprocessing.forkserver.set_forkserver_preload(["asynccoll.testing._worker", "asynccoll"])
    multiprocessing.forkserver.ensure_running()  # imports torch while this process does too
    from asynccoll.testing import run_ranks
    from {module} import _pid
    print(" ".join(map(str, run_ranks(_pid))), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_workers_exit_when_their_parent_is_killed():
    """A parent killed without cleanup (no atexit): its workers notice and exit."""
    code = _ORPHAN.format(root=str(ROOT), module=__name__)
    proc = subprocess.run(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, timeout=90
    )
    assert proc.returncode == -9
    pids = [int(x) for x in proc.stdout.split()]
    assert len(pids) == 2, proc.stdout
    assert all(_gone(pid, within=10) for pid in pids)
