"""A store whose server died and was restarted at the same address: a communicator
made on the new one gets a fresh store connection and a fresh liveness service.

The process's store client and its liveness service are shared per address; the old
ones are dead with the old server (the service stopped using the store when it
failed), and must not be handed to a communicator made after the restart.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

import asynccoll as ac
from asynccoll.testing import RankContext, run_ranks
from tests.support.ports import unused_port

pytestmark = pytest.mark.timeout(150)


def _serve(port: int) -> subprocess.Popen[str]:
    """``python -m asynccoll.store`` on ``port`` (a process of its own), once it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "asynccoll.store", "--port", str(port), "--host", "127.0.0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("asynccoll store: listening on "), line
    return proc


async def _barrier(store: Any, name: str) -> None:
    store.add(name, 1)
    deadline = time.monotonic() + 60
    while int(store.add(name, 0)) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def _until(cond: Any, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.02)
    return True


async def restarted_store(ctx: RankContext, port: int) -> dict[str, Any]:
    """Both ranks are clients of a store served by a process of its own (as with
    torchrun's agent). Communicator A is made on it; the store's process is killed and
    a new one started on the same port; A sees its store gone (and is kept, not closed);
    communicator B is made on the new store. Rank 1 then aborts B: rank 0 must hear it
    (abort news), and B's heartbeats must move meanwhile."""
    old_env = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # every rank a client
    server = _serve(port) if ctx.rank == 0 else None
    kw: dict[str, Any] = dict(
        rank=ctx.rank, world_size=2, master_addr="127.0.0.1", master_port=port, timeout=20
    )
    try:
        await _barrier(ctx.store, "up1")
        a = await ac.init("gloo", heartbeat=0.2, **kw)
        await a.all_reduce(torch.ones(2))
        await _barrier(ctx.store, "a")
        if server is not None:
            server.kill()
            server.wait()
            server = _serve(port)
        await _barrier(ctx.store, "up2")
        a_saw = await _until(lambda: a.state == "aborted", 10)
        b = await ac.init("gloo", heartbeat=0.2, **kw)
        t = torch.ones(2)
        await b.all_reduce(t)
        beats = b._liveness._store  # type: ignore[attr-defined]
        hb0 = int(beats.add(f"hb/{ctx.rank}", 0))
        await asyncio.sleep(1.0)
        hb1 = int(beats.add(f"hb/{ctx.rank}", 0))
        await _barrier(ctx.store, "b")
        if ctx.rank == 1:
            b.abort("rank 1 aborts")
            heard = True
        else:
            heard = await _until(lambda: b.state == "aborted", 10)
        await _barrier(ctx.store, "done")
        result = {
            "a_saw": a_saw,
            "sum": float(t[0]),
            "beats": hb1 - hb0,
            "heard": heard,
            "error": repr(b.error) if hasattr(b, "error") else None,
        }
        await b.close()
        await a.close()
        return result
    finally:
        if old_env is None:
            os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        else:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = old_env
        if server is not None:
            server.kill()
            server.wait()


def test_a_communicator_on_a_restarted_store_beats_and_hears_news() -> None:
    results = run_ranks(
        restarted_store, world_size=2, backend=None, timeout=120, args=(unused_port(),)
    )
    for res in results:
        assert res["a_saw"] and res["sum"] == 2.0, results
        assert res["beats"] >= 2, results  # heartbeats every 0.2 s for a second
        assert res["heard"], results
