"""Which backends and loops the behavioural tests run on (one test body, every backend).

Gloo runs at world sizes 2 and 3 on any machine. NCCL runs at world size 1 (one
GPU cannot hold two ranks of one communicator) where CUDA and nccl4py exist, and
is skipped with the reason elsewhere.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from asynccoll._backends.nccl import missing as nccl_missing

if sys.version_info < (3, 11):  # anyio depends on the backport there
    from exceptiongroup import BaseExceptionGroup

_NCCL_MISSING = nccl_missing()

BACKENDS = [
    pytest.param("gloo", 2, id="gloo-2"),
    pytest.param("gloo", 3, id="gloo-3"),
    pytest.param(
        "nccl",
        1,
        id="nccl-1",
        marks=pytest.mark.skipif(
            _NCCL_MISSING is not None, reason=f"NCCL unavailable: {_NCCL_MISSING}"
        ),
    ),
]
LOOPS = ["asyncio", "uvloop", "trio"]
"""Every loop the contract names (API.md §10). Test bodies parametrized by loop use
loop-neutral anyio (sleep, Event, task groups, fail_after, to_thread) so the same body
runs under each."""


async def gather(*fns: Callable[[], Awaitable[Any]], timeout: float = 60) -> list[Any]:
    """``asyncio.gather`` for any loop: each ``fn()`` runs in a task of one anyio task
    group; their results in order. The first error cancels the others and propagates."""
    results: list[Any] = [None] * len(fns)

    async def one(i: int) -> None:
        results[i] = await fns[i]()

    try:
        with anyio.fail_after(timeout):
            async with anyio.create_task_group() as tg:
                for i in range(len(fns)):
                    tg.start_soon(one, i)
    except BaseExceptionGroup as group:  # one failure: raise it as asyncio.gather would
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    return results


async def in_task(fn: Callable[[], Awaitable[Any]], timeout: float = 20) -> Any:
    """Run ``fn()`` in a new task (asyncio task or trio task) and return its value."""
    (value,) = await gather(fn, timeout=timeout)
    return value


def auto_on_one_host(world_size: int) -> pytest.MarkDecorator:
    """Skip a test whose ``world_size`` ranks use ``backend="auto"`` (the ``"asynccoll"``
    name of torch.distributed) on this host where it has CUDA and NCCL but fewer GPUs than
    ranks: "auto" then builds NCCL, which refuses two ranks on one GPU (NCCL < 2.30,
    "Duplicate GPU detected"; asynccoll's own test of that is in tests/nccl/test_gpu.py).
    On a host without CUDA these run on Gloo alone."""
    import torch

    gpus = torch.cuda.device_count() if _NCCL_MISSING is None else 0
    return pytest.mark.skipif(
        0 < gpus < world_size,
        reason=f'backend "auto" at world size {world_size} needs a GPU per rank here '
        f"(this host has {gpus}; NCCL refuses two ranks on one GPU)",
    )
