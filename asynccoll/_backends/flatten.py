"""Coalesced batches for backends without a native group call (Gloo, wrapped groups).

``submit_batch(submit, specs, works, rank, world_size)`` runs a batch as few collectives
as it can: members that share a *flat key* are packed into one contiguous buffer
and run as ONE collective through ``submit``; results are copied back
into each member's output, then every member Work settles (or all fail together).

Flat keys (everything else runs as itself, through ``submit``):

=================  ===========================================  ===========================
kind               key                                          flat layout
=================  ===========================================  ===========================
all_reduce         dtype, device, reduce op                     members concatenated
broadcast          dtype, device, root                          members concatenated
all_gather         dtype, device                                inputs concatenated; output
                                                                is ``world_size`` such rows
reduce_scatter     dtype, device, reduce op                     row ``r`` = every member's
                                                                chunk ``r``, concatenated
=================  ===========================================  ===========================

Order: walking the batch in call order, a flat group is issued where its first
member appears, and every other op where it appears. The plan depends only on the
sequence of (kind, dtype, device, root, reduce op), so every rank running the same
program issues the same collectives in the same order; point-to-point ops (which
differ between ranks) are never grouped and do not affect the plan's collectives.
A group of one member is submitted as it is (no copies). AVG keeps the backend's
own handling (native, or SUM plus a fix-up on the flat buffer).

All flat buffers are built before anything is submitted, so a failure while
building leaves the whole batch unstarted.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .._base.ops import OpKind, OpSpec
from .._core.work import Bundle, Work

_AR, _BC, _AG, _RS = OpKind.ALL_REDUCE, OpKind.BROADCAST, OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER


def flat_key(spec: OpSpec) -> tuple[Any, ...] | None:
    """The grouping key of ``spec``, or None if it always runs on its own.

    Hot path (once per member): enums hash in Python, so the key holds ``id()`` of
    the kind and reduce op (both singletons) instead of the enums themselves.
    Tensors are contiguous (``validate`` makes sure).
    """
    kind = spec.kind
    t = spec.tensor
    # get_device() (an int, -1 on CPU) costs a fifth of building ``t.device``; the
    # backend serves one device type, so the index alone tells devices apart.
    if kind is _AR or kind is _RS:
        return (id(kind), t.dtype, t.get_device(), id(spec.reduce_op))
    if kind is _BC:
        return (id(kind), t.dtype, t.get_device(), spec.peer)
    if kind is _AG:
        return (id(kind), t.dtype, t.get_device())
    return None


def plan(specs: Sequence[OpSpec]) -> list[list[int]]:
    """Indices of ``specs`` per collective to issue, in issue order (module docstring).
    (``submit_batch`` takes the common all-alike batch before it gets here.)"""
    steps: list[list[int]] = []
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, spec in enumerate(specs):
        key = flat_key(spec)
        if key is None:
            steps.append([i])
            continue
        members = groups.get(key)
        if members is None:
            members = groups[key] = [i]
            steps.append(members)
        else:
            members.append(i)
    return steps


def _alike(specs: Sequence[OpSpec]) -> list[torch.Tensor] | None:
    """The members' tensors if every spec is an all_reduce with the first one's reduce
    op, dtype and device (else None): the check and the list in one pass."""
    first = specs[0]
    if first.kind is not _AR:
        return None
    rop, t0 = first.reduce_op, first.tensor
    dtype, device = t0.dtype, t0.get_device()
    tensors: list[torch.Tensor] = []
    append = tensors.append
    for spec in specs:
        t = spec.tensor
        if (
            spec.kind is not _AR
            or spec.reduce_op is not rop
            or t.dtype is not dtype
            or t.get_device() != device
        ):
            return None
        append(t)
    return tensors


def submit_batch(
    submit: Callable[[OpSpec, Work | Bundle], None],
    specs: Sequence[OpSpec],
    works: Sequence[Work],
    rank: int,
    world_size: int,
) -> None:
    """Issue a batch through ``submit`` (a backend's own, past its gate), flattening
    what can be flattened (module docstring)."""
    if len(specs) == 1:
        submit(specs[0], works[0])
        return
    tensors = _alike(specs)
    if tensors is not None:  # the common batch: one flat all_reduce, with the caller's own lists
        spec, bundle = _flatten(specs, works, rank, world_size, tensors)
        submit(spec, bundle)
        return
    issue: list[tuple[OpSpec, Work | Bundle]] = []
    for idx in plan(specs):
        if len(idx) == 1:
            i = idx[0]
            issue.append((specs[i], works[i]))
        else:
            issue.append(
                _flatten([specs[i] for i in idx], [works[i] for i in idx], rank, world_size)
            )
    for spec, work in issue:
        submit(spec, work)


# --------------------------------------------------------------------------- packing
# Per-tensor torch calls cost microseconds each (dispatcher), so packing and copying
# back use one call over the whole list where torch has one: ``cat`` and
# ``split_with_sizes_copy``; 1-D members (the common case) need no views at all.


def _flat_views(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` as 1-D tensors: themselves when all are 1-D (no view made)."""
    for t in tensors:
        if t.ndim != 1:
            return [t.view(-1) for t in tensors]
    return tensors


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The members concatenated into one new 1-D buffer."""
    return torch.cat(_flat_views(tensors))


def _unpack_into(
    dsts: list[torch.Tensor], flat: torch.Tensor, numels: list[int]
) -> Callable[[], None]:
    """A copy-back of consecutive pieces of 1-D ``flat`` into the 1-D ``dsts``
    (``_flat_views``, made once for packing and copying back)."""

    def copy() -> None:
        torch.split_with_sizes_copy(flat, numels, out=dsts)

    return copy


def _flatten(
    specs: Sequence[OpSpec],
    works: Sequence[Work],
    rank: int,
    ws: int,
    tensors: list[torch.Tensor] | None = None,
) -> tuple[OpSpec, Bundle]:
    """One flat spec standing for ``specs`` (whose tensors ``_alike`` may have listed
    already), and the Bundle of ``works`` it settles."""
    first = specs[0]
    kind = first.kind
    if tensors is None:
        tensors = [s.tensor for s in specs]
    timeout = max([s.timeout for s in specs])
    t0 = first.tensor
    copy_back: Callable[[], None] | None
    keep: Any
    if kind is OpKind.ALL_REDUCE or kind is OpKind.BROADCAST:
        numels = [t.numel() for t in tensors]
        views = _flat_views(tensors)
        if kind is OpKind.BROADCAST and rank == first.peer:
            flat = torch.cat(views)
            copy_back = None  # the root's tensors are the source: unchanged
        elif kind is OpKind.BROADCAST:
            flat = torch.empty(sum(numels), dtype=t0.dtype, device=t0.device)
            copy_back = _unpack_into(views, flat, numels)
        else:
            flat = torch.cat(views)
            copy_back = _unpack_into(views, flat, numels)
        flat_spec = OpSpec(kind, flat, None, first.reduce_op, first.peer, timeout)
        keep = flat
    elif kind is OpKind.ALL_GATHER:
        # output row r (of world_size) = rank r's inputs, concatenated
        outs = [s.output for s in specs]
        numels = [t.numel() for t in tensors]
        flat_in = _pack(tensors)
        total = flat_in.numel()
        flat_out = torch.empty(ws * total, dtype=t0.dtype, device=t0.device)
        flat_spec = OpSpec(kind, flat_in, flat_out, first.reduce_op, first.peer, timeout)
        copy_back = _gather_rows_into(outs, flat_out.view(ws, total), numels)
        keep = (flat_in, flat_out)
    else:  # REDUCE_SCATTER: input row r = every member's chunk r, concatenated
        outs = [s.output for s in specs]
        chunks = [o.numel() for o in outs]
        flat_in = torch.cat([t.view(ws, m) for t, m in zip(tensors, chunks)], dim=1)
        flat_out = torch.empty(sum(chunks), dtype=t0.dtype, device=t0.device)
        flat_spec = OpSpec(kind, flat_in.view(-1), flat_out, first.reduce_op, first.peer, timeout)
        copy_back = _unpack_into(_flat_views(outs), flat_out, chunks)
        keep = (flat_in, flat_out)
    return flat_spec, Bundle(works, kind.value, copy_back, keep)


def _gather_rows_into(
    outs: list[torch.Tensor], flat2d: torch.Tensor, numels: list[int]
) -> Callable[[], None]:
    """A copy-back of column block ``i`` of ``flat2d`` (world_size rows) into ``outs[i]``."""
    ws = flat2d.shape[0]

    def copy() -> None:
        torch.split_with_sizes_copy(
            flat2d, numels, dim=1, out=[o.view(ws, n) for o, n in zip(outs, numels)]
        )

    return copy
