"""Elastic membership: ``ac.join``, ``comm.waiting()``, ``comm.grow(n)``.

A communicator made with ``ac.init(..., name=)`` carries a :class:`Group`: the name,
the store the group met on (joiners reach the same one), and the options its
communicators are built with. ``shrink()`` and ``grow()`` hand it on, so a
replacement can join a group that has shrunk. The store keys are in ``room.py``.

A grow, on the members (every member calls ``grow`` at the same point):

1. **Admission**, on the old communicator: rank 0 admits the first ``k`` live
   tickets (``Room.admit``) and broadcasts the grow's number ``g`` to the other
   members, an 8-byte broadcast that the old communicator's own failure detection
   covers. While too few joiners wait, rank 0 broadcasts "not yet" about once a
   second (so no member sits in one collective for long), and "timed out" at the
   deadline (the old communicator is left as it was).
2. **Assembly** (:func:`assemble`), on every participant, members and joiners: a
   liveness watch of the new group (heartbeats and census, the same machinery as
   any communicator's, under ``gen/<g>/watch``) runs while the new communicator is
   built under ``gen/<g>/``. The outcome is one store key, first writer wins:
   ``ok`` once every participant has built, or ``failed|<ranks>|<why>`` as soon as
   anyone sees a participant die or its build fail. Every participant follows the
   outcome, so they all end with the new communicator or all without it.
   With NCCL, each participant first does its part of the native grow on the same
   store (members: ``Backend.grow_agreed``, ``ncclCommGrow`` of the old communicator
   where every member can; joiners: ``Factories.nccl_join`` with the grow's unique
   id), and the new communicator takes that backend instead of a fresh NCCL init;
   where a member cannot grow, everyone builds a fresh one.

A member whose grow failed because another member died finds the old communicator
aborted with ``PeerFailure`` (those ranks), ready for ``shrink()``; if only
joiners died, the old communicator is untouched (still usable; ``shrink()`` works
too). A joiner whose grow failed takes a new ticket and waits again, within its
``timeout``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from typing import Any, Awaitable, Callable

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist

from .._base.aio import run_in_thread
from .._base.errors import (
    CollectiveTimeout,
    CommAborted,
    CommClosed,
    InvalidArgument,
    PeerFailure,
    is_abort_error,
)
from .._core import validate
from .._core.backend import Backend
from .._core.communicator import Communicator
from .args import check_args, env_int
from .assembly import assemble, leave_grow
from .build import REAL, Factories, build_communicator
from .rendezvous import off_loop
from .room import REFUSED, WITHDRAWN, Room
from .stores import STORES, tcp_store

#: Rank 0's longest wait for joiners inside one admission round (the other members
#: wait in a broadcast meanwhile).
_ROUND = 1.0
_NOT_YET, _TIMED_OUT, _FAILED = 0, -1, -2


@dataclasses.dataclass(frozen=True)
class Options:
    """How a group's communicators are built (joiners take the members')."""

    backend: str
    timeout: float
    check: str | None
    heartbeat: float | None
    trace_dir: str | None
    device: Any = None
    #: How this process makes its backends (``build.Factories``; each process its own).
    factories: Factories = REAL

    def shared(self) -> dict[str, Any]:
        """What a joiner adopts (the device stays each process's own)."""
        return {
            "backend": self.backend,
            "timeout": self.timeout,
            "check": self.check,
            "heartbeat": self.heartbeat,
            "trace_dir": self.trace_dir,
        }

    def watch_interval(self) -> float:
        """Heartbeat interval of the assembly's watch (the group's own, else its backend's default)."""
        if self.heartbeat:
            return self.heartbeat
        return 1.0 if self.backend == "nccl" else 0.25


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not name or "/" in name:
        raise InvalidArgument(f"name must be a non-empty str without '/', got {name!r}")
    return name


@dataclasses.dataclass(frozen=True)
class Group:
    """A named group: what a communicator needs for ``waiting()`` and ``grow()``.

    ``root``: the store the group met on (None until the first rendezvous binds it);
    ``key``: its entry in the process's store cache, if it came from there.
    """

    name: str
    options: Options
    root: Any = None
    key: tuple[str, int] | None = None

    def bound(self, root: Any, key: tuple[str, int] | None) -> Group:
        """This group on ``root`` (the first communicator's store), unless already bound."""
        return self if self.root is not None else dataclasses.replace(self, root=root, key=key)

    @property
    def room(self) -> Room:
        return Room(self.root, self.name)

    # ------------------------------------------------------------------ waiting
    async def waiting(self, comm: Communicator, timeout: float | None) -> int:
        """See ``Communicator.waiting``."""
        limit = validate.timeout(timeout, comm.timeout) if timeout is not None else comm.timeout
        count, error = 0, None
        if comm.rank == 0:
            try:
                live = await off_loop(
                    functools.partial(self.room.scan, self.options.backend), limit, "waiting"
                )
                count = len(live)
            except Exception as exc:  # noqa: BLE001 - raised below as the cause, after the others are told
                count, error = _FAILED, exc
        count = await _share(comm, count, limit)
        if count < 0:
            raise CommAborted(
                "waiting(): rank 0 could not read the group's waiting room"
            ) from error
        return count

    # --------------------------------------------------------------------- grow
    async def grow(
        self, comm: Communicator, world_size: Any, timeout: float | None
    ) -> Communicator:
        """See ``Communicator.grow``."""
        size = _size(world_size, comm.world_size)
        limit = validate.timeout(timeout, comm.timeout) if timeout is not None else comm.timeout
        if comm.state == "closed":
            raise CommClosed("cannot grow a closed communicator")
        if comm.state == "aborted":
            raise CommAborted(
                f"cannot grow an aborted communicator (shrink it first): {comm.error}"
            )
        cuda = comm.backends.get("cuda")
        g = await self._admission(comm, size, limit, cuda is not None)
        opts = self.options

        native = None
        if cuda is not None:  # Backend.grow_agreed: ncclCommGrow where every member can, else None
            native = functools.partial(_grow_native, cuda, size, limit)
        build = functools.partial(
            _build_at, opts, self, comm.rank, size, opts.device, opts.trace_dir, native
        )
        try:
            joiners = await off_loop(functools.partial(self.room.joiners, g), limit, "grow")
            new = await assemble(
                self.room, g, comm.rank, size, joiners, opts.watch_interval(), limit, build
            )
        except PeerFailure as exc:
            lost = [r for r in exc.ranks if r < comm.world_size]
            if lost:  # members died: the old communicator is broken, ready for shrink()
                failure = PeerFailure(f"grow to {size} ranks failed: {exc}", lost)
                failure.__cause__ = exc
                comm.ledger.abort(failure)
            raise
        except BaseException as exc:
            comm.ledger.abort(CommAborted(f"grow to {size} ranks failed: {exc!r}"))
            raise
        await comm.close()
        return new

    async def _admission(self, comm: Communicator, size: int, limit: float, cuda: bool) -> int:
        """Step 1 (see the module docstring): the number of the grow every member takes part in."""
        deadline = time.monotonic() + limit
        # "cuda": the members have an NCCL backend, so the joiners meet its native grow.
        plan = {
            "world_size": size,
            "old_size": comm.world_size,
            "cuda": cuda,
            **self.options.shared(),
        }
        k = size - comm.world_size
        while True:
            left = deadline - time.monotonic()
            mine, error = _NOT_YET, None
            if comm.rank == 0:
                mine, error = await self._admit_round(k, plan, left)
            try:
                status = await _share(comm, mine, max(left, 0.0) + _ROUND + 5.0)
            except BaseException as exc:
                if mine > 0:  # joiners were admitted to grow `mine`: tell them it is off
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(
                            self._call_off, mine, size, exc, abandon_on_cancel=True
                        )
                raise
            if status > 0:
                return status
            if status == _TIMED_OUT:
                raise CollectiveTimeout(
                    f"grow to {size} ranks: {k} joiner(s) of group {self.name!r} did not arrive within {limit} s"
                )
            if status == _FAILED:
                raise CommAborted(
                    f"grow to {size} ranks: rank 0 could not admit joiners"
                ) from error

    def _call_off(self, g: int, size: int, error: BaseException) -> None:
        """Rank 0: grow ``g`` is off; it counts itself out of the grow's keys, as the
        participants that read the outcome do (it never reads them again). The ranks
        ``error`` names (a PeerFailure names them on proof of death) count as gone."""
        outcome = self.room.call_off(g, error)
        joiners = self.room.joiners(g)
        leave_grow(self.room, self.room.generation(g), 0, size, joiners, outcome, list)

    async def _admit_round(
        self, k: int, plan: dict[str, Any], left: float
    ) -> tuple[int, BaseException | None]:
        """Rank 0: admit ``k`` joiners within one round; the grow's number, or a status."""
        room = self.room
        until = time.monotonic() + max(0.0, min(_ROUND, left))

        def admit() -> int:
            while True:
                g = room.admit(k, plan)
                if g is not None:
                    return g
                if time.monotonic() >= until:
                    return _NOT_YET if left > _ROUND else _TIMED_OUT
                time.sleep(0.005)

        try:
            return int(await off_loop(admit, max(left, 0.0) + 5.0, "grow")), None
        except Exception as exc:  # noqa: BLE001 - raised by every member as the cause, after they are told
            return _FAILED, exc


async def _share(comm: Communicator, value: int, timeout: float) -> int:
    """Rank 0's ``value`` on every member (a collective of the old communicator)."""
    if comm.backend == "nccl":  # no CPU backend: through the store
        return int(await comm.broadcast_object(value, 0, timeout=timeout))
    t = torch.tensor([value], dtype=torch.int64)
    await comm.broadcast(t, 0, timeout=timeout)
    return int(t[0])


def _size(world_size: Any, old: int) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise InvalidArgument(f"grow: world_size must be an int, got {world_size!r}")
    if world_size <= old:
        raise InvalidArgument(
            f"grow: world_size must be larger than the current {old}, got {world_size}"
        )
    return world_size


#: Where a grow's native (NCCL) part meets, under the grown group's build store.
_NATIVE = "native/"


def _grow_native(cuda: Backend, size: int, limit: float, store: Any) -> Awaitable[Backend | None]:
    """A member's part of the native grow (``Backend.grow_agreed``; None: build afresh)."""
    job = functools.partial(cuda.grow_agreed, dist.PrefixStore(_NATIVE, store), size, limit)
    return off_loop(job, limit + 5.0, "nccl grow")


def _join_native(opts: Options, rank: int, size: int, store: Any) -> Awaitable[Backend | None]:
    """A joiner's part of the native grow (``Factories.nccl_join``; None: build afresh)."""
    return opts.factories.nccl_join(
        dist.PrefixStore(_NATIVE, store), rank, size, opts.device, opts.timeout
    )


def _build_at(
    opts: Options,
    group: Group,
    rank: int,
    size: int,
    device: Any,
    trace_dir: Any,
    native: Callable[[Any], Awaitable[Backend | None]] | None,
    store: Any,
) -> Awaitable[Communicator]:
    return _build(opts, group, rank, size, store, device, trace_dir, native)


async def _build(
    opts: Options,
    group: Group,
    rank: int,
    size: int,
    store: Any,
    device: Any,
    trace_dir: Any,
    native: Callable[[Any], Awaitable[Backend | None]] | None = None,
) -> Communicator:
    # native: the grow's native NCCL part, done first on the same store by every
    # participant (members and joiners), so its backend replaces a fresh NCCL init.
    grown = await native(store) if native is not None else None
    try:
        return await build_communicator(
            opts.backend,
            rank=rank,
            world_size=size,
            master_addr=None,
            master_port=None,
            store=store,
            device=device,
            timeout=opts.timeout,
            check=opts.check,
            trace_dir=trace_dir,
            heartbeat=opts.heartbeat,
            nccl_backend=grown,
            factories=opts.factories,
            group=group,
            sole=True,
        )
    except BaseException:
        if grown is not None:
            grown.release()  # bounded ncclCommAbort of the unused child
        raise


# --------------------------------------------------------------------------- join
async def join(
    backend: str,
    *,
    store: Any,
    master_addr: str | None,
    master_port: int | None,
    name: Any,
    device: Any,
    timeout: float,
    trace_dir: Any,
    factories: Factories = REAL,
) -> Communicator:
    """See ``asynccoll.join``."""
    timeout = check_args(backend, store, master_addr, device, timeout, None)
    name = check_name(name)
    key: tuple[str, int] | None = None
    if store is None:
        master_addr = master_addr or os.environ.get("MASTER_ADDR")
        if not master_addr or (master_port is None and os.environ.get("MASTER_PORT") is None):
            raise InvalidArgument(
                "join: no store: pass store=, or master_addr/master_port (or set $MASTER_ADDR/$MASTER_PORT)"
            )
        port = env_int(master_port, "MASTER_PORT", "master_port", 1, 65535)
        # rank -1: a joiner is always a client of the group's store, never its server.
        store, key = await tcp_store(master_addr, port, -1, 1, timeout)
    try:
        return await _join(backend, store, key, name, device, timeout, trace_dir, factories)
    finally:
        if key is not None:
            STORES.release(key)  # the joined communicator holds its own


async def _join(
    backend: str,
    root: Any,
    key: tuple[str, int] | None,
    name: str,
    device: Any,
    timeout: float,
    trace_dir: Any,
    factories: Factories,
) -> Communicator:
    room = Room(root, name)
    deadline = time.monotonic() + timeout
    while True:
        ticket, g, plan = await _admitted(room, backend, deadline, timeout)
        opts = Options(
            backend=plan["backend"],
            timeout=float(plan["timeout"]),
            check=plan["check"],
            heartbeat=plan["heartbeat"],
            trace_dir=plan["trace_dir"],
            device=device,
            factories=factories,
        )
        group = Group(name, opts, root, key)
        rank = int(plan["old_size"]) + plan["tickets"].index(ticket)
        size = int(plan["world_size"])
        mine = trace_dir if trace_dir is not None else opts.trace_dir
        native = functools.partial(_join_native, opts, rank, size) if plan.get("cuda") else None
        build = functools.partial(_build_at, opts, group, rank, size, device, mine, native)
        try:
            joiners = {int(plan["old_size"]) + i: t for i, t in enumerate(plan["tickets"])}
            return await assemble(
                room, g, rank, size, joiners, opts.watch_interval(), opts.timeout, build
            )
        except CommAborted as exc:
            if not is_abort_error(exc) or time.monotonic() >= deadline:
                raise  # a timeout or a mismatch answers this join, and so does the deadline
            # That grow failed (a participant died, or the members' admission broke):
            # wait for the members' next one.


async def _admitted(
    room: Room, backend: str, deadline: float, timeout: float
) -> tuple[int, int, dict[str, Any]]:
    """Take a ticket and wait until a grow admits it: (ticket, the grow's number, its plan).

    A ticket resolved otherwise (declared dead, a cancelled plan, a grow that ended
    without it while this process was stopped, an admission that expired unread) is
    replaced by a new one; at ``deadline``
    the ticket is withdrawn (``CollectiveTimeout``) unless a grow admitted it in the
    same instant.
    """
    stop = threading.Event()
    while True:
        ticket = await off_loop(functools.partial(room.take_ticket, backend), timeout, "join")

        def wait(ticket: int = ticket) -> tuple[int, dict[str, Any] | None] | str:
            mark = room.await_admission(ticket, deadline, stop)
            if mark is None:
                mark = room.withdraw(ticket)
            if not mark.isdigit():
                return mark
            g = int(mark)  # admitted: the plan follows at once (a few store calls on the leader)
            return g, room.await_plan(g, ticket, max(deadline, time.monotonic() + 10.0), stop)

        try:
            answer = await run_in_thread(wait, None, name="asynccoll-join")
        except BaseException:
            stop.set()  # the thread ends at its next poll
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(room.withdraw, ticket, abandon_on_cancel=True)
            raise
        if answer == WITHDRAWN:
            raise CollectiveTimeout(
                f"join: group {room.name!r} did not admit this process within {timeout} s "
                "(its members admit joiners when they call waiting() and grow())"
            )
        if isinstance(answer, str):
            if answer.startswith(REFUSED):
                raise InvalidArgument(f"join: {answer[len(REFUSED) :]}")
            # Declared dead while alive (an unreadable process table), or its admission
            # expired unread (``room.EXPIRED``): a new ticket.
            continue
        g, plan = answer
        if plan is not None:
            return ticket, g, plan
        # The grow was cancelled (another admitted joiner withdrew), or it failed and
        # was cleaned up while this process was stopped: a new ticket.
