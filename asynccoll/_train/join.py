"""``async with sync.join():`` — training with uneven inputs, as torch DDP's ``Join``.

Protocol (every rank issues the same collectives in the same order):

* While a rank trains inside the block, each synchronised step begins with a
  *presence* all_reduce of ``1`` (issued by the step's first gradient hook, or by
  ``wait()``), followed by the step's bucket all_reduces.
* A rank that leaves the block (out of data) loops: it all_reduces ``0`` to count
  the ranks still training (this matches their presence op); if the count is
  ``0`` every rank has left and the loop ends, otherwise it *shadows* one step by
  all_reducing a zero buffer for every bucket, in bucket order.
* Then the ranks agree on the authoritative copy: the highest rank among those
  that never shadowed a step (the last to leave), by an all_reduce MAX, and
  broadcast its parameters (and a module's buffers) to everyone.

Results equal DDP's ``join()`` with its defaults: zeros from the joined ranks and
a division by the full world size (``divide_by_initial_world_size=True``), no
optimizer steps on joined ranks, the final model from the last joiner. Steps under
``no_sync()`` issue nothing, so joined ranks simply keep waiting for the next
synchronised step (DDP instead exchanges two small all-reduces per such step; the
numbers are the same).

A joined rank waits in its count all_reduce for as long as one synchronised step
(or one accumulation cycle) of the others takes; that op is bounded by the
communicator's timeout.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Protocol

import torch

from .._base.errors import GradSyncError, InvalidArgument
from .._base.ops import ReduceOp


class Joinable(Protocol):
    """What the join protocol needs of a GradSync (its public join steps)."""

    comm: Any
    params: list[torch.Tensor]
    module: torch.nn.Module | None

    def begin_join(self) -> None: ...

    def leave_join(self) -> bool: ...

    async def shadow_step(self) -> None: ...

    def end_join(self) -> None: ...


class Join:
    """The async context manager returned by :meth:`asynccoll.GradSync.join`."""

    def __init__(self, sync: Joinable) -> None:
        self._sync = sync
        self._entered = False
        #: The rank whose model every rank holds after the block.
        self.authoritative_rank: int | None = None
        #: How many of the others' steps this rank shadowed (known after the block).
        self.shadowed_steps = 0

    async def __aenter__(self) -> Join:
        sync = self._sync
        if self._entered:
            raise InvalidArgument("this join() context was already entered; call sync.join() again")
        sync.begin_join()
        self._entered = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        sync = self._sync
        pending = sync.leave_join()
        if exc_type is not None:
            return  # as DDP: an exception propagates, nothing is shadowed
        if pending:
            raise InvalidArgument(
                "GradSync.join(): the block ended after a backward without `await sync.wait()`"
            )
        comm = sync.comm
        device = sync.params[0].device
        is_last = True
        while True:
            count = torch.zeros(1, dtype=torch.int32, device=device)
            await comm.all_reduce(count)
            if int(count.item()) == 0:
                break
            is_last = False
            self.shadowed_steps += 1
            await sync.shadow_step()
        sync.end_join()
        self.authoritative_rank = await self._sync_final_model(is_last)

    async def _sync_final_model(self, is_last: bool) -> int:
        sync = self._sync
        comm = sync.comm
        device = sync.params[0].device
        candidate = torch.tensor([comm.rank if is_last else -1], dtype=torch.int64, device=device)
        await comm.all_reduce(candidate, ReduceOp.MAX)
        src = int(candidate.item())
        if src < 0:  # pragma: no cover - the last count is 0 on every rank at once
            raise GradSyncError(
                "GradSync.join(): no rank was the last to join (every rank must run the same join() loop)"
            )
        if sync.module is not None:
            tensors = [p.detach() for p in sync.module.parameters()]
            tensors += [b for b in sync.module.buffers()]
        else:
            tensors = [p.detach() for p in sync.params]
        await broadcast_coalesced(comm, tensors, src)
        return src


async def broadcast_coalesced(comm: Any, tensors: list[torch.Tensor], src: int) -> None:
    """Broadcast ``tensors`` from ``src`` in place: one flat broadcast per (device, dtype)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in tensors:
        if id(t) in seen or t.numel() == 0:
            continue
        seen.add(id(t))
        groups.setdefault((t.device, t.dtype), []).append(t)
    for members in groups.values():
        with torch.no_grad():
            flat = torch.cat([t.reshape(-1) for t in members])
        work = comm.broadcast(flat, src)
        await work
        work.wait_stream()
        with torch.no_grad():
            offset = 0
            for t in members:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n
