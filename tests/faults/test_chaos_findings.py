"""What the chaos soak found in the product and is not fixed here: each a strict xfail with
its reproducer (it passes, and so fails as an xfail, once the product is fixed)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
import torch

import asynccoll as ac
from asynccoll.testing import run_ranks


async def _shrink_while_a_survivor_stays_away(comm: Any) -> str:
    """Rank 2 dies; rank 0 shrinks at once (the census recorded rank 2: no agreement round)
    and builds the 2-rank group; rank 1 is alive but never shrinks, so the build times out."""
    if comm.rank == 2:
        os._exit(0)
    try:
        await comm.all_reduce(torch.ones(1))
    except ac.CommAborted:
        pass
    if comm.rank == 1:
        await asyncio.sleep(8)
        return "away"
    try:
        await comm.shrink()
    except ac.AsyncCollError as exc:
        return f"typed {type(exc).__name__}"
    except BaseException as exc:  # noqa: BLE001 - what leaks is the finding
        return f"untyped {type(exc).__name__}: {exc!r}"
    return "shrank"


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="shrink() raises anyio's ExceptionGroup wrapping CollectiveTimeout when the new "
    "group's creation times out (asynccoll/_faults/shrink.py::_build's task group); the chaos "
    "soak's rank crashed on it (seed 1, with split33 merged, 2026-11-27)",
)
@pytest.mark.timeout(90)
def test_a_shrink_whose_build_times_out_raises_collective_timeout() -> None:
    results = run_ranks(
        _shrink_while_a_survivor_stays_away, world_size=3, timeout=60, init_timeout=5, lost=(2,)
    )
    assert results[0] == "typed CollectiveTimeout", results
