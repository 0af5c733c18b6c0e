"""How the ranks of an NCCL communicator agree, through the store, to shrink or grow it.

``ncclCommShrink``/``ncclCommGrow`` are collectives: if one rank re-initialises
instead (its communicator was aborted, or NCCL lacks the call), the others would
wait in them forever. So each rank first publishes whether it can, and all take the
same way. Every function here blocks (store waits, NCCL polls): run it off the loop.

Store keys (under the store the bootstrap passes, private to this change):
``nccl-shrink/{rank}``; ``nccl-grow/vote/{rank}``, ``nccl-grow/mode`` ("grow" or
"init"), ``nccl-grow/uid`` (the root's ``ncclCommGetUniqueId``, hex).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Protocol, Sequence

from ..._base.foreign import creation_error, kind_of

MODE, UID = "nccl-grow/mode", "nccl-grow/uid"


class Member(Protocol):
    """The backend methods the agreements use (``NcclBackend``)."""

    rank: int
    world_size: int

    @property
    def can_shrink(self) -> bool: ...

    @property
    def can_grow(self) -> bool: ...

    def discard(self) -> None: ...

    def shrink(
        self, exclude: Sequence[int], abort_pending: bool | None = None, *, timeout: float = 60.0
    ) -> Any: ...

    def grow(self, new_size: int, uid: bytes | None, *, timeout: float = 60.0) -> Any: ...

    def grow_id(self) -> bytes: ...


def _left(deadline: float) -> timedelta:
    return timedelta(seconds=max(0.001, deadline - time.monotonic()))


def _wait(store: Any, keys: list[str], deadline: float, what: str) -> None:
    """``store.wait`` bounded by ``deadline``; a store that gives up is CollectiveTimeout
    (torch raises ``DistStoreError`` when the keys did not come in time: ``foreign.kind_of``)."""
    import torch.distributed as dist

    try:
        store.wait(keys, _left(deadline))
    except dist.DistStoreError as exc:
        raise creation_error(exc, kind_of(exc), what=what) from exc


def shrink_agreed(
    be: Member,
    store: Any,
    new_rank: int,
    new_size: int,
    exclude: Sequence[int],
    abort_pending: bool | None,
    timeout: float,
) -> Any:
    """``be.shrink`` if every survivor can shrink, else None (build a new one).

    Every survivor calls it with the new communicator's store: each publishes whether
    its communicator can still be shrunk (a revoke that fell back to abort cannot),
    and all take the same way, so no survivor waits in ``ncclCommShrink`` for one that
    re-initialises.
    """
    if not exclude:
        # ncclCommShrink refuses an empty exclusion (NCCL src/init.cc: excludeRanksCount > 0);
        # every survivor has the same (agreed) list, so all build a new communicator.
        be.discard()
        return None
    deadline = time.monotonic() + timeout
    store.set(f"nccl-shrink/{new_rank}", "1" if be.can_shrink else "0")
    keys = [f"nccl-shrink/{r}" for r in range(new_size)]
    _wait(store, keys, deadline, "NCCL shrink")
    if not all(bytes(v) == b"1" for v in store.multi_get(keys)):
        be.discard()  # nobody shrinks it: free it before the new init
        return None
    return be.shrink(exclude, abort_pending, timeout=max(0.001, deadline - time.monotonic()))


def grow_agreed(be: Member, store: Any, new_size: int, timeout: float) -> Any:
    """Every member calls it: a backend of ``new_size`` ranks over ``ncclCommGrow`` where every
    member can grow, else None (every member and joiner then builds a new communicator).

    Rank 0 is the grow root: it collects the votes, and when all can, takes the
    unique id (``ncclCommGetUniqueId``) and publishes it before the decision, so the
    other members and the joiners (:func:`creation.join_grown`) find it. Old ranks keep
    their numbers; the joiners take ``world_size .. new_size - 1``.
    """
    deadline = time.monotonic() + timeout
    store.set(f"nccl-grow/vote/{be.rank}", "1" if be.can_grow else "0")
    if be.rank == 0:
        keys = [f"nccl-grow/vote/{r}" for r in range(be.world_size)]
        _wait(store, keys, deadline, "NCCL grow")
        ok = all(bytes(v) == b"1" for v in store.multi_get(keys))
        if ok:
            store.set(UID, be.grow_id().hex())
        store.set(MODE, "grow" if ok else "init")
    if joined_mode(store, deadline) != "grow":
        return None
    uid = bytes.fromhex(bytes(store.get(UID)).decode()) if be.rank == 0 else None
    return be.grow(new_size, uid, timeout=max(0.001, deadline - time.monotonic()))


def joined_mode(store: Any, deadline: float) -> str:
    """The members' decision: ``"grow"`` (ncclCommGrow) or ``"init"`` (a new communicator)."""
    _wait(store, [MODE], deadline, "NCCL grow")
    return bytes(store.get(MODE)).decode()


def grow_uid(store: Any) -> bytes:
    return bytes.fromhex(bytes(store.get(UID)).decode())
