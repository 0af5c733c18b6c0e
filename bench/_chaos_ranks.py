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

from bench._chaos_ops import run_op
from bench._chaos_split import SPLIT_EVERY, Subgroup
from bench._chaos_train import TRAIN_EVERY, Trainer, in_step, pick_source

HOST = "127.0.0.1"
#: Threads and open files a rank may hold above its first steady state: one
#: communicator's worth (its backend threads, a reaper parked in an aborted Gloo
#: group until Gloo's own timeout, sockets), since a shrink replaces one.
THREAD_SLACK = 8
FD_SLACK = 24


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
    comm: Any,
    state: dict[str, Any] | None,
    trainer: Trainer,
    seed: int,
    gen: int,
    deadline: float,
    check: list[str],
) -> dict[str, Any]:
    """After every membership change: the members that hold the state must agree on it,
    and the one furthest on in training (the lowest such rank) sends it, with the model and
    the optimizer's state, to everyone (joiners included) with ``broadcast_state``; then
    every rank's parameters must be bit-equal."""
    mine = (state["epoch"], *trainer.held()) if state is not None else None
    everyone = await comm.all_gather_object(mine, timeout=deadline)
    held = [q for q, e in enumerate(everyone) if e is not None]
    if len({everyone[q][0] for q in held}) > 1:
        check.append(f"members disagree on the state after a membership change: {everyone}")
    src = pick_source([None if e is None else (e[1], e[2]) for e in everyone], check)
    if src is None:  # every holder died before a joiner got it: start over (not a violation)
        trainer.load(Trainer(seed, gen).snapshot())
        return _state(seed, gen, 0, [comm.world_size])
    outgoing = {**state, "train": trainer.snapshot()} if comm.rank == src and state else None
    got = dict(await comm.broadcast_state(outgoing, src=src, timeout=2 * deadline))
    trainer.load(got.pop("train"))
    check += _state_errors(got, seed, gen)
    await in_step(comm, trainer, deadline, check, "after the state sync")
    return got


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


def in_step_bound(deadline: float) -> float:
    """How long a replacement may take from its admission to its first training step in
    step with the members, checked: the state sync, the split, one training step and the
    check, each within its own bound."""
    return 4 * deadline + 2 * _long(deadline) + deadline + 1.0


def _long(deadline: float) -> float:
    """Creation, shrink's agreement, rebuilds, grows, splits and training steps (on
    ``GradSync``'s all-reduces, which take the communicator's timeout): more than one op."""
    return max(15.0, 3 * deadline)


async def _rank(
    gen: int,
    idx: int,
    world: int,
    port: int,
    seed: int,
    deadline: float,
    joiner: bool,
    split: bool,
    conn: Any,
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
    long = _long(deadline)
    client = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=60))
    store = dist.PrefixStore(f"chaos/{gen}", client)
    state: dict[str, Any] | None
    errors: list[str] = []
    trainer = Trainer(seed, gen)
    sub = Subgroup(split)
    slack = 2 if split else 1  # a membership change replaces two communicators with the pair
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
        holder[0] = comm
    else:
        comm = await ac.init(
            "gloo", rank=idx, world_size=world, store=store, timeout=long, name=GROUP
        )
        state, need_sync = _state(seed, gen, 0, [world]), False
        holder[0] = comm
        trainer.attach(comm)
        await sub.remake(comm, errors)
        send("ready", idx, os.getpid())
    ops, k = 0, 0
    baseline: tuple[int, int] | None = None
    failed_at: float | None = None  # set by a failure, cleared by the first op after the recovery
    joint = joiner  # report the first op after joining
    grew = False  # the first op after a grow
    need_split = False  # after a state sync: split the new communicator into pairs
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
        nonlocal comm, state, need_sync, need_split, k, grew
        if need_sync:
            # two all_gather_objects, and broadcast_state within 2 x deadline
            begin("sync", 4 * deadline)
            state = await _sync(comm, state, trainer, seed, gen, deadline, errors)
            trainer.attach(comm)
            need_sync, need_split, k = False, True, 0
            return "sync"
        if need_split:
            begin("split", long)
            await sub.remake(comm, errors)
            need_split = False
            return "split"
        assert state is not None
        # (not at k == 0: the first step after a membership change is an op, which ends a recovery)
        if comm.world_size == 1 or k % WAIT_EVERY == WAIT_EVERY - 1:
            begin("waiting", deadline)
            waiting = await comm.waiting(timeout=deadline)
            size = min(world, comm.world_size + waiting)
            if size > comm.world_size:
                old, leader, grow_at = comm.world_size, comm.rank == 0, time.time()
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
                state, need_sync, grew = _next(state, seed, gen, size), True, True
                if comm.rank == 0:
                    send("grew", idx, time.time(), old, size, grow_at, state["epoch"])
                return "grow"
            if comm.world_size == 1:  # a lone survivor: nobody to talk to until a joiner comes
                await asyncio.sleep(0.05)
                return "idle"
        if k % TRAIN_EVERY == 0:  # (the first step on a new communicator is one)
            begin(f"training step {trainer.step}", long)
            await trainer.train(comm)
            if k == 0:  # every rank's parameters bit-equal after a membership change
                begin("in-step check", deadline)
                when = "after the first training step on a new communicator"
                if await in_step(comm, trainer, deadline, errors, when):
                    send("in_step", idx, time.time(), state["epoch"], comm.world_size, trainer.step)
            return "op"
        if k % SPLIT_EVERY == 2 and sub.sub is not None:
            begin(f"subgroup op {k}", deadline)
            await sub.exercise(k, deadline, errors)
            return "op"
        rng = random.Random(hash((seed, gen, state["epoch"], k, comm.world_size)))
        begin(f"op {k}", deadline)
        await run_op(comm, k, rng, deadline, errors)
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
            trainer.detach()
            send(
                "failed",
                idx,
                type(exc).__name__,
                list(getattr(exc, "ranks", ()) or ()),
                failed_at,
                f"{type(exc).__name__} after {waited:.2f} s in {phase[0]}: {str(exc)[:160]}",
            )
            # A pair partner may wait in a subgroup op for this rank, which has left the op
            # order: abort the pair, so that it hears (as news) rather than at its deadline.
            # A peer that died in the pair is excluded from the world by name: the world may
            # not know yet, and a shrink without it waits out the grace for its proposal.
            lost = sub.world_ranks(exc) if phase[0].startswith("subgroup") else []
            sub.abort(f"chaos: {type(exc).__name__} in {phase[0]}")
            try:
                new = await comm.shrink(lost or None)
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
                threads > baseline[0] + slack * THREAD_SLACK or fds > baseline[1] + slack * FD_SLACK
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
            send("ops", idx, ops, trainer.step, sub.ops, sub.made)
            last_report = time.monotonic()
        await asyncio.sleep(0)
    if errors:
        send("violation", idx, errors[:])
    send("ops", idx, ops, trainer.step, sub.ops, sub.made)
    trainer.close()
    await sub.close()
    await comm.close()
    send("done", idx, ops)


def _rank_main(
    gen: int,
    idx: int,
    world: int,
    port: int,
    seed: int,
    deadline: float,
    joiner: bool,
    split: bool,
    conn: Any,
) -> None:
    try:
        asyncio.run(_rank(gen, idx, world, port, seed, deadline, joiner, split, conn))
    except BaseException as exc:  # noqa: BLE001 - reported to the driver whatever it is, then exit non-zero
        import traceback

        try:
            conn.send(("crashed", idx, "".join(traceback.format_exception(exc))))
        finally:
            os._exit(3)
