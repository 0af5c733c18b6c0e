"""Shrink and grow of an NCCL backend: ``ncclCommShrink``/``ncclCommGrow`` and the
agreement that every member can (``agree.py``). Part of :class:`~.launcher.NcclBackend`,
apart from its launch and completion path; the communicator handle does the NCCL side
(``handle.py``)."""

from __future__ import annotations

import time
from typing import Any, Sequence, cast

from ..._base.errors import CommAborted, InvalidArgument
from . import agree
from .handle import CommHandle


class Renewal:
    """The shrink/grow methods of :class:`~.launcher.NcclBackend` (a mix-in: its fields)."""

    _handle: CommHandle
    _inflight: Any
    _pending: Any
    _launching: Any
    _broken: bool
    _rt: Any
    _lib: Any
    _forget: Any
    rank: int
    world_size: int
    device: Any
    health_interval: float

    def discard(self) -> None:
        """``ncclCommAbort`` a revoked communicator nobody will shrink (bounded, idempotent)."""
        self._handle.discard()

    def shrink(
        self, exclude: Sequence[int], abort_pending: bool | None = None, *, timeout: float = 60.0
    ) -> Any:
        """A new backend over ``ncclCommShrink`` without the ``exclude`` ranks (blocking, off the loop).

        Every surviving rank calls it; excluded ranks must not. ``abort_pending`` (default:
        ops queued or in flight here, or an error seen) shrinks with ``CommShrinkFlag.ABORT``
        (the parent's ops are terminated first), else ``DEFAULT`` (they must be quiesced).
        Survivors are renumbered in order; the new backend gets its own comm stream. Needs
        the parent alive or revoked; after an ``ncclCommAbort``, ``create`` a new one.
        """
        if not self._handle.can_shrink:
            raise CommAborted(
                "the NCCL communicator was aborted; create a new one instead of shrinking"
            )
        drop = sorted(set(int(r) for r in exclude))
        if self.rank in drop:
            raise InvalidArgument(
                f"rank {self.rank} cannot shrink a communicator it is excluded from"
            )
        if (
            not drop
            or any(not 0 <= r < self.world_size for r in drop)
            or len(drop) >= self.world_size
        ):
            raise InvalidArgument(
                f"cannot exclude {drop} from a communicator of {self.world_size} ranks "
                "(ncclCommShrink needs at least one rank to exclude, and one to keep)"
            )
        if abort_pending is None:
            abort_pending = bool(self._inflight or self._pending or self._launching) or self._broken
        child = self._handle.shrink(drop, abort_pending, time.monotonic() + timeout)
        rank = self.rank - sum(1 for r in drop if r < self.rank)
        return self._successor(child, rank, self.world_size - len(drop))

    def shrink_agreed(
        self,
        store: Any,
        new_rank: int,
        new_size: int,
        exclude: Sequence[int],
        abort_pending: bool | None,
        timeout: float,
    ) -> Any | None:
        """:meth:`shrink` when every survivor can, else None; see :func:`agree.shrink_agreed`."""
        new: Any | None = agree.shrink_agreed(
            cast(Any, self), store, new_rank, new_size, exclude, abort_pending, timeout
        )
        return new

    def split(self, color: int | None, rank: int, size: int, timeout: float = 60.0) -> Any | None:
        """A new backend over ``ncclCommSplit`` (blocking, off the loop): the ranks of one
        ``color`` form it, this one as ``rank`` of ``size`` (NCCL's key: the order in the
        group). Every rank of this communicator calls it; ``color`` None: this rank is in
        no group (NCCL_SPLIT_NOCOLOR) and gets None. The parent stays as it was."""
        child = self._handle.split(color, rank, time.monotonic() + timeout)
        return None if child is None else self._successor(child, rank, size)

    @property
    def can_grow(self) -> bool:
        """Whether :meth:`grow` can use ``ncclCommGrow`` (healthy, and NCCL has it)."""
        return self._handle.can_grow and not self._broken

    def grow_agreed(self, store: Any, new_size: int, timeout: float) -> Any | None:
        """A backend of ``new_size`` ranks over ``ncclCommGrow`` when every member can grow,
        else None (build a new one); see :func:`agree.grow_agreed`."""
        new: Any | None = agree.grow_agreed(cast(Any, self), store, new_size, timeout)
        return new

    def grow(self, new_size: int, uid: bytes | None, *, timeout: float = 60.0) -> Any:
        """A new backend of ``new_size`` ranks over ``ncclCommGrow`` (blocking): this rank keeps
        its number; ``uid``: the root's id (:meth:`grow_id`), None on the other members."""
        if new_size <= self.world_size:
            raise InvalidArgument(f"grow needs more than {self.world_size} ranks, got {new_size}")
        try:
            child = self._handle.grow(new_size, uid, time.monotonic() + timeout)
        except BaseException:
            # A grow that did not complete leaves the parent in ncclInProgress with the job
            # pending: no NCCL call may follow but ncclCommAbort (nccl4py get_async_error docs).
            self._handle.stop(revoke=False, after=self._forget)
            raise
        return self._successor(child, self.rank, new_size)

    def grow_id(self) -> bytes:
        """The unique id new ranks join with (``ncclCommGetUniqueId``; the root only; one grow)."""
        return self._handle.grow_id()

    def _successor(self, child: Any, rank: int, world_size: int) -> Any:
        h = self._handle
        new = cast(Any, type(self))(
            child,
            rank=rank,
            world_size=world_size,
            device=self.device,
            lib=self._lib,
            runtime=self._rt.sibling(),
            health_interval=self.health_interval,
            abort_timeout=h.abort_timeout,
            close_timeout=h.close_timeout,
            use_revoke=h.use_revoke,
        )
        new.bind(cast(Any, self).sink)  # until the new communicator binds its own ledger
        return new
