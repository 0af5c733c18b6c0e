"""Assembling a grown group: every participant builds the new communicator under a
watch, and all of them follow one outcome (see ``elastic.py``, step 2).

The watch is a :class:`~asynccoll._faults.liveness.Liveness` of the new group
(heartbeats confirmed by the census, as for any communicator) under
``gen/<g>/watch``, plus a look at the process table: a participant on this machine
whose process is gone is named at once, from the record its watch published or,
for a joiner that died before its watch started, from its ticket.

The outcome is the key ``gen/<g>/outcome``, first writer wins: ``ok`` once every
participant announced ``built/<rank>``, ``failed|<ranks>|<why>`` as soon as one of
them sees a death or a failed build.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any, Awaitable, Callable

import anyio
import anyio.to_thread
import torch.distributed as dist

from .._base.errors import AsyncCollError, CommAborted, PeerFailure
from .._base.storekeys import peek
from .._core.communicator import Communicator
from .._faults.census import decode_ranks, encode_ranks
from .._faults.liveness import Liveness
from .._faults.service import unlist_ranks
from .rendezvous import drop_keys, drop_namespace, off_loop, sole_prefix
from .room import Room, gone

#: How often a participant looks at the outcome, its news and the process table.
_TICK = 0.003
#: The outcome of a grow that everyone built.
OK = "ok"
#: Where the grown communicator is built, under ``gen/<g>/``.
BUILD = "comm"


class _Assembly:
    """One participant's view of grow ``g`` (blocking methods run off the loop)."""

    def __init__(
        self, room: Room, g: int, rank: int, size: int, joiners: dict[int, int], watch: Liveness
    ) -> None:
        self.gen = room.generation(g)
        self.room = room
        self.rank = rank
        self.size = size
        self.joiners = joiners  # new rank -> ticket
        self.watch = watch
        self.records: dict[int, dict[str, Any]] = {}
        self.announced = False

    def _known(self) -> dict[int, dict[str, Any]]:
        """Each other participant's process identity, as far as published."""
        for r, ticket in self.joiners.items():
            if r != self.rank and r not in self.records:
                raw = peek(self.room.store, f"ticket/{ticket}")
                if raw is not None:
                    self.records[r] = json.loads(raw)
        for r, peer in self.watch.peers().items():
            self.records[r] = {"machine": peer.machine, "pid": peer.pid, "start": peer.start}
        return self.records

    def step(self, built: bool, verdict: str | None) -> str | None:
        """Record our news, read or settle the outcome; None while undecided."""
        gen = self.gen
        if verdict is None:
            dead = [r for r, record in self._known().items() if gone(record)]
            if dead:
                verdict = f"failed|{encode_ranks(dead)}|process of rank(s) {dead} is gone"
        if verdict is not None:
            return bytes(gen.compare_set("outcome", "", verdict)).decode()
        if built and not self.announced:
            gen.set(f"built/{self.rank}", "1")
            self.announced = True
        outcome = peek(gen, "outcome")
        if outcome is not None:
            return outcome
        if self.announced and gen.check([f"built/{r}" for r in range(self.size)]):
            return bytes(gen.compare_set("outcome", "", OK)).decode()
        return None

    def leave(self, outcome: str) -> None:
        """This participant is done with the grow's keys (see :func:`leave_grow`)."""
        leave_grow(
            self.room, self.gen, self.rank, self.size, self.joiners, outcome, self.watch.probe
        )


def leave_grow(
    room: Room,
    gen: Any,
    rank: int,
    size: int,
    joiners: dict[int, int],
    outcome: str,
    probe: Callable[[list[int]], Any],
) -> None:
    """Participant ``rank`` of a grow (its generation's store ``gen``) is done with the
    grow's keys: the last of the participants deletes them.

    Its plan, outcome and ``built/`` marks, the watch's keys, the joiners' ticket
    records; and when the grow failed, the keys of the grown communicator that nobody
    keeps (under ``gen/<g>/comm/``): what its creation wrote before it was given up
    (each rank's options, Gloo addresses, the give-up mark), and all of it where the
    creation had ended but the outcome is a failure (ranks that died or were left
    unproven never count themselves out of it). Every participant has read the outcome (rank 0 that called the grow off
    wrote it) and said goodbye on its watch before it counts itself here. The ranks
    the outcome names failed whose processes are gone (``probe``; a stopped one may
    resume and read the keys: it counts itself then) never count themselves: the last
    of the others deletes the keys, and unlists their processes' liveness services
    (``unlist_ranks``). The tickets' ``admit`` marks stay: the room's scan deletes them
    once they fall out of its window behind ``resolved`` (``Room.scan``).
    """
    _, ranks, _ = (outcome.split("|", 2) + ["", ""])[:3]
    named = [r for r in decode_ranks(ranks) if r != rank] if ranks not in ("", "-") else []
    dead = list(probe(named)) if named else []
    if int(gen.add("left", 1)) < size - len(dead):
        return
    for key in ("plan", "outcome", "left", *(f"built/{r}" for r in range(size))):
        gen.delete_key(key)
    watch = dist.PrefixStore("watch", gen)
    unlist_ranks(watch, dead)  # (before drop_keys: it reads proc/<r>)
    drop_keys(watch, size)
    if outcome != OK:
        drop_namespace(dist.PrefixStore(BUILD, gen), sole_prefix(size, room.name), size)
    for ticket in joiners.values():
        room.store.delete_key(f"ticket/{ticket}")


async def assemble(
    room: Room,
    g: int,
    rank: int,
    size: int,
    joiners: dict[int, int],
    interval: float,
    timeout: float,
    build: Callable[[Any], Awaitable[Communicator]],
) -> Communicator:
    """Build grow ``g``'s communicator (rank ``rank`` of ``size``) under the watch.

    ``joiners``: the new ranks' tickets. Returns the communicator once every
    participant has built theirs; raises ``PeerFailure`` (the failed ranks, numbered
    as in the grown group) when a participant died, or ``CommAborted`` when a build
    failed otherwise, on every participant alike.
    """
    news: list[BaseException] = []
    watch = Liveness(
        dist.PrefixStore("watch", room.generation(g)),
        rank,
        size,
        interval=interval,
        detect=True,
    )
    await off_loop(watch.publish, timeout, "grow")
    watch.start(news.append)
    view = _Assembly(room, g, rank, size, joiners, watch)
    built: list[Communicator] = []
    errors: list[BaseException] = []
    try:
        outcome = await _race(view, timeout, news, build, built, errors)
        if outcome != OK:
            # Nobody keeps the new group. Closed before this participant counts itself
            # out of the grow: the last one out deletes the group's keys (``leave_grow``),
            # after every write of the others to them.
            for comm in built:
                comm.abort("grow failed on another rank")
                with anyio.CancelScope(shield=True):
                    await comm.close()
        try:  # the outcome holds whatever happens to the cleanup
            await off_loop(watch.goodbye, timeout, "grow")
            await off_loop(functools.partial(view.leave, outcome), timeout, "grow")
        except AsyncCollError:  # the store failed meanwhile (off_loop's types): its keys stay
            pass
    finally:
        watch.stop()
    if outcome == OK:
        return built[0]
    _, ranks, why = outcome.split("|", 2)
    failed = decode_ranks(ranks) if ranks != "-" else ()
    if failed:
        raise PeerFailure(f"grow: rank(s) {list(failed)} of the grown group failed: {why}", failed)
    error = CommAborted(f"grow: building the grown group failed: {why}")
    if errors:
        raise error from errors[0]
    raise error


async def _race(
    view: _Assembly,
    timeout: float,
    news: list[BaseException],
    build: Callable[[Any], Awaitable[Communicator]],
    built: list[Communicator],
    errors: list[BaseException],
) -> str:
    """Build while watching; the agreed outcome (``ok`` or ``failed|<ranks>|<why>``)."""
    deadline = time.monotonic() + timeout

    async def run() -> None:
        try:
            # A connection of its own: Gloo's constructor blocks in the store client
            # while it waits for peers, and the watch must keep talking meanwhile.
            prefixed: Any = dist.PrefixStore(BUILD, view.gen)
            store = await off_loop(prefixed.clone, timeout, "store")
            built.append(await build(store))
        except Exception as exc:  # noqa: BLE001 - becomes the agreed outcome below
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        while True:
            verdict: str | None = None
            if news:
                verdict = _failure(news[0])
            elif errors:
                verdict = await _explain(errors[0], view.watch)
            elif time.monotonic() > deadline:
                verdict = f"failed|-|not every rank arrived within {timeout} s"
            step = functools.partial(view.step, bool(built), verdict)
            outcome = await anyio.to_thread.run_sync(step, abandon_on_cancel=True)
            if outcome is not None:
                tg.cancel_scope.cancel()  # a build still blocked ends at its own timeout
                return str(outcome)
            await anyio.sleep(_TICK)
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns


def _failure(error: BaseException) -> str:
    ranks = encode_ranks(error.ranks) if isinstance(error, PeerFailure) and error.ranks else "-"
    return f"failed|{ranks}|{error}"


async def _explain(error: BaseException, watch: Liveness) -> str:
    """A failed build as an outcome; a peer failure without ranks is named by the census."""
    if isinstance(error, PeerFailure) and not error.ranks:
        ranks = await anyio.to_thread.run_sync(watch.census, abandon_on_cancel=True)
        if ranks:
            return f"failed|{encode_ranks(ranks)}|{error}"
    return _failure(error)
