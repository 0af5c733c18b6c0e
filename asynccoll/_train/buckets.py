"""Gradient buckets: which parameters are reduced together, and their flat buffers.

A bucket holds the gradients of a few parameters of one dtype and device, packed
into one flat buffer, followed by one *used flag* per parameter::

    [ grad of p0 | grad of p1 | ... | flag p0 | flag p1 | ... ]

The whole buffer is reduced with one SUM all_reduce. A flag is 1 on a rank whose
backward produced a gradient for that parameter (since the last synchronised step),
else 0, so after the reduction a flag of 0 means that no rank used the parameter:
its ``.grad`` is then left untouched, as torch DDP does with
``find_unused_parameters=True``. Carrying the flags inside the bucket costs a few
elements instead of DDP's separate all_reduce of a used-map.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._base.errors import GradSyncError

MIB = 1 << 20


def assign(
    params: Sequence[torch.Tensor], order: Sequence[int], first_bytes: int, cap_bytes: int
) -> list[list[int]]:
    """Split parameter indices into buckets, walking ``order`` (expected ready order).

    Parameters of different dtype or device never share a bucket. A bucket is
    closed once it holds at least its size limit: ``first_bytes`` for the first
    bucket of each (dtype, device), then twice the previous limit, up to
    ``cap_bytes``. Small buckets first let communication start early in backward;
    larger ones later keep the number of ops low. The result depends only on the
    parameters' shapes, dtypes, devices and ``order``, so every rank computes the
    same buckets.
    """
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    closed: dict[tuple[torch.dtype, torch.device], int] = {}  # buckets closed so far, per key
    done: list[tuple[int, list[int]]] = []  # (position of the bucket's first member, members)
    first_at: dict[tuple[torch.dtype, torch.device], int] = {}
    for pos, i in enumerate(order):
        p = params[i]
        key = (p.dtype, p.device)
        members, size = open_.get(key, ([], 0))
        if not members:
            first_at[key] = pos
        members.append(i)
        size += p.numel() * p.element_size()
        k = closed.get(key, 0)
        limit = min(cap_bytes, first_bytes << min(k, 48))
        if size >= limit:
            done.append((first_at[key], members))
            closed[key] = k + 1
            open_.pop(key, None)
        else:
            open_[key] = (members, size)
    for key, (members, _) in open_.items():
        done.append((first_at[key], members))
    done.sort(key=lambda item: item[0])
    return [members for _, members in done]


def storages(
    buckets: Sequence[Sequence[int]], params: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Each bucket's buffer (``len`` of its members + one flag each), carved out of ONE
    zeroed storage per (dtype, device): one allocation for all the buckets of a kind."""
    keys = [(params[members[0]].dtype, params[members[0]].device) for members in buckets]
    sizes = [sum(params[i].numel() for i in members) + len(members) for members in buckets]
    totals: dict[tuple[torch.dtype, torch.device], int] = {}
    for key, size in zip(keys, sizes):
        totals[key] = totals.get(key, 0) + size
    for (dtype, device), total in totals.items():
        if device.type == "cpu":
            # One block of the storage's size, never touched, freed at once. glibc's malloc
            # gives the top of its heap back to the kernel when more than twice its mmap
            # threshold is free there, and raises that threshold only when a block it had
            # mmapped is freed: without this, the gradients backward allocates and drops
            # were handed back and paged in again every step (6 x Linear(1024): 1,000-4,000
            # minor faults a step; DDP escapes it by freeing its first bucket when it
            # rebuilds its buckets). Two system calls, no page touched.
            torch.empty(total, dtype=dtype)
    flat = {key: torch.zeros(total, dtype=key[0], device=key[1]) for key, total in totals.items()}
    offsets = dict.fromkeys(totals, 0)
    out = []
    for key, size in zip(keys, sizes):
        out.append(flat[key][offsets[key] : offsets[key] + size])
        offsets[key] += size
    return out


class Bucket:
    """The flat buffer of one bucket and the views of its parameters' gradients."""

    __slots__ = (
        "as_view",
        "buffer",
        "flags",
        "grads",
        "index",
        "members",
        "numel",
        "params",
        "pending",
        "saved",
        "shadow",
        "views",
        "work",
    )

    def __init__(
        self,
        index: int,
        members: Sequence[int],
        params: Sequence[torch.Tensor],
        grad_views: bool,
        buffer: torch.Tensor,
    ) -> None:
        self.index = index
        self.members = list(members)  # parameter indices, in buffer order
        self.params = [params[i] for i in members]
        self.numel = sum(p.numel() for p in self.params)
        self.buffer = buffer  # zeros, numel + one flag per member (``storages``)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in self.params:
            n = p.numel()
            self.views.append(self.buffer[offset : offset + n].view(p.shape))
            offset += n
        self.flags = self.buffer[self.numel :]
        # The slots whose parameter's .grad is (still) the slot's view, as set by
        # unpack(); None elsewhere. Compared by identity: a new .grad replaces it.
        self.grads: list[torch.Tensor | None] = [None] * len(self.params)
        # The slots whose reduced gradient is handed over as the view itself (``grad_views``,
        # a contiguous parameter): unpack() makes .grad the view, and the hook may drop
        # the tensor backward produced once it is in the slot.
        self.as_view = [grad_views and p.is_contiguous() for p in self.params]
        # Slots whose .grad is the view and was filled in without a hook (unused in
        # this step): the value to restore if no rank used the parameter.
        self.saved: dict[int, torch.Tensor] = {}
        self.shadow: torch.Tensor | None = None  # join: the zeros (and flags) this rank sends
        self.pending = len(self.params)
        self.work: object | None = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def put(self, slot: int, grad: torch.Tensor | None, scale: float | None) -> None:
        """Copy ``grad`` (times ``scale``) into the slot; zeros when there is no gradient."""
        view = self.views[slot]
        if grad is None:
            view.zero_()
        elif grad is self.grads[slot]:  # .grad is still our view: accumulated in place
            if scale is not None:
                view.mul_(scale)
        elif grad.layout is not torch.strided:
            raise GradSyncError(
                f"GradSync: parameter {self.members[slot]} has a {grad.layout} gradient; "
                "only dense gradients are supported"
            )
        elif scale is None:
            view.copy_(grad)
        else:
            torch.mul(grad, scale, out=view)

    def unpack(self, used: Sequence[bool]) -> None:
        """Hand the reduced buffer to the parameters' ``.grad`` (loop thread).

        ``used[i]``: parameter ``i`` (an index into GradSync's parameters) produced a
        gradient on this rank. In an ``as_view`` slot the parameter's ``.grad``
        becomes its view of the buffer (no copy); it stays so until something
        replaces it (``zero_grad()`` setting it to None, or a new assignment).
        Otherwise the values are copied into ``.grad``.
        """
        global_used: list[float] | None = None
        views, grads, members, as_view = self.views, self.grads, self.members, self.as_view
        with torch.no_grad():
            for slot, p in enumerate(self.params):
                grad = p.grad
                if not used[members[slot]]:
                    if global_used is None:  # only here: reading the flags may sync a device
                        global_used = self.flags.tolist()
                    if global_used[slot] == 0:  # no rank used it: its .grad stays as it was
                        saved = self.saved.get(slot)
                        if saved is not None:
                            views[slot].copy_(saved)
                        continue
                if grad is not None and grad is grads[slot]:
                    continue  # .grad is the view: reduced in place
                view = views[slot]
                if as_view[slot]:
                    p.grad = view
                    grads[slot] = view
                elif grad is None:
                    p.grad = view.clone()
                else:
                    grad.copy_(view)

    def shadow_buffer(self) -> torch.Tensor:
        """Join: what this rank contributes to a step it shadows (zeros, and flags).

        The first shadowed step of a join keeps the flags of the last real
        reduction; the later ones keep what the previous shadow reduction left.
        """
        shadow = self.shadow
        if shadow is None:
            shadow = self.shadow = torch.zeros_like(self.buffer)
            shadow[self.numel :].copy_(self.flags)
        else:
            shadow[: self.numel].zero_()
        return shadow

    def reset(self) -> None:
        self.pending = len(self.params)
        self.work = None
        self.saved.clear()
