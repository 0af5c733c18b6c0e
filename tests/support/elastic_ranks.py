"""Rank functions for tests/faults/test_elastic.py (run_ranks needs them importable)."""

from __future__ import annotations

import collections

import anyio
import torch

import asynccoll as ac
from asynccoll.testing import RankContext

Point = collections.namedtuple("Point", "x y")


async def members_wait_then_grow(ctx: RankContext, members: int) -> dict:
    if ctx.rank >= members:
        comm = await ac.join("gloo", store=ctx.store, name="g", timeout=30)
        state = await comm.broadcast_state(None, src=0)
    else:
        old = await ac.init(
            "gloo", rank=ctx.rank, world_size=members, store=ctx.store, name="g", timeout=30
        )
        counts = []
        while True:
            n = await old.waiting()
            counts.append(n)
            if n == ctx.world_size - members:
                break
            await anyio.sleep(0.01)
        comm = await old.grow(old.world_size + n)
        assert old.state == "closed"
        state = await comm.broadcast_state({"w": torch.arange(6.0).reshape(2, 3), "step": 7}, src=0)
    t = torch.ones(3) * (comm.rank + 1)
    await comm.all_reduce(t)
    out = {
        "rank": comm.rank,
        "size": comm.world_size,
        "name": comm.name,
        "sum": t.tolist(),
        "w": state["w"].tolist(),
        "step": state["step"],
    }
    await comm.close()
    return out


async def grow_then_look_at_keys(ctx: RankContext, members: int) -> dict:
    """``members_wait_then_grow``, then (every rank closed) which of the grow's keys are left."""
    from asynccoll._bootstrap.room import Room

    await members_wait_then_grow(ctx, members)
    await store_barrier(ctx.store, "all-closed", ctx.world_size, ctx.rank)
    room = Room(ctx.store, "g").store
    g, last = int(room.add("generations", 0)), int(room.add("tickets", 0))
    gen = f"gen/{g}/"
    size = ctx.world_size
    keys = [gen + k for k in ("plan", "outcome", "left", "watch/aborted", "watch/host")]
    keys += [f"{gen}built/{r}" for r in range(size)] + [f"{gen}watch/proc/{r}" for r in range(size)]
    keys += [f"ticket/{t}" for t in range(1, last + 1)]
    return {
        "left": [k for k in keys if room.check([k])],
        "checked": len(keys),
        "admits": [room.check([f"admit/{t}"]) for t in range(1, last + 1)],
    }


async def store_barrier(store, tag: str, n: int, rank: int) -> None:
    store.set(f"{tag}/{rank}", "1")
    while not store.check([f"{tag}/{r}" for r in range(n)]):
        await anyio.sleep(0.005)


def die_when_admitted(store, ticket: int = 1) -> None:
    """SIGKILL this process the moment ticket ``ticket`` of group "g" is admitted (from a thread)."""
    import os
    import signal
    import threading
    import time

    from asynccoll._bootstrap.room import Room

    room = Room(store, "g").store
    key = f"admit/{ticket}"

    def run() -> None:
        while not room.check([key]):
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=run, daemon=True).start()


async def _grow_when_waiting(comm: ac.Communicator, n: int) -> ac.Communicator:
    while await comm.waiting() < n:
        await anyio.sleep(0.01)
    return await comm.grow(comm.world_size + n)


async def joiner_dies_in_grow(ctx: RankContext) -> dict:
    """2 members, 1 joiner that dies the moment it is admitted."""
    import time

    if ctx.rank == 2:
        die_when_admitted(ctx.store)
        await ac.join("gloo", store=ctx.store, name="g", timeout=30)
        raise AssertionError("the joiner should have died")
    old = await ac.init("gloo", rank=ctx.rank, world_size=2, store=ctx.store, name="g", timeout=30)
    start = time.monotonic()
    try:
        await _grow_when_waiting(old, 1)
    except ac.PeerFailure as exc:
        failure = {
            "type": type(exc).__name__,
            "ranks": list(exc.ranks),
            "after": time.monotonic() - start,
        }
    state_after = old.state
    t = torch.ones(2)
    await old.all_reduce(t)  # only a joiner died: the old group still works
    # A planned shrink aborts the old communicator at once: a member must not be
    # still settling the all_reduce when the other's abort news arrives.
    await store_barrier(ctx.store, "before-shrink", 2, ctx.rank)
    new = await old.shrink()  # ...and it can shrink (to the same members) as after any failure
    u = torch.ones(2)
    await new.all_reduce(u)
    res = {
        **failure,
        "old_state": state_after,
        "old_sum": t.tolist(),
        "new": [new.rank, new.world_size],
        "new_sum": u.tolist(),
        "name": new.name,
    }
    await new.close()
    return res


async def member_dies_in_grow(ctx: RankContext) -> dict:
    """3 members (rank 2 dies the moment the joiner is admitted) and 1 joiner: the survivors
    shrink, grow again, and the joiner (which waited on) gets in."""
    if ctx.rank == 3:
        comm = await ac.join("gloo", store=ctx.store, name="g", timeout=60)
    else:
        if ctx.rank == 2:
            die_when_admitted(ctx.store)
        old = await ac.init(
            "gloo", rank=ctx.rank, world_size=3, store=ctx.store, name="g", timeout=60
        )
        try:
            await _grow_when_waiting(old, 1)
            raise AssertionError("grow should have failed")
        except ac.PeerFailure as exc:
            ranks = list(exc.ranks)
        assert old.state == "aborted", old.state
        assert list(old.failed_ranks) == [2], old.failed_ranks
        shrunk = await old.shrink()
        assert shrunk.name == "g" and shrunk.world_size == 2
        comm = await _grow_when_waiting(shrunk, 1)
        assert ranks == [2], ranks
    t = torch.ones(2) * (comm.rank + 1)
    await comm.all_reduce(t)
    res = {"rank": comm.rank, "size": comm.world_size, "sum": t.tolist()}
    await comm.close()
    return res


async def dies_in_broadcast_state(ctx: RankContext, victim: int) -> dict:
    """2 members and 1 joiner grow to 3; ``victim`` dies while the state (32 MB) is moving;
    the others get PeerFailure naming it and shrink to 2."""
    from asynccoll.testing import crash_later

    if ctx.rank == 2:
        comm = await ac.join("gloo", store=ctx.store, name="g", timeout=30)
    else:
        old = await ac.init(
            "gloo", rank=ctx.rank, world_size=2, store=ctx.store, name="g", timeout=30
        )
        comm = await _grow_when_waiting(old, 1)
    state = {"w": torch.randn(8 << 20)} if comm.rank == 0 else None
    if comm.rank == victim:
        crash_later(0.02, how="sigkill")
        for _ in range(100):
            await comm.broadcast_state(state, src=0)
        raise AssertionError("should have died")
    try:
        for _ in range(100):
            await comm.broadcast_state(state, src=0)
        raise AssertionError("broadcast_state should have failed")
    except ac.PeerFailure as exc:
        ranks = list(exc.ranks)
    new = await comm.shrink()
    t = torch.ones(1)
    await new.all_reduce(t)
    res = {"ranks": ranks, "new": [new.rank, new.world_size], "sum": t.tolist(), "name": new.name}
    await new.close()
    return res


def freeze_when_admitted(store, ticket: int = 1) -> None:
    """SIGSTOP this process the moment ticket ``ticket`` of group "g" is admitted: alive on the
    process table, silent to everyone (only heartbeats and the census can name it)."""
    import os
    import signal
    import threading
    import time

    from asynccoll._bootstrap.room import Room

    room = Room(store, "g").store
    key = f"admit/{ticket}"

    def run() -> None:
        while not room.check([key]):
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGSTOP)

    threading.Thread(target=run, daemon=True).start()


async def joiner_freezes_in_grow(ctx: RankContext) -> dict:
    import time

    if ctx.rank == 2:
        freeze_when_admitted(ctx.store)
        await ac.join("gloo", store=ctx.store, name="g", timeout=30)
        raise AssertionError("the joiner should have frozen")
    old = await ac.init("gloo", rank=ctx.rank, world_size=2, store=ctx.store, name="g", timeout=30)
    start = time.monotonic()
    try:
        await _grow_when_waiting(old, 1)
        raise AssertionError("grow should have failed")
    except ac.PeerFailure as exc:
        res = {"ranks": list(exc.ranks), "after": time.monotonic() - start, "old_state": old.state}
    await old.close()
    return res


async def grow_timeout_and_late_joiner(ctx: RankContext) -> dict:
    """No joiner: grow times out and leaves the old communicator usable. Then a late joiner
    arrives while the members already wait in grow (scale out without waiting())."""
    if ctx.rank == 2:
        while not ctx.store.check(["timed_out/0"]) or not ctx.store.check(["timed_out/1"]):
            await anyio.sleep(0.01)
        await anyio.sleep(0.5)  # the members are in grow() by now
        comm = await ac.join("gloo", store=ctx.store, name="g", timeout=30)
        res = {"rank": comm.rank, "size": comm.world_size}
        await comm.close()
        return res
    old = await ac.init("gloo", rank=ctx.rank, world_size=2, store=ctx.store, name="g", timeout=30)
    try:
        await old.grow(3, timeout=0.5)
        raise AssertionError("grow should have timed out")
    except ac.CollectiveTimeout:
        pass
    t = torch.ones(1)
    await old.all_reduce(t)
    ctx.store.set(f"timed_out/{ctx.rank}", "1")
    comm = await old.grow(3, timeout=30)
    res = {
        "rank": comm.rank,
        "size": comm.world_size,
        "old_sum": t.tolist(),
        "old_state": old.state,
    }
    await comm.close()
    return res


async def bad_arguments(ctx: RankContext) -> dict:
    """Bad input raises InvalidArgument at the call; the communicator stays usable."""
    errors = {}

    async def expect(what: str, coro) -> None:
        try:
            await coro
        except ac.InvalidArgument as exc:
            errors[what] = str(exc)
        else:
            errors[what] = None

    plain = await ac.init("gloo", rank=ctx.rank, world_size=2, store=ctx.store)
    named = await ac.init("gloo", rank=ctx.rank, world_size=2, store=ctx.store, name="g")
    await expect("waiting unnamed", plain.waiting())
    await expect("grow unnamed", plain.grow(3))
    await expect("grow same size", named.grow(2))
    await expect("grow not int", named.grow(3.0))
    await expect("grow bad timeout", named.grow(3, timeout=-1))
    await expect(
        "init bad name", ac.init("gloo", rank=0, world_size=1, store=ctx.store, name="a/b")
    )
    await expect("init empty name", ac.init("gloo", rank=0, world_size=1, store=ctx.store, name=""))
    await expect("join no name", ac.join("gloo", store=ctx.store, name=None))
    await expect("join bad backend", ac.join("mpi", store=ctx.store, name="g"))
    await expect("join no store", ac.join("gloo", name="g", master_addr=None))
    await expect("broadcast_state bad src", named.broadcast_state({}, src=5))
    t = torch.ones(1)
    await named.all_reduce(t)
    counts = [await named.waiting(), await named.waiting()]
    await plain.close()
    await named.close()
    return {
        "errors": errors,
        "sum": t.tolist(),
        "counts": counts,
        "name": named.name,
        "plain": plain.name,
    }


async def join_refused_and_timed_out(ctx: RankContext) -> dict:
    """A joiner asking for another backend is refused; one that nobody admits times out;
    neither is counted by waiting() afterwards."""
    if ctx.rank == 2:
        out = {}
        try:
            await ac.join("auto", store=ctx.store, name="g", timeout=30)
        except ac.InvalidArgument as exc:
            out["refused"] = str(exc)
        try:
            await ac.join("gloo", store=ctx.store, name="g", timeout=0.3)
        except ac.CollectiveTimeout as exc:
            out["timed_out"] = str(exc)
        ctx.store.set("joiner_done", "1")
        return out
    comm = await ac.init("gloo", rank=ctx.rank, world_size=2, store=ctx.store, name="g")
    if ctx.rank == 0:  # a ticket that ac.join did not write: refused, never counted, never fatal
        from asynccoll._bootstrap.room import Room

        room = Room(ctx.store, "g").store
        room.set(f"ticket/{room.add('tickets', 1)}", "not json")
    # The refused tickets are resolved by the first scan that sees them (rank 0's waiting()).
    seen = []
    while True:
        seen.append(await comm.waiting())
        done = torch.tensor([int(ctx.store.check(["joiner_done"]))])
        await comm.all_reduce(done, ac.ReduceOp.MIN)
        if done.item():
            break
        await anyio.sleep(0.01)
    after = await comm.waiting()
    await comm.close()
    return {"max_seen": max(seen), "after": after}


async def state_round_trip(comm: ac.Communicator, src: int) -> dict:
    """broadcast_state's structure, dtypes, aliasing and optimizer state, from ``src``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].weight = torch.nn.Parameter(torch.randn(2, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    shared = torch.arange(4.0)
    dense = torch.arange(12, dtype=torch.int16).reshape(3, 4)
    state = {
        "model": model.state_dict(),
        "opt": opt.state_dict(),
        "misc": [
            shared,
            shared,
            (torch.tensor(3.5), "text"),
            Point(torch.ones(2, dtype=torch.bfloat16), None),
        ],
        "dtypes": {
            "bool": torch.tensor([True, False]),
            "u16": torch.tensor([1, 2, 65535], dtype=torch.uint16),
            "c64": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64),
            "f16": torch.tensor([0.5, -2.0], dtype=torch.float16),
            "empty": torch.empty(0, 3),
            "strided": dense.t(),  # non-contiguous on the source
            "param": torch.nn.Parameter(torch.ones(2)),  # requires grad on the source
            "sparse": torch.eye(3).to_sparse(),  # not dense: pickled with the skeleton
        },
        "counts": collections.defaultdict(int, {"a": 1}),
        "step": 41,
    }
    got = await comm.broadcast_state(state if comm.rank == src else {"ignored": True}, src=src)
    if comm.rank == src:
        return {"same_object": got is state}
    # Load the received state into fresh objects, as a replacement process would.
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    fresh.load_state_dict(got["model"])
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    fresh_opt.load_state_dict(got["opt"])

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))

    model_ok = all(
        same(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values())
    )
    opt_state = [
        same(a, b)
        for s0, s1 in zip(opt.state_dict()["state"].values(), got["opt"]["state"].values())
        for a, b in zip(s0.values(), s1.values())
    ]
    d, g = state["dtypes"], got["dtypes"]
    return {
        "model": model_ok,
        "opt_state": opt_state,
        "param_groups": got["opt"]["param_groups"] == opt.state_dict()["param_groups"],
        "aliased": got["misc"][0] is got["misc"][1] and same(got["misc"][0], shared),
        "tuple": type(got["misc"][2]).__name__
        + ":"
        + str(got["misc"][2][1])
        + ":"
        + str(got["misc"][2][0].item()),
        "namedtuple": type(got["misc"][3]).__name__ == "Point"
        and same(got["misc"][3].x, state["misc"][3].x),
        "dtypes": {
            k: same(g[k], d[k].detach())
            if k != "sparse"
            else same(g[k].to_dense(), d[k].to_dense())
            for k in d
        },
        "param_grad": g["param"].requires_grad,
        "defaultdict": type(got["counts"]).__name__ + str(got["counts"]["missing"]),
        "step": got["step"],
        "order": list(got) == list(state),
    }


async def state_refused(comm: ac.Communicator) -> dict:
    """An unpicklable object in the source's state: InvalidArgument on every rank, comm usable."""
    state = {"w": torch.ones(3), "fn": lambda: 1} if comm.rank == 0 else None
    try:
        await comm.broadcast_state(state, src=0)
        error = None
    except ac.InvalidArgument as exc:
        error = str(exc)
    t = torch.ones(1)
    await comm.all_reduce(t)
    return {"error": error, "sum": t.tolist(), "state": comm.state}


async def joiner_takes_the_members_options(ctx: RankContext) -> dict:
    """The members run with check="fingerprint", heartbeat=0.5 and timeout=25; the joiner asks
    for none of them (its own timeout=30 bounds only its wait) and gets all three: a size
    mismatch on the joiner is a CollectiveMismatch everywhere."""
    if ctx.rank == 2:
        comm = await ac.join("gloo", store=ctx.store, name="g", timeout=30)
    else:
        old = await ac.init(
            "gloo",
            rank=ctx.rank,
            world_size=2,
            store=ctx.store,
            name="g",
            timeout=25,
            check="fingerprint",
            heartbeat=0.5,
        )
        comm = await _grow_when_waiting(old, 1)
    t = torch.ones(2)
    await comm.all_reduce(t)
    try:
        await comm.all_reduce(torch.ones(3 if comm.rank == 2 else 2))
        error = None
    except ac.CollectiveMismatch as exc:
        error = type(exc).__name__
    await comm.close()  # aborted by the mismatch: its liveness member leaves the worker
    return {"sum": t.tolist(), "error": error, "timeout": comm.timeout}


async def frozen_joiner_resumes_after_a_scan(ctx: RankContext) -> dict:
    """2 members; the joiner freezes the moment it is admitted (before it read its
    admission), so the grow fails. The members look at the room a few times (the scan
    passes its ticket), then resume it: it must get into their next grow."""
    import os
    import signal
    import time

    after = None
    if ctx.rank == 2:
        ctx.store.set("joiner-pid", str(os.getpid()))
        freeze_when_admitted(ctx.store)
        comm = await ac.join("gloo", store=ctx.store, name="g", timeout=60)
    else:
        old = await ac.init(
            "gloo", rank=ctx.rank, world_size=2, store=ctx.store, name="g", timeout=60
        )
        try:
            await _grow_when_waiting(old, 1)
            raise AssertionError("grow should have failed")
        except ac.PeerFailure:
            pass
        for _ in range(3):  # the room's scan passes the frozen joiner's ticket
            await old.waiting()
        await store_barrier(ctx.store, "scanned", 2, ctx.rank)
        start = time.monotonic()
        if ctx.rank == 0:
            os.kill(int(ctx.store.get("joiner-pid")), signal.SIGCONT)
        comm = await _grow_when_waiting(old, 1)
        after = time.monotonic() - start
    res = {"rank": comm.rank, "size": comm.world_size, "after": after}
    await comm.close()
    return res
