"""A mismatch raises ``CollectiveMismatch`` on every involved rank, even one whose own
verdict is late: a peer's abort news carries the mismatch whole, and the news waits for a
verdict being applied.

Each test stops one rank's fingerprint machinery at a chosen point (by replacing an
attribute of that rank's checker, mesh or liveness member, in that rank's process only), so
the race it pins is taken every run, not one run in a hundred.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

import asynccoll as ac
from asynccoll._diag import mesh as mesh_module
from asynccoll.testing import run_ranks

pytestmark = pytest.mark.timeout(120)

LONG = 60.0  # op deadline: the mismatch must be reported by the check, never by it


async def _comm(ctx: Any) -> ac.Communicator:
    return await ac.init(
        "gloo",
        rank=ctx.rank,
        world_size=ctx.world_size,
        store=ctx.store,
        timeout=LONG,
        check="fingerprint",
    )


def _outcome(exc: BaseException) -> dict[str, Any]:
    if not isinstance(exc, ac.CollectiveMismatch):
        return {"type": type(exc).__name__, "message": str(exc)}
    return {
        "type": "CollectiveMismatch",
        "message": str(exc),
        "seq": exc.seq,
        "fields": list(exc.fields),
        "details": sorted(exc.details),
    }


async def _mismatch_after(ctx: Any, rank1_first: bool, arrange: Any) -> dict[str, Any]:
    """A matching op, then a mismatched all_reduce (rank 1 issues it first when
    ``rank1_first``); ``arrange(comm)`` sets this rank's trap before it."""
    comm = await _comm(ctx)
    try:
        await comm.all_reduce(torch.ones(2))
        arrange(comm)
        if ctx.rank == 1 or not rank1_first:
            work = comm.all_reduce(torch.ones(4 + 2 * ctx.rank))
            ctx.store.set("issued/1", "1")
        else:
            await asyncio.to_thread(ctx.store.wait, ["issued/1"])
            work = comm.all_reduce(torch.ones(4 + 2 * ctx.rank))
        try:
            await work
        except ac.AsyncCollError as exc:
            return _outcome(exc)
        raise AssertionError("the mismatched all_reduce succeeded")
    finally:
        await comm.close()


# ------------------------------------------------------------------ the reader stalls
def _stall_the_applier(comm: ac.Communicator) -> None:
    """Rank 1: its reader thread takes the verdict, and applies it only once the peer's news
    has reached this rank and aborted it, or after a second (the news waits for it)."""
    if comm.rank != 1:
        return
    checker = comm._diag.checker  # type: ignore[attr-defined]
    liveness = comm._liveness  # type: ignore[attr-defined]
    taken, heard = threading.Event(), threading.Event()
    deliver, sink = liveness.deliver, checker.sink

    def news_arrives(raw: str) -> None:
        heard.set()
        taken.wait(30)  # the verdict is taken before the news goes in
        deliver(raw)

    class StalledSink:
        def fail(self, target: Any, exc: BaseException) -> None:
            if isinstance(exc, ac.CollectiveMismatch):
                taken.set()
                assert heard.wait(30), "the peer's news never came"
                end = time.monotonic() + 1.0
                while comm.state == "ok" and time.monotonic() < end:
                    time.sleep(0.01)
            sink.fail(target, exc)

    liveness.deliver = news_arrives
    checker.sink = StalledSink()


def test_news_waits_for_a_verdict_being_applied() -> None:
    """Rank 1's reader thread takes the mismatch verdict under the checker's lock and is
    stalled before applying it; rank 0's news arrives in that window. The news must not
    fail rank 1's Work with a bare ``CommAborted``: it waits for the verdict."""
    results = run_ranks(
        _mismatch_after, world_size=2, backend=None, timeout=90, args=(True, _stall_the_applier)
    )
    for r in (0, 1):
        assert results[r]["type"] == "CollectiveMismatch", (r, results)
        assert results[r]["fields"] == ["shape"] and results[r]["details"] == [0, 1], results
    assert results[0]["message"] == results[1]["message"], results


# ------------------------------------------------------------ the fingerprint is late
def _late_fingerprint(comm: ac.Communicator) -> None:
    """Rank 0: its fingerprints stay in its outbox (a full socket buffer) until it closes.
    Rank 1: its reader thread decides nothing, so only rank 0's news can tell it."""
    checker = comm._diag.checker  # type: ignore[attr-defined]
    if comm.rank == 0:
        mesh = checker._mesh

        def spill(peers: Any, tag: str, k: int, seq: int, text: str) -> None:
            for q in peers:
                mesh._outbox[q].append(mesh_module._frame(tag, k, seq, text))

        mesh.send = spill
    else:
        checker.frames_arrived = lambda: None


def test_a_peers_news_carries_its_mismatch() -> None:
    """Rank 0 decides the mismatch; rank 1 never decides it itself (rank 0's fingerprint
    has not left rank 0 when it aborts). Rank 1 raises the mismatch from rank 0's news:
    its own seq, the same fields, details and words, not a ``CommAborted`` or a
    ``PeerFailure`` for rank 0's closed channel."""
    results = run_ranks(
        _mismatch_after, world_size=2, backend=None, timeout=90, args=(True, _late_fingerprint)
    )
    for r in (0, 1):
        assert results[r]["type"] == "CollectiveMismatch", (r, results)
        assert results[r]["seq"] == 2 and results[r]["fields"] == ["shape"], results
        assert results[r]["details"] == [0, 1], results
    assert results[0]["message"] == results[1]["message"], results
    assert results[1]["message"] == "seq 2 all_reduce: shape (4,) on rank 0, (6,) on rank 1"
