"""Abort news and pulse messages: what they carry, and whom they reach.

A pulse's port outlives its process and member ids restart at 1 in every process, so a
message names its store and namespace, and one for another store or communicator is
dropped. The tests forge what a reused port looks like from the sender's side: a stale
record, in the sender's namespace, naming this process's pulse and member id.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

import asynccoll as ac
from asynccoll._faults import news, procs
from asynccoll._faults.liveness import Liveness
from asynccoll._faults.service import SERVICES_KEY, Service

pytestmark = pytest.mark.timeout(60)


def _server() -> Any:
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )


def _member(store: Any, rank: int, heard: threading.Event | None = None) -> Liveness:
    member = Liveness(
        store,
        rank,
        2,
        interval=0.05,
        detect=False,
    )
    member.publish()
    member.start((lambda e: heard.set()) if heard is not None else (lambda e: None))
    return member


# ------------------------------------------------------------------ the news
def test_a_mismatch_travels_whole() -> None:
    mismatch = ac.CollectiveMismatch(
        "seq 5 all_reduce: shape (4,) on ranks 0, 1, (6,) on rank 2",
        seq=5,
        details={
            0: {"seq": 5, "op": "all_reduce", "shape": "(4,)"},
            1: {"seq": 5, "op": "all_reduce", "shape": "(4,)"},
            2: {"seq": 5, "op": "all_reduce", "shape": "(6,)"},
        },
        fields=("shape",),
    )
    wrapped = ac.CommAborted(f"communicator aborted: {mismatch}")  # the ledger's abort error
    wrapped.__cause__ = mismatch
    for error in (mismatch, wrapped):
        raw = news.encode(2, error)
        assert raw.split("|", 1)[0] == "2"  # ``Roster.left`` reads the origin alone
        got = news.decode(raw)
        assert isinstance(got, ac.CollectiveMismatch)
        assert (str(got), got.seq, got.fields) == (str(mismatch), 5, ("shape",))
        assert got.details == mismatch.details


def test_ranks_with_the_same_details_are_sent_once() -> None:
    details = {r: {"seq": 3, "op": "all_reduce", "shape": "(4,)"} for r in range(4096)}
    details[7] = {"seq": 3, "op": "all_reduce", "shape": "(5,)"}
    raw = news.encode(0, ac.CollectiveMismatch("m", seq=3, details=details, fields=("shape",)))
    assert len(raw) < 64 << 10  # a pulse message's bound (procs.MAX_MESSAGE)
    got = news.decode(raw)
    assert isinstance(got, ac.CollectiveMismatch) and got.details == details


def test_other_news_keeps_its_type() -> None:
    got = news.decode(news.encode(1, ac.PeerFailure("rank 3 died", [3])))
    assert isinstance(got, ac.PeerFailure) and got.ranks == (3,)
    assert str(got) == "peer failure reported by rank 1: rank 3 died"
    got = news.decode(news.encode(0, ac.CommAborted("aborted | by the user")))
    assert type(got) is ac.CommAborted and str(got) == "aborted by rank 0: aborted | by the user"
    got = news.decode("1|boom")  # not this format: said as it came
    assert type(got) is ac.CommAborted and str(got) == "aborted by rank 1: boom"


# ------------------------------------------------------------- whom news reaches
@pytest.mark.parametrize("other", ["store", "namespace"])
def test_abort_news_for_another_communicator_is_dropped(other: str) -> None:
    """``theirs`` (another store, or another namespace of the same store) still holds a
    record of its rank 1 naming this process's pulse and ``mine``'s member id. Its abort
    news reaches the pulse and must not abort ``mine``; news from ``mine``'s own peer
    still does."""
    server = _server()
    their_server = _server() if other == "store" else server
    heard = threading.Event()
    mine = _member(dist.PrefixStore("mine", server), 0, heard)
    theirs = _member(dist.PrefixStore("theirs", their_server), 0)
    members = [mine, theirs]
    try:
        svc = mine._service
        assert svc is not None and svc.pulse is not None
        machine, pid, started = procs.this_process()
        host, port = svc.pulse.address
        stale = procs.Peer(mine.id, machine, pid, started, host, port)
        dist.PrefixStore("theirs", their_server).set("proc/1", stale.encode())
        theirs.publish_abort(ac.CommAborted("their job failed"))
        assert not heard.wait(1.5), "another communicator's news aborted this one"
        peer = _member(dist.PrefixStore("mine", server), 1)  # mine's own rank 1
        members.append(peer)
        peer.publish_abort(ac.CommAborted("our job failed"))
        assert heard.wait(10), "this communicator's own news never came"
    finally:
        for m in members:
            m.stop()


def test_a_store_host_leaving_another_store_is_ignored() -> None:
    """Another store lists this process's pulse among its services (a reused port): its
    host closing must not stop this service from using its own store."""
    server, other = _server(), _server()
    mine = _member(dist.PrefixStore("c", server), 0)
    try:
        svc = mine._service
        assert svc is not None and svc.pulse is not None
        host, port = svc.pulse.address
        slot = int(other.add(SERVICES_KEY, 1))
        other.set(f"{SERVICES_KEY}/{slot}", f"{host}|{port}")
        Service.announce_leaving(other, wait=1.0)
        assert not svc.host_left and svc.store_gone is None and mine.failure() is None
        Service.announce_leaving(server, wait=5.0)  # its own store's host: heard
        assert svc.host_left and svc.store_gone is not None
    finally:
        mine.stop()
