"""``comm.split(groups)``: subgroups of a communicator, each a communicator of its own.

Every rank of the parent calls it with the same lists. The steps:

1. This rank's pending operations finish (NCCL's ``ncclCommSplit`` wants none
   outstanding on the parent: nccl4py's ``Communicator.split`` docs).
2. The ranks agree through the parent's store (``split/<k>/``, the parent's k-th
   split): each states its lists, or what is wrong with them, and its parent's
   state; every rank judges them alike (rank 0 alone, publishing its verdict, above
   16 ranks), so that lists that differ, overlap or name a rank outside are
   ``InvalidArgument`` on every rank, and a parent aborted on any rank is
   ``CommAborted`` on every rank. A peer proven dead meanwhile (the parent's
   liveness) is a ``PeerFailure`` naming it, not a wait until the timeout.
3. Where the parent has NCCL, every rank (those in no list too: it is a collective
   on the parent) calls ``ncclCommSplit`` once, color = the list's index, key = the
   position in it; ranks in no list pass no color.
4. Each member builds its group's communicator in a namespace of that group alone
   (``<parent prefix>split-<k>/<index>/``), with the parent's options (agreed when
   the parent was made: no second round), over the split's NCCL child where there
   is one and a new Gloo group otherwise. A member proven dead meanwhile by the
   parent's liveness ends the build with a ``PeerFailure`` naming it (in the
   parent's numbering), not a Gloo connect waiting out the timeout.

In steps 2 and 4 the parent aborted (``abort()`` on this rank, or a peer's news)
ends the split at once with ``CommAborted`` (``watching``).

Steps 2 to 4, up to the end of the subgroup's creation, run as one job on one thread
(the loop then makes the Communicator of its parts): each hop from the loop to a
thread and back is time the peers wait for this rank (issue 33 measured a split at
5.9x torch's bare group with four hops).

A subgroup shares nothing with its parent but the store: no abort flag (the NCCL
child does not share the parent's resources: with ``splitShare`` NCCL would give
it the parent's abort flag, init.cc ``ncclCommInitChildComm``), no liveness member,
no ledger. So aborting, closing or shrinking one never touches the other.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import threading
import time
from typing import Any, Callable, Protocol, Sequence

import anyio
import torch.distributed as dist

from .._base import aio
from .._base.errors import AsyncCollError, CommAborted, CommClosed, InvalidArgument, PeerFailure
from .._base.storekeys import next_poll
from .._core import validate
from .._core.backend import Backend
from .._core.communicator import Communicator
from .rendezvous import Rendezvous, gave_up, off_loop, settled


class Maker(Protocol):
    """How a communicator's subgroups are made (``build.Subgroups``): with the parent's
    options, each in a namespace of its own."""

    def assemble(self, rank: int, size: int, store: Any, child: Backend | None, name: str) -> Any:
        """Rank ``rank`` of the subgroup ``name`` (unique under the parent) of ``size`` on
        ``store``, over the NCCL ``child`` if not None, up to the end of its creation
        (blocking)."""

    def abandon(self, store: Any, size: int, exc: BaseException) -> None:
        """Give the subgroup of ``size`` on ``store`` up (blocking)."""

    def release(self, made: Any) -> None:
        """Undo what ``assemble`` made."""

    def adopt(self, made: Any) -> Communicator:
        """The Communicator of what ``assemble`` made (never blocks)."""
        ...


def normalize(groups: Any, world_size: int) -> tuple[list[list[int]] | None, str | None]:
    """The lists as plain ints, or None and what is wrong with them (never raises:
    every rank must still take part in the agreement)."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
        return None, f"groups must be a list of lists of ranks, got {type(groups).__name__}"
    lists: list[list[int]] = []
    seen: dict[int, int] = {}
    for i, group in enumerate(groups):
        if isinstance(group, (str, bytes)) or not isinstance(group, Sequence):
            return None, f"groups[{i}] must be a list of ranks, got {type(group).__name__}"
        if not group:
            return None, f"groups[{i}] is empty"
        ranks: list[int] = []
        for r in group:
            if isinstance(r, bool) or not isinstance(r, int):
                return None, f"groups[{i}] holds {r!r}, not a rank (int)"
            r = int(r)
            if not 0 <= r < world_size:
                return None, f"groups[{i}] names rank {r}, outside a communicator of {world_size}"
            if r in seen:
                where = "twice" if seen[r] == i else f"in groups[{seen[r]}] and groups[{i}]"
                return None, f"rank {r} is {where} (the lists must be disjoint)"
            seen[r] = i
            ranks.append(r)
        lists.append(ranks)
    return lists, None


def judge(statuses: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's verdict on every rank's status: ``{"groups": ...}``, ``{"invalid": why}``
    or ``{"aborted": why}``."""
    problems = {r: s["problem"] for r, s in enumerate(statuses) if s["problem"]}
    if problems:
        text = "; ".join(f"rank {r}: {why}" for r, why in problems.items())
        return {"invalid": f"split: {text}"}
    first = statuses[0]["groups"]
    differ = [r for r, s in enumerate(statuses) if s["groups"] != first]
    if differ:
        other = statuses[differ[0]]["groups"]
        return {
            "invalid": f"split: the lists differ across ranks: rank 0 passed {first}, "
            f"rank(s) {differ} passed others (rank {differ[0]}: {other})"
        }
    broken = {r: s["state"] for r, s in enumerate(statuses) if s["state"] != "ok"}
    if broken:
        return {"aborted": f"split: the communicator is not usable on rank(s) {broken}"}
    return {"groups": first}


#: Up to this many ranks every rank reads every status and judges alike (one round);
#: above, rank 0 judges and publishes the verdict (two rounds, O(n) requests in all).
_DIRECT = 16


#: How often a wait for the peers asks the parent's liveness whether one of them died.
_WATCH_EVERY = 0.2
#: At most this long to give a subgroup's creation up (its members then stop at once).
_GIVE_UP_S = 5.0

#: ``watch(ranks)``: the error for a wait on ``ranks`` once one is proven dead, else None
#: (the parent's ``Membership.failure_among``).
Watch = Callable[[list[int]], BaseException | None]


def _wait(
    store: Any, keys: list[str], deadline: float, watch: Watch | None, ranks: list[int]
) -> None:
    # Short polls: each holds the connection (which the parent's other users share) for
    # one request (a blocking wait would hold it, and one that times out makes torch
    # print a warning per slice).
    delay = 0.000025
    start = time.monotonic()
    look = start + _WATCH_EVERY
    while not store.check(keys):
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError
        if watch is not None and now >= look:
            error = watch(ranks)
            if error is not None:
                raise error
            look = now + _WATCH_EVERY
        delay = next_poll(delay, now - start, len(ranks))
        time.sleep(delay)


def _read(store: Any, keys: list[str]) -> list[dict[str, Any]]:
    return [
        json.loads(bytes(v))
        for i in range(0, len(keys), 512)
        for v in store.multi_get(keys[i : i + 512])
    ]


def agree(
    store: Any,
    rank: int,
    world_size: int,
    k: int,
    status: dict[str, Any],
    timeout: float,
    watch: Watch | None = None,
) -> dict[str, Any]:
    """Step 2 (blocking): every rank's verdict on split ``k``, the same on every rank,
    through ``store`` (the parent's). A peer proven dead meanwhile, or the
    parent aborted (``watch``), ends the wait with its error.

    The last rank to leave (with the verdict, or ended by ``watch``) deletes the
    split's keys."""
    deadline = time.monotonic() + timeout
    others = [r for r in range(world_size) if r != rank]
    base = f"split/{k}/"
    store.set(f"{base}{rank}", json.dumps(status))
    keys = [f"{base}{r}" for r in range(world_size)]
    verdict_key = f"{base}verdict"
    try:
        if world_size <= _DIRECT:
            _wait(store, keys, deadline, watch, others)
            verdict = judge(_read(store, keys))
        else:
            if rank == 0:
                _wait(store, keys, deadline, watch, others)
                store.set(verdict_key, json.dumps(judge(_read(store, keys))))
            else:
                _wait(store, [verdict_key], deadline, watch, [0])
            verdict = json.loads(bytes(store.get(verdict_key)))
    except AsyncCollError:  # ended by ``watch``: this rank is done with the keys too
        _leave(store, base, keys, verdict_key, world_size)
        raise
    # (on another thread: the count is no step of the split's, its answer no one's wait)
    aio.spawn(
        functools.partial(_leave, store, base, keys, verdict_key, world_size), "asynccoll-split"
    )
    return verdict


def _leave(store: Any, base: str, keys: list[str], verdict_key: str, world_size: int) -> None:
    """This rank is done with split's agreement keys; the last of the ranks deletes them.
    (A failed store leaves them: the parent's ``forget`` deletes what is left.)"""
    try:
        if int(store.add(f"{base}read", 1)) == world_size:
            for key in (*keys, verdict_key, f"{base}read"):
                store.delete_key(key)
    except (RuntimeError, ValueError):  # torch's store errors (DistError subclasses)
        pass


def watching(comm: Communicator, watch: Watch | None) -> Watch:
    """The watch of a split in progress on ``comm``: ``comm`` aborted meanwhile (by
    ``abort()`` on this rank, or a peer's news) ends it with ``CommAborted`` (a
    ``PeerFailure`` naming the same ranks when a peer's failure aborted it), and so
    does a peer proven dead by ``comm``'s liveness (``watch``)."""

    def look(ranks: list[int]) -> BaseException | None:
        error = comm.error
        if error is not None:
            ended: CommAborted
            if isinstance(error, PeerFailure):
                ended = PeerFailure(f"split: {error}", error.ranks)
            else:
                ended = CommAborted(f"split: the communicator aborted: {error}")
            ended.__cause__ = error
            return ended
        return watch(ranks) if watch is not None else None

    return look


class _Progress:
    """Where a split's thread is, for its watch on the loop (under ``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: ``(namespace, store, size, members)`` of the subgroup being made, once its
        #: creation began (``members``: the other ranks of it, numbered in the parent).
        self.making: tuple[str, Any, int, list[int]] | None = None
        #: The loop gave the split up: the thread makes nothing more.
        self.over = False


async def _watched(
    job: concurrent.futures.Future[Any],
    limit: float,
    watch: Watch,
    progress: _Progress,
    late: Callable[[Any], None],
) -> Any:
    """The split's thread ``job`` (within ``limit`` s; ``late`` gets what it made after
    the wait ended), unless ``watch`` ends it first, once the subgroup's creation began
    (asked about its other members): then its error. (The agreement asks the watch
    itself.) A Gloo connect waits for every member until its timeout; a member dead or a
    parent aborted must not.

    A split that ends before the first look (the common case: a few ms) is awaited
    alone: the race of two tasks costs it 0.3-1 ms (measured at rest)."""
    start = time.monotonic()
    with anyio.move_on_after(min(_WATCH_EVERY, limit)) as first:
        try:
            return await settled(job, limit, "split")
        except BaseException:
            if not first.cancel_called:  # not the end of the first wait: the split's end
                aio.late_for(job, late)
            raise

    async def look() -> None:
        while True:
            making = progress.making
            if making is not None:
                check = functools.partial(watch, making[3])
                error = await aio.run_in_thread(check, None, name="asynccoll-split")
                if error is not None:
                    raise error
            await anyio.sleep(_WATCH_EVERY)

    left = max(0.0, limit - (time.monotonic() - start))
    return await aio.race(lambda: settled(job, left, "split", late), look)


class Splitter:
    """What a communicator made by ``init`` needs to split (``interfaces.Splitting``):
    its rendezvous and namespace, its NCCL backend (or None) and its ``maker``. Owns the
    count of its communicator's splits (the same on every rank: split is a collective)."""

    def __init__(self, rdv: Rendezvous, prefix: str, cuda: Backend | None, maker: Maker) -> None:
        self.rdv = rdv
        self.prefix = prefix
        self.cuda = cuda
        self.maker = maker
        self.count = 0

    def leftover_keys(self, store: Any) -> list[str]:
        """The agreement keys under ``store`` (its communicator's prefix) that no rank
        deleted: the last rank out of a split deletes them, but a member that died after
        writing its status never counts itself out, nor does one whose count (on a thread
        of its own) had not run when its process ended: this rank's status is still there.
        One request per split; the communicator's ``forget`` deletes what this names."""
        n, me = self.rdv.world_size, self.rdv.rank
        return [
            key
            for k in range(self.count)
            if store.check([f"split/{k}/{me}"])
            for key in (
                *(f"split/{k}/{r}" for r in range(n)),
                f"split/{k}/read",
                f"split/{k}/verdict",
            )
        ]

    async def split(
        self, comm: Communicator, groups: Any, timeout: float | None, watch: Watch | None = None
    ) -> Communicator | None:
        """See ``Communicator.split``."""
        if comm.state == "closed":
            raise CommClosed("cannot split a closed communicator")
        limit = comm.timeout if timeout is None else validate.timeout(timeout, comm.timeout)
        k, self.count = self.count, self.count + 1
        lists, problem = normalize(groups, comm.world_size)
        pending = list(comm.ledger.pending.values())
        if pending:  # step 1; an op past its own deadline aborts the parent (seen in step 2)
            await aio.settle_within(pending, limit)
        status = {"groups": lists, "problem": problem, "state": comm.state}
        parent = self.rdv.prefixed(self.prefix)
        guard = watching(comm, watch)
        # (an aborted one says so in its status: every rank raises the agreed verdict)
        first = guard if comm.state == "ok" else watch
        agreement = functools.partial(
            agree, parent, comm.rank, comm.world_size, k, status, limit, first
        )
        progress = _Progress()

        def run() -> tuple[dict[str, Any], Any]:
            """Steps 2 to 4 up to the end of the subgroup's creation, on one thread."""
            # The subgroup's own store connection (0.3 ms), made while the ranks agree: its
            # Gloo connect waits in the store for its peers' addresses, and must not hold
            # the connection the parent's liveness uses.
            connection = aio.spawn(parent.clone, "asynccoll-split")
            verdict = agreement()
            if "groups" not in verdict:
                return verdict, None
            agreed: list[list[int]] = verdict["groups"]
            index = next((i for i, g in enumerate(agreed) if comm.rank in g), None)
            size = len(agreed[index]) if index is not None else 0
            rank = agreed[index].index(comm.rank) if index is not None else 0
            child = None
            if self.cuda is not None:  # step 3: every rank, in a list or not
                child = self.cuda.split(index, rank, size, limit)
            if index is None:
                return verdict, None
            sub = f"split-{k}/{index}/"
            store = dist.PrefixStore(sub, connection.result(limit))
            with progress.lock:
                if progress.over:  # the watch ended the split meanwhile
                    if child is not None:
                        child.release()
                    return verdict, None
                members = [r for r in agreed[index] if r != comm.rank]
                progress.making = (sub, store, size, members)
            return verdict, self.maker.assemble(rank, size, store, child, sub)

        def late(result: tuple[dict[str, Any], Any]) -> None:
            if result[1] is not None:
                self.maker.release(result[1])

        try:
            job = aio.spawn(run, "asynccoll-split")
            verdict, made = await _watched(job, limit, guard, progress, late)
        except BaseException as exc:
            with progress.lock:
                progress.over = True
                making = progress.making
            if making is not None:  # step 4 began: give it up; its keys go with the parent's
                sub, store, size, _ = making
                with anyio.CancelScope(shield=True):
                    try:
                        # (the thread may still wait in its Gloo connect: the members must hear now)
                        give = functools.partial(self.maker.abandon, store, size, exc)
                        await off_loop(give, min(limit, _GIVE_UP_S), "store")
                    except AsyncCollError:
                        pass  # the store failed: the split's error is the one to report
                await gave_up(self.rdv.store, self.prefix, sub, size, None, min(limit, _GIVE_UP_S))
            raise
        if "invalid" in verdict:
            raise InvalidArgument(verdict["invalid"])
        if "aborted" in verdict:
            raise CommAborted(verdict["aborted"])
        return self.maker.adopt(made) if made is not None else None
