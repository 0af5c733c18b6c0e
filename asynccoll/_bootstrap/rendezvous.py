"""Where a communicator's ranks meet: the store, and a prefix unique to the communicator."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import time
import uuid
from typing import Any, Callable, Iterable

import anyio
import torch.distributed as dist

from .._base import aio
from .._base.errors import (
    AsyncCollError,
    CollectiveMismatch,
    CollectiveTimeout,
    InvalidArgument,
)
from .._base.foreign import creation_error, kind_of
from .._base.storekeys import next_poll, peek
from .._core.objects import drop_ops
from .._faults.census import decode_ranks
from .._faults.service import unlist_ranks
from .args import env_int
from .stores import tcp_store


class Rendezvous:
    """Where a communicator's ranks meet: a store, and a prefix unique to this communicator.

    ``key``: the ``(master_addr, master_port)`` of a store from the process's cache
    (this rendezvous holds one reference to it), or None for a store given by the user.
    """

    def __init__(
        self, store: Any, rank: int, world_size: int, key: tuple[str, int] | None = None
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.key = key

    def prefixed(self, prefix: str) -> Any:
        return dist.PrefixStore(prefix, self.store)


async def off_loop(
    fn: Callable[[], Any],
    timeout: float,
    what: str,
    on_late: Callable[[Any], None] | None = None,
) -> Any:
    """Run blocking ``fn`` on an executor thread; ``CollectiveTimeout`` after ``timeout``.
    ``on_late``: see ``aio.run_in_thread`` (what ``fn`` made after the wait ended)."""
    return await settled(aio.spawn(fn, "asynccoll-setup"), timeout, what, on_late)


async def settled(
    future: concurrent.futures.Future[Any],
    timeout: float,
    what: str,
    on_late: Callable[[Any], None] | None = None,
) -> Any:
    """The outcome of a set-up job already started (``aio.spawn``), as :func:`off_loop`
    waits for it and reports its errors."""
    try:
        return await aio.wait_for(future, timeout, on_late=on_late)
    except AsyncCollError:
        raise
    except TimeoutError:
        raise CollectiveTimeout(f"{what}: peers did not arrive within {timeout} s") from None
    except (
        RuntimeError
    ) as exc:  # torch's store and Gloo errors (DistError subclasses, RuntimeError)
        raise creation_error(exc, kind_of(exc), what=what, timeout=timeout) from exc


async def rendezvous(
    *,
    rank: int | None,
    world_size: int | None,
    master_addr: str | None,
    master_port: int | None,
    store: Any,
    timeout: float,
) -> Rendezvous:
    """Resolve the torchrun environment and meet the other ranks' store.

    Without ``store=``, the store for ``master_addr:master_port`` is the process's
    shared one (``STORES``): the returned rendezvous holds one reference to it.
    """
    world_size = env_int(world_size, "WORLD_SIZE", "world_size", 1)
    rank = env_int(rank, "RANK", "rank", 0)
    if rank >= world_size:
        raise InvalidArgument(f"rank {rank} is out of range for world_size {world_size}")
    if store is not None:
        return Rendezvous(store, rank, world_size)
    master_addr = master_addr or os.environ.get("MASTER_ADDR")
    if not master_addr or (master_port is None and os.environ.get("MASTER_PORT") is None):
        raise InvalidArgument(
            "no store: pass store=, or master_addr/master_port (or set $MASTER_ADDR/$MASTER_PORT)"
        )
    port = env_int(master_port, "MASTER_PORT", "master_port", 1, 65535)
    tcp, key = await tcp_store(master_addr, port, rank, world_size, timeout)
    return Rendezvous(tcp, rank, world_size, key)


#: Per group on a store: the generation its next communicator is created in (``comm_prefix``).
_GEN = "asynccoll/gen/"


@dataclasses.dataclass(frozen=True)
class Namespace:
    """Where one communicator's keys live: ``prefix``, generation ``gen`` of its group.

    A group is what every member of a creation states alike: its world size and
    name (``ac.init(..., name=)``). Its generation counter (``gen_key``) is shared
    by the members, never counted per rank number: a 2-rank group made on the
    world's store moves the 2-rank group's counter only.
    """

    prefix: str
    #: None: a namespace of one communicator only (``sole``): no generations.
    gen_key: str | None
    gen: int


def group_of(world_size: int, name: str | None) -> str:
    """The group a creation belongs to on its store (names hold no ``/``)."""
    return f"w{world_size}" if name is None else f"w{world_size}-{name}"


def sole_prefix(world_size: int, name: str | None) -> str:
    """The prefix of a communicator made on a store of its own (``comm_prefix(sole=True)``)."""
    return f"asynccoll/{group_of(world_size, name)}/0/"


async def comm_prefix(
    rdv: Rendezvous, timeout: float, name: str | None = None, sole: bool = False
) -> Namespace:
    """The namespace of the communicator being created: its group's current generation.

    Every member reads the same generation: it moves only once every member has
    read it (:func:`all_created`, the last to arrive), or when a member gives
    the creation up (:func:`abandon`), so a retry after a failed or cancelled
    creation meets in the next generation on every rank, wherever each had got to.
    """
    group = group_of(rdv.world_size, name)
    if sole:  # ``rdv.store`` is this communicator's alone (a shrink's, grow's, split's)
        return Namespace(sole_prefix(rdv.world_size, name), None, 0)
    key = f"{_GEN}{group}"

    def read() -> int:
        return int(bytes(rdv.store.get(key))) if rdv.store.check([key]) else 0

    gen = await off_loop(read, timeout, "store")
    return Namespace(f"asynccoll/{group}/{gen}/", key, gen)


def advance(store: Any, ns: Namespace) -> None:
    """Move ``ns``'s group to its next generation, unless someone already did (blocking)."""
    if ns.gen_key is not None:
        store.compare_set(ns.gen_key, str(ns.gen) if ns.gen else "", str(ns.gen + 1))


def abandon(rdv: Rendezvous, ns: Namespace, why: str) -> None:
    """This rank gave the creation in ``ns`` up (it failed or was cancelled; blocking).

    Its peers still waiting there raise ``CollectiveMismatch`` naming this rank
    (the first to give up is the one named), and the group moves on: a retry on
    every rank meets in the next generation.

    On a connection of its own: a creation given up while its Gloo connect waits for
    a peer (cancelled: a member died, the parent of a split aborted) holds the
    creation's connection until Gloo's own timeout (a store client serves one
    request at a time), and the peers must hear now.
    """
    store = rdv.store.clone()
    dist.PrefixStore(ns.prefix, store).compare_set("abandoned", "", f"{rdv.rank}|{why}")
    advance(store, ns)


def _abandoned(store: Any, prefix: str) -> CollectiveMismatch:
    rank, why = bytes(store.get("abandoned")).decode().split("|", 1)
    return CollectiveMismatch(
        f"communicator {prefix!r}: rank {rank} gave its creation up ({why}); the other ranks "
        "stop waiting for it (retry on every rank: the retry meets in a new namespace)",
        details={int(rank): why},
        fields=("creation",),
    )


#: How long a wait for the peers polls before it also looks for a peer that gave up.
_ABANDON_AFTER = 0.01


def _until(store: Any, keys: list[str], deadline: float, prefix: str, waiters: int) -> None:
    """Wait for ``keys``; a peer that gave the creation up ends the wait at once (after
    ``_ABANDON_AFTER``: the peers of a creation that goes well arrive within a few
    polls, each one request). ``waiters``: how many ranks poll alike (``next_poll``)."""
    delay = 0.000025
    start = time.monotonic()
    abandon_after = start + _ABANDON_AFTER
    while not store.check(keys):
        now = time.monotonic()
        if now >= abandon_after and store.check(["abandoned"]):
            raise _abandoned(store, prefix)
        if now >= deadline:
            raise TimeoutError
        delay = next_poll(delay, now - start, waiters)
        time.sleep(delay)


async def agree_options(
    rdv: Rendezvous, prefix: str, options: dict[str, Any], timeout: float
) -> None:
    """Every rank states the options of the communicator it is creating; where they
    differ, every rank raises ``CollectiveMismatch`` (before any backend is built).

    Each rank claims its rank number in the namespace (first writer wins, with a
    token of its own): a second process claiming the same rank there (two groups
    of one world size and name created on one store at the same time) raises
    ``CollectiveMismatch`` naming the rank instead of pairing silently.

    Communicators of one group created at the same time by several tasks pair up in
    the order each rank happened to create them, which may differ between ranks.
    Where their options differ, this says so instead of pairing them silently. Rank
    0 reads every rank's options and publishes the verdict: O(n) requests in all.
    """
    if rdv.world_size == 1:
        return
    store = rdv.prefixed(prefix)
    mine = json.dumps(options, sort_keys=True)
    claim = json.dumps({"options": options, "token": uuid.uuid4().hex}, sort_keys=True)

    def exchange() -> str:
        deadline = time.monotonic() + timeout
        held = bytes(store.compare_set(f"opts/{rdv.rank}", "", claim)).decode()
        if held != claim:
            raise CollectiveMismatch(
                f"communicator {prefix!r}: rank {rdv.rank} is claimed by another process: two "
                f"groups of {rdv.world_size} ranks are being created on one store at once "
                "(give them different names, or stores)",
                details={rdv.rank: "claimed twice"},
                fields=("rank",),
            )
        if rdv.rank != 0:
            _until(store, ["opts/verdict"], deadline, prefix, rdv.world_size)
            return bytes(store.get("opts/verdict")).decode()
        keys = [f"opts/{r}" for r in range(rdv.world_size)]
        _until(store, keys, deadline, prefix, 1)
        values = [
            json.dumps(json.loads(bytes(v))["options"], sort_keys=True)
            for i in range(0, len(keys), 512)
            for v in store.multi_get(keys[i : i + 512])
        ]
        verdict = (
            "ok"
            if all(v == mine for v in values)
            else json.dumps({r: json.loads(v) for r, v in enumerate(values) if v != mine or r == 0})
        )
        store.set("opts/verdict", verdict)
        return verdict

    verdict = await off_loop(exchange, timeout, "creation")
    if verdict == "ok":
        return
    details = {int(r): o for r, o in json.loads(verdict).items()}
    fields = sorted(
        {
            k
            for o in details.values()
            for k in o
            if len({json.dumps(d.get(k)) for d in details.values()}) > 1
        }
    )
    parts = []
    for field in fields:
        groups: dict[str, list[int]] = {}
        for r in sorted(details):
            groups.setdefault(str(details[r].get(field)), []).append(r)
        parts.append(
            f"{field} "
            + ", ".join(
                f"{v} on rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}"
                for v, rs in groups.items()
            )
        )
    raise CollectiveMismatch(
        f"communicator {prefix!r}: its ranks were created with different options: {'; '.join(parts)} "
        "(communicators created at the same time pair up by creation order on each rank, which may differ: "
        "create them one after the other, in the same order on every rank)",
        details=details,
        fields=tuple(fields),
    )


def all_created(rdv: Rendezvous, ns: Namespace, timeout: float) -> None:
    """Wait until every rank has built its backends (the end of creation; blocking);
    the last to arrive moves the group to its next generation (every member has read
    this one).

    Without it a rank whose Gloo mesh is up returns first and may close its
    communicator at once, while a peer is still inside Gloo's connectFullMesh,
    which then fails with "Connection closed by peer" (seen under CPU load).
    torch's ``init_process_group`` ends the same way (``_store_based_barrier``).
    The last rank to arrive says so: each rank sends one request and waits for one key.
    """
    deadline = time.monotonic() + timeout
    store = rdv.prefixed(ns.prefix)
    if rdv.world_size == 1 or int(store.add("created", 1)) >= rdv.world_size:
        advance(rdv.store, ns)  # before anyone leaves: a next creation reads the next one
        if rdv.world_size > 1:
            store.set("created/all", "1")
        return
    _until(store, ["created/all"], deadline, ns.prefix, rdv.world_size)


#: The communicator's name in ``trace_dir`` (``build.diagnostics``).
TRACE_KEY = "trace"
#: The creations under a communicator's prefix that a rank gave up (``give_up``).
GIVEN_UP = "given-up"
#: Keys a communicator leaves under its prefix (see ``forget``).
_SHARED_KEYS = (
    TRACE_KEY,
    "aborted",
    "ns",
    "host",
    "failure",
    "census/owner",
    "abandoned",
    "opts/verdict",
    "created",
    "created/all",
    "left",
    "ops",
    GIVEN_UP,
)
_RANK_KEYS = ("hb", "proc", "bye", "opts", "fp/addr", "shrink/propose", "shrink/final")


def drop_keys(store: Any, n: int) -> None:
    """Delete the keys a communicator's parts (or a liveness watch) of ``n`` ranks leave under ``store``."""
    for key in (*_SHARED_KEYS, *(f"{k}/{r}" for k in _RANK_KEYS for r in range(n))):
        store.delete_key(key)


def drop_namespace(store: Any, prefix: str, n: int) -> None:
    """Delete the keys of the communicator of ``n`` ranks made (or given up) in ``prefix``
    on ``store`` (blocking): its parts' (``drop_keys``) and its backends' own."""
    drop_keys(dist.PrefixStore(prefix, store), n)
    gloo = dist.PrefixStore(prefix + "gloo/", store)
    for r in range(n):
        gloo.delete_key(f"0/{r}")  # Gloo's full-mesh addresses (its key layout, torch 2.x)
    dist.PrefixStore(prefix + "nccl/", store).delete_key("unique_id")


def give_up(store: Any, prefix: str, sub: str, world_size: int, name: str | None) -> None:
    """This rank gave up the creation of ``world_size`` ranks made under ``prefix + sub``
    on ``store`` (blocking): a shrink's build that a survivor died in (the survivors build
    again without it) or that failed. Its keys (each rank's options, Gloo's addresses,
    the give-up mark) go with those of the communicator under ``prefix`` (``forget``)."""
    entry = json.dumps([sub, sole_prefix(world_size, name), world_size])
    under: Any = dist.PrefixStore(prefix, store)  # (torch's stubs lack Store.append)
    under.append(GIVEN_UP, entry + "\n")


async def gave_up(
    store: Any, prefix: str, sub: str, world_size: int, name: str | None, within: float
) -> None:
    """:func:`give_up` off the loop, shielded (a creation that a cancellation ended is
    given up too), within ``within`` seconds; a failed store is left alone (the
    creation's own error is the one to report)."""
    record = functools.partial(give_up, store, prefix, sub, world_size, name)
    with anyio.CancelScope(shield=True):
        try:
            await off_loop(record, within, "store")
        except AsyncCollError:
            pass


def _drop_given_up(rdv: Rendezvous, prefix: str) -> None:
    """Delete the keys of the creations given up under ``prefix`` (``give_up``), except
    one that ended on every rank (``created/all``): a rank that gave it up at the very
    end may have been alone, and the others keep it; its own ``forget`` deletes it."""
    given_up = peek(rdv.prefixed(prefix), GIVEN_UP)
    if given_up is None:
        return
    for line in set(given_up.splitlines()):
        sub, sole, n = json.loads(line)
        base = rdv.prefixed(prefix + sub)
        if not dist.PrefixStore(sole, base).check(["created/all"]):
            drop_namespace(base, sole, n)


def forget(
    rdv: Rendezvous,
    prefix: str,
    dead: Iterable[int] = (),
    keys: Iterable[str] = (),
    ops: Iterable[int] = (),
    more: Callable[[Any], Iterable[str]] = lambda store: (),
) -> None:
    """This rank is done with a communicator's keys (blocking): at ``close()``, or at
    ``shrink()`` once the survivors' new communicator is up (``Resources.retire``).

    The rank counts itself out (``left``); the rank whose count makes every rank
    either left or proven dead (as far as it knows) deletes all the communicator's
    keys (or steps past that count: ranks may know different dead), and the liveness
    service listings of the processes of the ranks proven dead
    (``service.unlist_ranks``: a killed process never unlists itself). Proven dead: the ranks of the census record
    (``failure``: proof of death only, see ``liveness``) and ``dead`` (ranks that
    shrink's build proved dead; their records, ``keys`` under the prefix, go too).
    ``ops``: object collectives this rank began that never finished (an abort ended
    them); their keys go too (``objects.drop_ops``). Until every rank is out, a live
    peer may still read the keys (a rank a shrink left out, alive): they stay. A
    rank that dies unproven (say, after the census) leaves them behind. A store
    whose host is gone (rank 0 hosting it closed first and its process exited, as
    with ``master_addr``/``MASTER_ADDR`` and no launcher's store) took the keys with
    it: nothing to do, and ``close()`` must not fail for it.
    """
    store = rdv.prefixed(prefix)
    n = rdv.world_size
    try:
        gone = set(dead)
        # Read before counting out: then a peer may delete the key (``peek``: a key
        # deleted meanwhile is never waited for).
        failure = peek(store, "failure")
        if failure is not None:
            gone.update(decode_ranks(failure))
        mine = ",".join(map(str, ops))
        if mine:
            store.append("ops", f"{mine},")
        # At or past the count this rank expects: ranks may see the dead differently (a
        # rank the census named counts itself out if it was alive after all), and a count
        # that steps past another's threshold must still end with someone deleting.
        if int(store.add("left", 1)) < n - len(gone - {rdv.rank}):
            return
        # (several ranks may be at or past their count: another may be deleting)
        seqs = {int(s) for s in (peek(store, "ops") or "").split(",") if s}
        drop_ops(store, seqs, n)
        unlist_ranks(store, sorted(gone - {rdv.rank}))  # (before drop_keys: it reads proc/<r>)
        _drop_given_up(rdv, prefix)  # (before drop_namespace: it reads GIVEN_UP)
        drop_namespace(rdv.store, prefix, n)
        for key in (*keys, *more(store)):  # (more: its splits' leftover keys, ``Splitter``)
            store.delete_key(key)
    except dist.DistNetworkError:
        return
