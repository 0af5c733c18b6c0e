"""``comm.shrink()``: the survivors settle the excluded set, then build a new communicator.

Fast path: after a failure, the census already recorded the failed ranks under
the communicator's ``failure`` key (first writer wins, see ``faults``), so every
survivor knows the same set. A survivor that shrinks without ``exclude``, or
with a subset of that record, excludes exactly the record and goes straight to
building the new communicator: no agreement round. It still writes its proposal
and final set, so a survivor that takes the slow path agrees with it at once.

Slow path (no record, or ranks beyond it): every survivor proposes the ranks it
wants excluded; the union of all proposals (plus any rank that never proposes
within the grace period) is the excluded set; each survivor then publishes its
final set, and all finals must be equal.

Ranks are renumbered in order. The new communicator lives under a new store
prefix; the old one stays aborted.

The seam for backends: the new communicator is built by the communicator's
``build_shrunk(new_rank, new_size, suffix, failed=, excluded=)`` closure
(``asynccoll.init``): ``excluded`` are the old ranks left out, ``failed`` says the
shrink follows a failure. A backend with a native shrink (NCCL's
``ncclCommShrink``) shrinks the old backend there instead of building a new one,
with its abort flag when ``failed`` and its default flag for a planned shrink
of a healthy communicator.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Iterable, cast

import anyio
import torch.distributed as dist

from .._base.aio import race, run_in_thread
from .._base.errors import (
    AsyncCollError,
    CollectiveMismatch,
    CollectiveTimeout,
    CommAborted,
    CommClosed,
    InvalidArgument,
)
from .._core.communicator import Communicator
from .._core.interfaces import Membership, ShrinkRequest
from .._core.objects import poll_keys
from .census import decode_ranks, encode_ranks


def agree(
    store: Any, rank: int, world_size: int, exclude: set[int], timeout: float, grace: float
) -> set[int]:
    """The excluded set every survivor agrees on (blocking; run off the loop)."""
    deadline = time.monotonic() + timeout
    store.set(f"shrink/propose/{rank}", encode_ranks(exclude))
    union = set(exclude)
    grace_end = time.monotonic() + grace
    while True:
        expected = [r for r in range(world_size) if r not in union]
        keys = [f"shrink/propose/{r}" for r in expected]
        if not poll_keys(store, keys, min(grace_end, deadline)):
            missing = [r for r in expected if not store.check([f"shrink/propose/{r}"])]
            union.update(missing)  # silent ranks are treated as failed
            continue
        proposed = set().union(*(decode_ranks(v) for v in store.multi_get(keys)))
        if proposed <= union:
            break
        union |= proposed
    survivors = [r for r in range(world_size) if r not in union]
    if rank not in survivors:
        raise InvalidArgument(f"rank {rank} was excluded by the other survivors")
    store.set(f"shrink/final/{rank}", encode_ranks(union))
    keys = [f"shrink/final/{r}" for r in survivors]
    if not poll_keys(store, keys, deadline):
        raise CollectiveTimeout(
            f"shrink: survivors {survivors} did not all confirm within {timeout} s"
        )
    finals = {r: set(decode_ranks(v)) for r, v in zip(survivors, store.multi_get(keys))}
    if any(f != union for f in finals.values()):
        raise CollectiveMismatch(
            "shrink: survivors disagree on the excluded ranks",
            details={r: sorted(f) for r, f in finals.items()},
        )
    return union


async def shrink(comm: ShrinkRequest, exclude: Iterable[int] | None) -> Communicator:
    """See ``Communicator.shrink`` (which checks and marks it shrunk once)."""
    if comm.state == "closed":
        raise CommClosed("cannot shrink a closed communicator")
    build_shrunk = comm.build_shrunk
    if build_shrunk is None or comm.store is None:
        raise InvalidArgument(
            f"shrink needs a communicator made by asynccoll.init(), not {comm.backend!r}"
        )
    if exclude is None:
        excluded = set(comm.failed_ranks)
    else:
        try:
            excluded = {int(r) for r in exclude}
        except (TypeError, ValueError):
            raise InvalidArgument(
                f"exclude must be an iterable of ranks, got {exclude!r}"
            ) from None
    bad = [r for r in excluded if not 0 <= r < comm.world_size]
    if bad:
        raise InvalidArgument(f"exclude: ranks {bad} out of range for world_size {comm.world_size}")
    if comm.rank in excluded:
        raise InvalidArgument(f"rank {comm.rank} cannot shrink a communicator that excludes itself")
    liveness = comm.liveness
    gone = liveness.failure() if liveness is not None else None
    if gone is not None:  # the store died with its host (or was closed): nothing to meet on
        raise gone
    comm.claim()
    failed = comm.state == "aborted"  # after a failure (or a user's abort), not a planned shrink
    if comm.state == "ok":
        comm.abort("shrinking the communicator")
    if liveness is not None:
        liveness.hold()  # keep answering the survivors' census while this rank builds the new one
    try:
        agreed = await run_in_thread(lambda: _settle(comm, excluded), None, name="asynccoll-shrink")
        new, dead, records = await _build(comm, build_shrunk, agreed, failed)
        # Every survivor built ``new`` (its creation ends when all have): none reads the
        # old communicator's agreement or retry keys any more. The excluded ranks whose
        # processes are gone never count themselves out of the old keys: they are gone
        # for ``forget``. All of them are probed, not only those this communicator knew
        # had failed: a caller excludes by name a rank it saw die elsewhere (a subgroup's
        # failure), and a survivor that counted it as alive waited for its count for
        # good (the chaos soak: a whole communicator's keys). A live or stopped one may
        # still read them: it counts itself out when it closes.
        unproven = sorted(agreed - set(dead))
        if unproven and liveness is not None:
            proven = await run_in_thread(
                lambda: _probe(liveness, unproven), None, name="asynccoll-shrink"
            )
            dead = tuple(sorted(set(dead) | set(proven)))
        try:  # the new communicator holds whatever happens to the cleanup
            await run_in_thread(lambda: comm.retire(dead, records), None, name="asynccoll-shrink")
        except (
            dist.DistError
        ):  # the store failed meanwhile: the old keys stay (the new one notices)
            pass
        return new
    except dist.DistError as exc:  # the store failed under the agreement (torch's type for it)
        error = liveness.failure() if liveness is not None else None
        raise (error or CommAborted(f"shrink: the rendezvous store failed: {exc}")) from exc
    finally:
        if liveness is not None:
            liveness.release()


#: While the new communicator is being built: when to start probing the other
#: survivors, and how often (a build normally takes a few milliseconds).
_WATCH_AFTER = 0.1
_WATCH_EVERY = 0.2


async def _build(
    comm: ShrinkRequest, build_shrunk: Any, agreed: set[int], failed: bool
) -> tuple[Communicator, tuple[int, ...], tuple[str, ...]]:
    """Build the survivors' communicator; if a survivor dies meanwhile, start over without it.

    Returns it, the survivors proven dead meanwhile and the keys that recorded them.

    A backend's group construction waits for every member (until ``timeout``), so
    a survivor that dies before joining would hold everyone there. While it
    builds, each survivor probes the others' processes (``Liveness.probe``); a dead
    one is recorded under ``shrink/retry/<suffix>`` (first writer wins), every
    survivor sees the record, drops its build and builds again without that rank.
    """
    excluded = set(agreed)
    liveness = comm.liveness
    store = comm.store
    dead: set[int] = set()
    records: list[str] = []
    while True:
        survivors = [r for r in range(comm.world_size) if r not in excluded]
        if comm.rank not in survivors:
            raise InvalidArgument(f"rank {comm.rank} was excluded by the other survivors")
        suffix = "shrink-" + ".".join(map(str, survivors)) + "/"
        # build_shrunk(new_rank, new_size, suffix, failed=, excluded=): see the module docstring.
        args = (survivors.index(comm.rank), len(survivors), suffix)
        kwargs = {"failed": failed, "excluded": tuple(sorted(excluded))}
        if liveness is None:
            return cast("Communicator", await build_shrunk(*args, **kwargs)), (), ()
        others = [r for r in survivors if r != comm.rank]
        key = f"shrink/retry/{suffix}"
        try:
            outcome = await race(
                functools.partial(build_shrunk, *args, **kwargs),
                functools.partial(_watch, store, key, liveness, others),
            )
        except AsyncCollError:
            # A survivor whose watch saw a death first records it under ``key``, then
            # gives its build up, which ends this rank's build at once (a creation a
            # peer gave up is a CollectiveMismatch): the same retry as our own watch's.
            recorded = await run_in_thread(
                functools.partial(_recorded, store, key), None, name="asynccoll-shrink"
            )
            if recorded is None:
                raise
            outcome = recorded
        if not isinstance(outcome, tuple):
            return outcome, tuple(sorted(dead)), tuple(records)
        excluded |= set(outcome)
        dead |= set(outcome)  # proven dead by a probe (``_watch``)
        records.append(f"shrink/retry/{suffix}")


async def _watch(store: Any, key: str, liveness: Membership, others: list[int]) -> tuple[int, ...]:
    """The survivors that died while this build runs (recorded under ``key`` by the
    first survivor to see it; every survivor then reads the same record)."""
    start = anyio.current_time()
    next_probe = start + _WATCH_AFTER
    while True:
        await anyio.sleep(0.02)
        if await run_in_thread(lambda: store.check([key]), None, name="asynccoll-shrink"):
            return decode_ranks(
                await run_in_thread(lambda: store.get(key), None, name="asynccoll-shrink")
            )
        if anyio.current_time() >= next_probe:
            dead = await run_in_thread(
                lambda: _probe(liveness, others), None, name="asynccoll-shrink"
            )
            if dead:
                proposal = encode_ranks(dead)
                raw = await run_in_thread(
                    # Awaited here, within this iteration: the loop variable is current.
                    lambda: store.compare_set(key, "", proposal),  # noqa: B023
                    None,
                    name="asynccoll-shrink",
                )
                return decode_ranks(raw)
            next_probe = anyio.current_time() + _WATCH_EVERY


def _recorded(store: Any, key: str) -> tuple[int, ...] | None:
    """The survivors recorded dead under ``key`` (``_watch``), or None if none were."""
    if not store.check([key]):
        return None
    return decode_ranks(store.get(key))


def _probe(liveness: Membership, ranks: list[int]) -> tuple[int, ...]:
    return tuple(liveness.probe(ranks))


def _settle(comm: ShrinkRequest, excluded: set[int]) -> set[int]:
    """The excluded set: the census record when it covers ``excluded``, else agreement."""
    store, rank = comm.store, comm.rank
    liveness = comm.liveness
    recorded = liveness.record() if liveness is not None else None
    if recorded is not None and excluded <= set(recorded) and rank not in recorded:
        union = set(recorded)
        text = encode_ranks(union)
        store.multi_set([f"shrink/propose/{rank}", f"shrink/final/{rank}"], [text, text])
        return union
    grace = min(10.0, comm.timeout / 2)
    return agree(store, rank, comm.world_size, excluded, comm.timeout, grace)
