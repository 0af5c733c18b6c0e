"""``ac.init`` arguments: typed errors saying what to fix, and one store per address per process.

Each bad argument once surfaced as a raw OverflowError, TypeError, ValueError or
torch DistNetworkError; a second communicator on the same explicit address failed
with EADDRINUSE. Runs under asyncio, uvloop and trio.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import time
from typing import Any, Awaitable, Callable

import anyio
import pytest
import torch
import torch.distributed as dist
import trio
import uvloop

import asynccoll as ac
from asynccoll._bootstrap import rendezvous, stores
from asynccoll._faults.service import Service
from asynccoll.testing import RankContext, run_ranks
from tests.support.backends import LOOPS, gather
from tests.support.ports import unused_port


def _run(loop: str, fn: Callable[[], Awaitable[Any]]) -> Any:
    if loop == "uvloop":
        return uvloop.run(fn())
    if loop == "trio":
        return trio.run(fn)
    return asyncio.run(fn())


BAD_ARGS: list[tuple[dict[str, Any], str]] = [
    (dict(timeout=float("inf")), "timeout"),
    (dict(timeout=float("nan")), "timeout"),
    (dict(timeout=1e300), "timeout"),
    (dict(timeout="5"), "timeout"),
    (dict(timeout=0), "timeout"),
    (dict(rank="0"), "rank"),
    (dict(rank=1.0), "rank"),
    (dict(rank=-1), "rank"),
    (dict(rank=True), "rank"),
    (dict(rank=2), "rank"),
    (dict(world_size="2"), "world_size"),
    (dict(world_size=0), "world_size"),
    (dict(master_port="abc"), "master_port"),
    (dict(master_port="29500"), "master_port"),
    (dict(master_port=-1), "master_port"),
    (dict(master_port=70000), "master_port"),
    (dict(master_port=2.5), "master_port"),
    (dict(master_addr=127), "master_addr"),
    (dict(master_addr="nosuchhost.invalid"), "resolve"),
    (dict(store=object()), "store"),
    (dict(store="127.0.0.1:29500"), "store"),
    (dict(device="notadevice"), "device"),
    (dict(device=1.5), "device"),
    (dict(heartbeat=float("inf")), "heartbeat"),
    (dict(heartbeat=-1), "heartbeat"),
    (dict(heartbeat="x"), "heartbeat"),
    (dict(backend=["gloo"]), "backend"),
]


@pytest.mark.parametrize("loop", LOOPS)
def test_bad_init_arguments_are_invalid_argument(loop: str) -> None:
    async def main() -> None:
        for extra, what in BAD_ARGS:
            kwargs: dict[str, Any] = dict(
                backend="gloo",
                rank=0,
                world_size=2,
                master_addr="127.0.0.1",
                master_port=unused_port(),
                timeout=5,
            )
            kwargs.update(extra)
            with pytest.raises(ac.InvalidArgument, match=what):
                await ac.init(**kwargs)

    _run(loop, main)


@pytest.mark.parametrize("loop", LOOPS)
def test_bad_environment_is_invalid_argument(loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        for var, raw in (
            ("MASTER_PORT", "abc"),
            ("RANK", "zero"),
            ("WORLD_SIZE", "0"),
            ("MASTER_PORT", "0"),
        ):
            monkeypatch.setenv("RANK", "0")
            monkeypatch.setenv("WORLD_SIZE", "1")
            monkeypatch.setenv("MASTER_PORT", str(unused_port()))
            monkeypatch.setenv(var, raw)
            with pytest.raises(ac.InvalidArgument, match=var):
                await ac.init("gloo", timeout=5)

    _run(loop, main)


@pytest.mark.parametrize("loop", LOOPS)
def test_port_in_use_is_invalid_argument(loop: str) -> None:
    async def main() -> None:
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            with pytest.raises(ac.InvalidArgument, match="in use"):
                await ac.init(
                    "gloo",
                    rank=0,
                    world_size=2,
                    master_addr="127.0.0.1",
                    master_port=port,
                    timeout=5,
                )
        assert (("127.0.0.1", port)) not in stores.STORES

    _run(loop, main)


def test_store_errors_are_typed() -> None:
    """A TCPStore constructor's errors, with the messages torch 2.13 gives (measured: all
    three are DistNetworkError), become the contract's types."""
    cases: list[tuple[str, type[BaseException], str]] = [
        (
            "The server socket has failed to listen on any local network address. port: 29500, "
            "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use",
            ac.InvalidArgument,
            "already in use",
        ),
        (
            "The client socket has timed out after 1000ms while trying to connect to (127.0.0.1, 29500).",
            ac.CollectiveTimeout,
            "did not arrive",
        ),
        ("Connection refused", ac.InvalidArgument, "no asynccoll/torch store answers"),
    ]
    for text, kind, words in cases:
        exc = dist.DistNetworkError(text)
        err = stores.store_error(exc, "127.0.0.1", 29500, 1.0)
        assert type(err) is kind and words in str(err) and err.__cause__ is exc, (text, err)


def test_a_store_that_never_answers_is_a_timeout() -> None:
    """A client rank whose store server never comes up times out as the contract says."""

    async def main() -> None:
        with pytest.raises(ac.CollectiveTimeout, match="did not arrive"):
            await ac.init(
                "gloo",
                rank=1,
                world_size=2,
                master_addr="127.0.0.1",
                master_port=unused_port(),
                timeout=1,
            )

    _run("asyncio", main)


def test_wrap_checks_its_arguments() -> None:
    store = dist.HashStore()
    pg = dist.ProcessGroupGloo(store, 0, 1, __import__("datetime").timedelta(seconds=10))
    with pytest.raises(ac.InvalidArgument, match="timeout"):
        ac.wrap(pg, timeout=float("inf"))
    with pytest.raises(ac.InvalidArgument, match="store"):
        ac.wrap(pg, store="not a store")
    comm = ac.wrap(pg, store=store)
    # A wrapped Gloo group is validated with Gloo's capability table.
    with pytest.raises(ac.InvalidArgument, match="gloo cannot reduce"):
        comm.all_reduce(torch.zeros(2, dtype=torch.uint16))


async def two_on_one_address(ctx: RankContext) -> list[float]:
    if ctx.rank == 0:
        ctx.store.set("port", str(unused_port()))
    port = int(ctx.store.get("port"))
    key = ("127.0.0.1", port)
    args = dict(rank=ctx.rank, world_size=2, master_addr="127.0.0.1", master_port=port, timeout=30)
    first = await ac.init("gloo", **args)
    second = await ac.init("gloo", **args)  # the same address again: the process's store is reused
    # Two at once on one store: creations take turns (Gloo's constructor blocks the
    # shared store client; interleaved, they deadlocked until the timeout).
    third, fourth = await gather(lambda: ac.init("gloo", **args), lambda: ac.init("gloo", **args))
    comms = [first, second, third, fourth]
    # Issued on all, then awaited: the two made together may pair crosswise.
    ts = [torch.full((2,), float(ctx.rank + 1 + 10 * i)) for i in range(len(comms))]
    for w in [c.all_reduce(t) for c, t in zip(comms, ts)]:
        await w
    out = [t[0].item() for t in ts]
    assert await second.all_gather_object(ctx.rank) == [0, 1]
    assert key in stores.STORES
    await gather(*(c.close for c in comms))
    del first, second, third, fourth, comms
    gc.collect()
    assert key not in stores.STORES, "the shared store outlived its communicators"
    return out


@pytest.mark.parametrize("loop", LOOPS)
def test_two_communicators_on_one_explicit_address(loop: str) -> None:
    results = run_ranks(two_on_one_address, world_size=2, backend=None, timeout=90, loop=loop)
    # all_reduce of (rank + 1 + 10 i) over ranks 0, 1: 3 + 20 i.
    # The two created together pair by creation order, whichever call got which turn
    # (crossed pairs sum 21 + 32 = 53 twice instead of 43 and 63).
    assert results[0][:2] == results[1][:2] == [3.0, 23.0]
    assert sorted(results[0][2:]) == sorted(results[1][2:]) and sum(results[0][2:]) == 106.0


async def concurrent_on_given_store(ctx: RankContext) -> float:
    args = dict(rank=ctx.rank, world_size=2, store=ctx.store, timeout=30)
    comms = await gather(*(lambda: ac.init("gloo", **args) for _ in range(3)))
    # Which call got which turn may differ between ranks: issue on all, then wait.
    ts = [torch.ones(1) for _ in comms]
    for w in [c.all_reduce(t) for c, t in zip(comms, ts)]:
        await w
    await gather(*(c.close for c in comms))
    return sum(t.item() for t in ts)


@pytest.mark.parametrize("loop", LOOPS)
def test_concurrent_creation_on_a_given_store(loop: str) -> None:
    assert run_ranks(
        concurrent_on_given_store, world_size=2, backend=None, timeout=90, loop=loop
    ) == [6.0, 6.0]


@pytest.mark.parametrize("loop", LOOPS)
def test_creation_errors_are_typed(loop: str) -> None:
    """What torch raises while building a backend reaches the caller as the contract's type."""

    def raising(text: str) -> Callable[[], None]:
        def fn() -> None:
            raise dist.DistNetworkError(text)

        return fn

    async def main() -> None:
        cases: list[tuple[str, type[BaseException]]] = [
            ("Socket Timeout", ac.CollectiveTimeout),
            ("Connection reset by peer", ac.PeerFailure),
            ("something else broke", ac.CommAborted),
        ]
        for text, kind in cases:
            with pytest.raises(kind) as info:
                await rendezvous.off_loop(raising(text), 5, "gloo init")
            assert isinstance(info.value.__cause__, dist.DistNetworkError)
        with pytest.raises(ac.InvalidArgument):  # already typed: unchanged

            def invalid() -> None:
                raise ac.InvalidArgument("x")

            await rendezvous.off_loop(invalid, 5, "gloo init")

    _run(loop, main)


async def crossed_creations(ctx: RankContext) -> list[str]:
    """Two tasks create communicators with different options at once, in opposite
    orders on the two ranks: the n-th creation of each rank pairs with the other's
    n-th, so the pairs cross. Where their options differ, every rank says so."""
    kw: dict[str, Any] = dict(rank=ctx.rank, world_size=ctx.world_size, store=ctx.store, timeout=20)
    beat, checked = dict(kw, heartbeat=0.5), dict(kw, check="fingerprint")
    first, second = (beat, checked) if ctx.rank == 0 else (checked, beat)
    out: list[str] = []

    async def make(opts: dict[str, Any], delay: float) -> None:
        await anyio.sleep(delay)
        try:
            comm = await ac.init("gloo", **opts)
        except ac.CollectiveMismatch as exc:
            out.append(f"mismatch {sorted(exc.fields)} {sorted(exc.details)}")
        else:
            out.append("made")
            await comm.close()

    await gather(lambda: make(first, 0.0), lambda: make(second, 0.3))
    return out


def test_crossed_creations_with_different_options_are_a_mismatch() -> None:
    results = run_ranks(crossed_creations, world_size=2, backend=None, timeout=90)
    for res in results:
        assert res == ["mismatch ['check', 'heartbeat'] [0, 1]"] * 2, results


async def keys_after_close(ctx: RankContext) -> list[int]:
    """The store holds no more keys after every rank closed a communicator than
    before it was created (heartbeats, fingerprints and objects used)."""
    store = ctx.store

    async def both(name: str) -> None:  # a barrier on the run's store
        store.add(name, 1)
        while int(store.add(name, 0)) < ctx.world_size:
            await anyio.sleep(0.01)

    async def services_ended() -> None:  # this process's liveness service unlists itself as it ends
        for _ in range(200):
            if Service.threads() == 0:
                return
            await anyio.sleep(0.025)

    kw: dict[str, Any] = dict(rank=ctx.rank, world_size=ctx.world_size, store=store, timeout=30)
    warm = await ac.init("gloo", **kw)  # once-per-store keys (creation counters) exist from here on
    await warm.close()
    await services_ended()
    for name in ("b1", "b2", "b3"):
        store.add(name, 0)
    await both("b1")
    before = store.num_keys()
    await both("b2")  # everyone counted before anyone creates a key
    comm = await ac.init("gloo", heartbeat=0.1, check="fingerprint", **kw)
    await comm.all_reduce(torch.ones(2))
    assert await comm.all_gather_object(ctx.rank) == list(range(ctx.world_size))
    await anyio.sleep(0.3)  # a few heartbeats
    await comm.close()
    await services_ended()
    await both("b3")
    return [before, store.num_keys()]


def test_closed_communicators_leave_no_keys() -> None:
    results = run_ranks(keys_after_close, world_size=2, backend=None, timeout=90)
    for before, after in results:
        assert after == before, results  # was 8 more per 2-rank communicator, forever


def test_forgetting_keys_on_a_store_whose_host_is_gone_does_not_fail() -> None:
    """close()'s last step (deleting the keys, ``rendezvous.forget``) on a store whose
    host is gone: rank 0 hosting it (``master_addr``, no launcher's store) closed first
    and its process exited before this rank's liveness noticed. The keys went with the
    store; it raised DistNetworkError out of close() (examples/quickstart.py under CPU
    load, 1 run in 5)."""
    from datetime import timedelta

    server = dist.TCPStore(
        "127.0.0.1", 0, 2, True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    client = dist.TCPStore("127.0.0.1", server.port, 2, False, timeout=timedelta(seconds=10))
    client.set("x", "1")
    del server  # the server stops with its last reference
    gc.collect()
    rendezvous.forget(rendezvous.Rendezvous(client, 1, 2), "c0/")
    with pytest.raises(dist.DistNetworkError):  # the store is gone indeed
        client.add("y", 1)


def test_forget_waits_for_every_rank_not_proven_dead() -> None:
    """``rendezvous.forget`` on a 4-rank communicator whose census proved rank 3 dead:
    the keys stay while rank 1 (left out of a shrink, alive: it may still read them)
    has not closed, and one rank deletes them, with what object collective 7 left."""
    from datetime import timedelta

    server = dist.TCPStore(
        "127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    store = dist.PrefixStore("c/", server)
    for key in (
        "aborted",
        "failure",
        "proc/0",
        "proc/1",
        "proc/2",
        "proc/3",
        "obj/7/0",
        "obj/7/0/0",
        "obj/7/2",
    ):
        store.set(key, "3" if key == "failure" else "x")
    dist.PrefixStore("c/gloo/", server).set("0/1", "x")
    written = server.num_keys()

    def leave(rank: int, ops: tuple[int, ...] = ()) -> None:
        rendezvous.forget(rendezvous.Rendezvous(server, rank, 4), "c/", ops=ops)

    leave(0, ops=(7,))
    leave(2)
    assert server.num_keys() == written + 2  # and the count ("left") and the reported ops ("ops")
    leave(1)
    assert server.num_keys() == 0, server.list_keys()


def test_forget_deletes_when_the_ranks_count_past_a_threshold_they_see_differently() -> None:
    """The census named rank 3 failed, yet it counts itself out too (it was alive): the
    others each count against 3 ranks, rank 3 against 4. In the order 0, 1, 3, 2 no count
    equalled its rank's threshold (3, 3, 3 against 4, 4 against 3) and nobody deleted."""
    from datetime import timedelta

    server = dist.TCPStore(
        "127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    store = dist.PrefixStore("c/", server)
    for key in ("aborted", "failure", "proc/0", "proc/1", "proc/2", "proc/3"):
        store.set(key, "3" if key == "failure" else "x")
    for rank in (0, 1, 3, 2):
        rendezvous.forget(rendezvous.Rendezvous(server, rank, 4), "c/")
    assert server.num_keys() == 0, server.list_keys()


async def close_at_once(ctx: RankContext) -> dict[str, Any]:
    # Rank 1 is slow to finish creating (its Gloo group is built, then 1 s more: a rank
    # starved of CPU); rank 0 closes its communicator as soon as init returns. Init
    # returns on no rank before every rank has built its backends, so rank 0's close
    # cannot pull the connections from under a peer still inside Gloo's connectFullMesh
    # (seen under CPU load: "Connection closed by peer" on the slow rank).
    from asynccoll._bootstrap.build import Factories, build_gloo
    from asynccoll._bootstrap.init import init_with

    def slow_gloo(store: Any, rank: int, world_size: int, timeout: float) -> Any:
        backend = build_gloo(store, rank, world_size, timeout)
        if rank == 1:
            time.sleep(1.0)
        return backend

    t0 = asyncio.get_running_loop().time()
    comm = await init_with(
        Factories(gloo=slow_gloo), "gloo", rank=ctx.rank, world_size=2, store=ctx.store, timeout=30
    )
    took = asyncio.get_running_loop().time() - t0
    if ctx.rank == 0:
        await comm.close()
        return {"took": took}
    state = comm.state
    comm.abort()  # its peer is gone: nothing to finish
    await comm.close()
    return {"took": took, "state": state}


def test_init_returns_once_every_rank_has_built_its_backends() -> None:
    results = run_ranks(close_at_once, world_size=2, backend=None, timeout=60)
    assert results[0]["took"] >= 0.9, results  # rank 0 waited for rank 1's creation to end
    assert results[1]["state"] == "ok", results


async def _nccl_refuses(rdv: Any, prefix: str, device: Any, timeout: float) -> Any:
    # What NCCL says to two ranks of one communicator on one GPU (before 2.30).
    raise ac.BackendUnavailable(
        "NCCL init (rank 0/2, cuda:0) failed: NCCL error 5 (invalid usage): "
        "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 1b000"
    )


def _ours(names: set[str], rank: int) -> set[str]:
    """Threads of asynccoll's, less the rank worker's executor (``asynccoll-rank<R>_<N>``)."""
    return {
        n for n in names if n.startswith("asynccoll") and not n.startswith(f"asynccoll-rank{rank}_")
    }


async def auto_with_nccl_refused(ctx: RankContext) -> dict[str, Any]:
    """``init("auto")`` whose NCCL part fails after Gloo is up: Gloo is released, its
    threads end, and the communicator's keys are deleted once both ranks are out."""
    import threading

    from asynccoll._bootstrap.build import Factories
    from asynccoll._bootstrap.init import init_with

    store = ctx.store

    async def both(name: str) -> None:
        store.add(name, 1)
        while int(store.add(name, 0)) < ctx.world_size:
            await anyio.sleep(0.01)

    kw: dict[str, Any] = dict(rank=ctx.rank, world_size=ctx.world_size, store=store, timeout=30)
    warm = await ac.init("gloo", **kw)  # once-per-store keys (creation counters) exist from here on
    await warm.close()
    for _ in range(200):  # the liveness service of the warm-up unlists itself as it ends
        if Service.threads() == 0:
            break
        await anyio.sleep(0.025)
    for name in ("b1", "b2", "b3"):
        store.add(name, 0)
    await both("b1")
    before, threads = store.num_keys(), {t.name for t in threading.enumerate()}
    await both("b2")
    factories = Factories(
        nccl=_nccl_refuses, nccl_missing=lambda: None
    )  # as where CUDA and nccl4py are
    try:
        await init_with(factories, "auto", **kw)
        error = "no error"
    except ac.BackendUnavailable as exc:
        error = str(exc)
    await both("b3")
    left: set[str] = set()
    for _ in range(200):  # threads that are ending
        left = _ours({t.name for t in threading.enumerate()} - threads, ctx.rank)
        if not left:
            break
        await anyio.sleep(0.025)
    return {"error": error, "keys": store.num_keys() - before, "threads": sorted(left)}


def test_auto_whose_nccl_fails_releases_gloo_and_its_keys() -> None:
    for res in run_ranks(auto_with_nccl_refused, world_size=2, backend=None, timeout=90):
        assert "Duplicate GPU" in res["error"], res
        assert res["keys"] == 0 and res["threads"] == [], res  # were: 5 keys, Gloo left to the GC
