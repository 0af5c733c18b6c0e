"""The chaos soak's rank side (``bench/chaos.py`` is the driver): one random op stream, checked."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from datetime import timedelta
from typing import Any

HOST = "127.0.0.1"
#: Threads and open files a rank may hold above its first steady state: one
#: communicator's worth (its backend threads, a reaper parked in an aborted Gloo
#: group until Gloo's own timeout, sockets), since a shrink replaces one.
THREAD_SLACK = 8
FD_SLACK = 24


def _value(k: int, r: int) -> float:
    return float((k * 7 + r) % 97 + 1)


async def _op(comm: Any, k: int, rng: random.Random, deadline: float, check: list[str]) -> None:
    """One random operation of step ``k`` (the same on every rank), checked."""
    import torch

    import asynccoll as ac

    ws, r = comm.world_size, comm.rank
    vals = [_value(k, q) for q in range(ws)]
    kind = rng.choice(
        [
            "all_reduce",
            "all_reduce_max",
            "broadcast",
            "reduce",
            "all_gather",
            "reduce_scatter",
            "all_to_all",
            "gather",
            "scatter",
            "barrier",
            "ring",
            "batch",
            "object",
            "bcast_object",
            "big",
        ]
    )
    root = rng.randrange(ws)
    dtype = rng.choice([torch.float32, torch.float64, torch.int64])
    n = rng.choice([1, 7, 256])

    def full(size: int, v: float) -> Any:
        return torch.full((size,), v, dtype=dtype)

    def expect(ok: bool, what: str) -> None:
        if not ok:
            check.append(f"step {k} {kind} on rank {r} of {ws}: {what}")

    if kind == "all_reduce":
        t = full(n, vals[r])
        await comm.all_reduce(t, timeout=deadline)
        expect(bool((t == sum(vals)).all()), f"sum {t[0].item()} != {sum(vals)}")
    elif kind == "all_reduce_max":
        t = full(n, vals[r])
        await comm.all_reduce(t, ac.ReduceOp.MAX, timeout=deadline)
        expect(bool((t == max(vals)).all()), "max")
    elif kind == "broadcast":
        t = full(n, vals[r])
        await comm.broadcast(t, root, timeout=deadline)
        expect(bool((t == vals[root]).all()), "broadcast")
    elif kind == "reduce":
        t = full(n, vals[r])
        await comm.reduce(t, root, timeout=deadline)
        if r == root:
            expect(bool((t == sum(vals)).all()), "reduce")
    elif kind == "all_gather":
        out = torch.zeros(n * ws, dtype=dtype)
        await comm.all_gather(out, full(n, vals[r]), timeout=deadline)
        expect(out.tolist() == [v for v in vals for _ in range(n)], "all_gather")
    elif kind == "reduce_scatter":
        out = torch.zeros(n, dtype=dtype)
        await comm.reduce_scatter(out, full(n * ws, vals[r]), timeout=deadline)
        expect(bool((out == sum(vals)).all()), "reduce_scatter")
    elif kind == "all_to_all":
        inp = torch.tensor([vals[r] * 100 + i for i in range(ws)], dtype=torch.float64)
        out = torch.zeros(ws, dtype=torch.float64)
        await comm.all_to_all(out, inp, timeout=deadline)
        expect(out.tolist() == [vals[q] * 100 + r for q in range(ws)], "all_to_all")
    elif kind == "gather":
        out = torch.zeros(n * ws, dtype=dtype) if r == root else None
        await comm.gather(full(n, vals[r]), root, out, timeout=deadline)
        if out is not None:
            expect(out.tolist() == [v for v in vals for _ in range(n)], "gather")
    elif kind == "scatter":
        out = torch.zeros(n, dtype=dtype)
        inp = torch.cat([full(n, v) for v in vals]) if r == root else None
        await comm.scatter(out, root, inp, timeout=deadline)
        expect(bool((out == vals[r]).all()), "scatter")
    elif kind == "barrier":
        await comm.barrier(timeout=deadline)
    elif kind == "ring":
        got = torch.zeros(3, dtype=dtype)
        send = comm.send(full(3, vals[r]), (r + 1) % ws, timeout=deadline)
        recv = comm.recv(got, (r - 1) % ws, timeout=deadline)
        await send
        await recv
        expect(bool((got == vals[(r - 1) % ws]).all()), "ring")
    elif kind == "batch":
        ts = [full(n, vals[r]), torch.full((5,), vals[r], dtype=torch.float64), full(2, vals[r])]
        async with comm.coalescing():
            for t in ts:
                comm.all_reduce(t, timeout=deadline)
        expect(all(bool((t == sum(vals)).all()) for t in ts), "coalesced batch")
    elif kind == "object":
        got = await comm.all_gather_object({"r": r, "k": k}, timeout=deadline)
        expect(got == [{"r": q, "k": k} for q in range(ws)], "all_gather_object")
    elif kind == "bcast_object":
        got = await comm.broadcast_object(
            ("x", k, root) if r == root else None, root, timeout=deadline
        )
        expect(got == ("x", k, root), "broadcast_object")
    elif kind == "big":
        t = torch.full((1 << 18,), vals[r])
        await comm.all_reduce(t, timeout=deadline)
        expect(bool((t == sum(vals)).all()), "1 MB all_reduce")


def _resources() -> tuple[int, int]:
    try:
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        fds = 0
    return threading.active_count(), fds


# ------------------------------------------------------------------ elastic state
GROUP = "chaos"
#: Members look for waiting joiners every this many steps (``waiting()`` is a collective).
WAIT_EVERY = 10
#: How long a replacement waits to be admitted (the members admit at their next
#: ``waiting()`` once they have recovered from whatever is going on).
JOIN_TIMEOUT = 60.0


def _state(seed: int, gen: int, epoch: int, sizes: list[int]) -> dict[str, Any]:
    """What every member holds at membership epoch ``epoch`` (the stand-in for a model and
    its optimizer state): a function of the epoch, so a receiver can check it whole."""
    import torch

    base = float((seed * 1000 + gen * 100 + epoch) % 4093)
    return {
        "epoch": epoch,
        "sizes": list(sizes),  # the world size of every epoch so far
        "w": torch.arange(1 << 16, dtype=torch.float64) + base,
        "opt": {"step": torch.tensor(epoch), "m": torch.full((3, 5), base, dtype=torch.float32)},
    }


def _state_errors(got: Any, seed: int, gen: int) -> list[str]:
    """What is wrong with a received state (it must be exactly ``_state`` of its epoch)."""
    import torch

    try:
        want = _state(seed, gen, int(got["epoch"]), list(got["sizes"]))
        if not torch.equal(got["w"], want["w"]) or not torch.equal(
            got["opt"]["m"], want["opt"]["m"]
        ):
            return [f"state of epoch {got['epoch']} arrived with other tensors"]
        if int(got["opt"]["step"]) != got["epoch"] or len(got["sizes"]) != got["epoch"] + 1:
            return [
                f"state of epoch {got['epoch']} arrived inconsistent: {got['opt']['step']}, {got['sizes']}"
            ]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return [f"state arrived malformed: {exc!r}"]
    return []


async def _sync(
    comm: Any, state: dict[str, Any] | None, seed: int, gen: int, deadline: float, check: list[str]
) -> dict[str, Any]:
    """After every membership change: the members that hold the state must agree on it,
    and the lowest such rank sends it to everyone (joiners included) with ``broadcast_state``."""
    mine = state["epoch"] if state is not None else None
    epochs = await comm.all_gather_object(mine, timeout=deadline)
    held = [q for q, e in enumerate(epochs) if e is not None]
    if len({epochs[q] for q in held}) > 1:
        check.append(f"members disagree on the state after a membership change: epochs {epochs}")
    if not held:  # every holder died before a joiner got it: start over (not a violation)
        return _state(seed, gen, 0, [comm.world_size])
    src = held[0]
    got = await comm.broadcast_state(
        state if comm.rank == src else None, src=src, timeout=2 * deadline
    )
    check += _state_errors(got, seed, gen)
    return dict(got)


def _next(state: dict[str, Any], seed: int, gen: int, world_size: int) -> dict[str, Any]:
    """The state after a membership change (shrink or grow) to ``world_size`` ranks."""
    return _state(seed, gen, state["epoch"] + 1, [*state["sizes"], world_size])


# ---------------------------------------------------------------------- the rank
async def _until(coro: Any, stop: asyncio.Event) -> Any:
    """``coro``'s result, or None once ``stop`` is set first (``coro`` is then cancelled)."""
    task = asyncio.ensure_future(coro)
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not task.done():
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return None
    return task.result()


async def _rank(
    gen: int, idx: int, world: int, port: int, seed: int, deadline: float, joiner: bool, conn: Any
) -> None:
    """Process ``idx`` of generation ``gen``: one of its ``world`` first members, or a
    replacement (``joiner``) that joins the group with ``ac.join`` and gets the state."""
    import torch.distributed as dist

    import asynccoll as ac

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_reader(conn.fileno(), stop.set)  # any message from the driver: finish
    send_lock = threading.Lock()

    def send(*msg: Any) -> None:
        with send_lock:
            conn.send(msg)

    holder: list[Any] = [None]

    def abort() -> (
        None
    ):  # only a member has a communicator to abort (the driver aborts members only)
        if holder[0] is not None:
            holder[0].abort("chaos: aborted by the driver")

    loop.add_signal_handler(signal.SIGUSR1, abort)
    long = max(
        15.0, 3 * deadline
    )  # creation, shrink's agreement, rebuilds and grows: more than one op
    client = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=60))
    store = dist.PrefixStore(f"chaos/{gen}", client)
    state: dict[str, Any] | None
    if joiner:
        send("started", idx, os.getpid())
        t0 = time.monotonic()
        try:
            comm = await _until(
                ac.join("gloo", store=store, name=GROUP, timeout=JOIN_TIMEOUT), stop
            )
        except ac.CollectiveTimeout as exc:
            send("join_timeout", idx, f"{time.monotonic() - t0:.1f} s: {exc}")
            return
        if comm is None:  # the driver finished meanwhile
            send("done", idx, 0)
            return
        state, need_sync = None, True
        send("joined", idx, time.time(), comm.rank, comm.world_size)
    else:
        comm = await ac.init(
            "gloo", rank=idx, world_size=world, store=store, timeout=long, name=GROUP
        )
        state, need_sync = _state(seed, gen, 0, [world]), False
        send("ready", idx, os.getpid())
    holder[0] = comm
    ops, k = 0, 0
    baseline: tuple[int, int] | None = None
    errors: list[str] = []
    failed_at: float | None = None  # set by a failure, cleared by the first op after the recovery
    joint = joiner  # report the first op after joining
    grew = False  # the first op after a grow
    # Compare the threads and fds with the baseline 50 ops into a recovered or grown
    # communicator, as the baseline itself was taken: at the first op, the replaced
    # group's threads may still be on their way out (a Gloo wait stranded by the abort
    # returns when its peer's socket closes): seen once at load 6, fds 22 -> 47 and
    # threads 7 -> 9 at the first op. A leak grows with every recovery, and is caught there.
    check_at: int | None = None
    last_report = time.monotonic()

    #: The call under way: what it is, when it began, the longest it may wait. A step may
    #: make two calls (waiting(), then an op or a grow): each is held to its own bound.
    phase: list[Any] = ["op", 0.0, deadline]

    def begin(what: str, limit: float) -> None:
        phase[:] = [what, time.monotonic(), limit]

    async def step() -> str:
        """One step: the state sync after a membership change, a look for joiners (and a
        grow), or one random op; what it was."""
        nonlocal comm, state, need_sync, k, grew
        if need_sync:
            begin(
                "sync", 3 * deadline
            )  # an all_gather_object, then broadcast_state within 2 x deadline
            state = await _sync(comm, state, seed, gen, deadline, errors)
            need_sync, k = False, 0
            return "sync"
        assert state is not None
        # (not at k == 0: the first step after a membership change is an op, which ends a recovery)
        if comm.world_size == 1 or k % WAIT_EVERY == WAIT_EVERY - 1:
            begin("waiting", deadline)
            waiting = await comm.waiting(timeout=deadline)
            size = min(world, comm.world_size + waiting)
            if size > comm.world_size:
                old, leader = comm.world_size, comm.rank == 0
                begin("grow", 2 * long)  # the admission and the assembly, each within the timeout
                try:
                    comm = holder[0] = await comm.grow(size, timeout=long)
                except (ac.CommAborted, ac.CollectiveTimeout) as exc:
                    if leader:  # one report per failed grow (every member sees the same outcome)
                        send("grow_failed", idx, f"{old} -> {size}: {type(exc).__name__}: {exc}")
                    if comm.state == "aborted":  # a member died in it: shrink as after any failure
                        raise
                    k += 1  # (every member saw the same outcome) go on with the old communicator
                    return "grow"
                if comm.rank == 0:
                    send("grew", idx, time.time(), old, size)
                state, need_sync, grew = _next(state, seed, gen, size), True, True
                return "grow"
            if comm.world_size == 1:  # a lone survivor: nobody to talk to until a joiner comes
                await asyncio.sleep(0.05)
                return "idle"
        rng = random.Random(hash((seed, gen, state["epoch"], k, comm.world_size)))
        begin(f"op {k}", deadline)
        await _op(comm, k, rng, deadline, errors)
        return "op"

    while not stop.is_set():
        try:
            what = await step()
        except (ac.CommAborted, ac.CollectiveTimeout) as exc:
            waited = time.monotonic() - phase[1]
            if (
                waited > phase[2] + 1.0
            ):  # the driver excuses it if this rank was the one frozen meanwhile
                send(
                    "long_wait",
                    idx,
                    time.time() - waited,
                    time.time(),
                    f"{waited:.2f} s in {phase[0]}, bound {phase[2]:g} s ({type(exc).__name__})",
                )
            failed_at = time.time()
            send(
                "failed", idx, type(exc).__name__, list(getattr(exc, "ranks", ()) or ()), failed_at
            )
            try:
                new = await comm.shrink()
            except (
                ac.AsyncCollError
            ) as exc2:  # left out by the others (frozen too long), or all gone
                send("left", idx, f"{type(exc2).__name__}: {exc2}")
                break
            await comm.close()
            comm = holder[0] = new
            if state is not None:
                state = _next(state, seed, gen, comm.world_size)
            need_sync, k = True, 0
            continue
        waited = time.monotonic() - phase[1]
        if waited > phase[2] + 1.0:
            send(
                "long_wait",
                idx,
                time.time() - waited,
                time.time(),
                f"{waited:.2f} s in {phase[0]}, bound {phase[2]:g} s",
            )
        if what == "idle" and failed_at is not None:  # recovered to a lone survivor: nothing to run
            send("recovered", idx, time.time(), comm.world_size, comm.rank, *_resources())
            failed_at = None
        if what != "op":
            continue
        ops += 1
        k += 1
        if joint:
            send("joint", idx, time.time(), comm.world_size)
            joint = False
        if failed_at is not None or grew:  # the first op on a new communicator: recovered, or grown
            if failed_at is not None:
                send("recovered", idx, time.time(), comm.world_size, comm.rank, *_resources())
            failed_at, grew = None, False
            check_at = k + 49
        elif baseline is None and k == 50:
            baseline = _resources()
        elif check_at is not None and k == check_at:
            check_at = None
            threads, fds = _resources()
            if baseline is not None and (
                threads > baseline[0] + THREAD_SLACK or fds > baseline[1] + FD_SLACK
            ):
                errors.append(
                    f"resources grew: threads {baseline[0]} -> {threads}, fds {baseline[1]} -> {fds}"
                )
        if len(comm.flight_record()) > 4096:
            errors.append(f"flight record of {len(comm.flight_record())} ops")
        if errors:
            send("violation", idx, errors[:])
            errors.clear()
        if time.monotonic() - last_report > 0.5:
            send("ops", idx, ops)
            last_report = time.monotonic()
        await asyncio.sleep(0)
    if errors:
        send("violation", idx, errors[:])
    send("ops", idx, ops)
    await comm.close()
    send("done", idx, ops)


def _rank_main(
    gen: int, idx: int, world: int, port: int, seed: int, deadline: float, joiner: bool, conn: Any
) -> None:
    try:
        asyncio.run(_rank(gen, idx, world, port, seed, deadline, joiner, conn))
    except BaseException as exc:  # noqa: BLE001 - reported to the driver whatever it is, then exit non-zero
        import traceback

        try:
            conn.send(("crashed", idx, "".join(traceback.format_exception(exc))))
        finally:
            os._exit(3)
