"""``comm.broadcast_state(state, src)``: a nested structure of tensors and plain objects
from one rank to every rank.

The source splits the structure in two: the tensors, and a *skeleton* in which each
tensor is replaced by a :class:`_Slot` (its index, dtype, shape and device kind). The
skeleton travels as one object (``broadcast_object``); the receivers allocate the
tensors it describes, and every rank then broadcasts the tensors: those of at least
``DIRECT`` bytes each on its own, all in flight together, and the smaller ones in one
coalesced batch (Gloo: one flattened collective per dtype; NCCL: one group). A tensor that
appears twice in the structure (tied weights) travels once and comes back as one
tensor in both places.

What travels as a tensor: a dense (strided) tensor that is not quantized, on a device
the communicator serves. Other tensors (sparse, quantized, meta) are pickled with the
skeleton. A CUDA tensor on a communicator without NCCL, or a skeleton that cannot be
pickled, is refused on the source, and the receivers are told, so every rank raises
``InvalidArgument`` and the communicator stays usable.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch

from .._base.errors import InvalidArgument
from . import validate

#: Tensors of at least this many bytes travel as broadcasts of their own: flattening
#: them into a coalesced batch would copy every byte twice for no saving (measured in
#: ``bench/elastic.py``'s state-transfer floor); smaller ones are coalesced.
DIRECT = 1 << 20

_QUANTIZED = (torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4)


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where a tensor sat in the structure, and what the receivers allocate for it."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    cuda: bool


@dataclasses.dataclass(frozen=True)
class _Refused:
    """Sent in place of the skeleton when the source refused its own state."""

    reason: str


def _serves_cuda(comm: Any) -> bool:
    return bool(comm.device.type == "cuda")


def _serves_cpu(comm: Any) -> bool:
    return bool(comm.backend != "nccl")


def _travels(t: torch.Tensor) -> bool:
    return (
        t.layout is torch.strided and t.dtype not in _QUANTIZED and t.device.type in ("cpu", "cuda")
    )


def _strip(obj: Any, tensors: list[torch.Tensor], seen: dict[int, _Slot]) -> Any:
    """``obj`` with each travelling tensor replaced by its slot (appended to ``tensors``)."""
    if isinstance(obj, torch.Tensor):
        if not _travels(obj):
            return obj
        slot = seen.get(id(obj))
        if slot is None:
            slot = _Slot(len(tensors), obj.dtype, tuple(obj.shape), obj.is_cuda)
            seen[id(obj)] = slot
            tensors.append(obj)
        return slot
    if isinstance(obj, dict):
        return _rebuild(obj, [(k, _strip(v, tensors, seen)) for k, v in obj.items()])
    if isinstance(obj, list):
        return [_strip(v, tensors, seen) for v in obj]
    if isinstance(obj, tuple):
        return _retuple(obj, [_strip(v, tensors, seen) for v in obj])
    return obj


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """The skeleton with each slot replaced by its received tensor."""
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return _rebuild(obj, [(k, _fill(v, tensors)) for k, v in obj.items()])
    if isinstance(obj, list):
        return [_fill(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return _retuple(obj, [_fill(v, tensors) for v in obj])
    return obj


def _rebuild(like: dict[Any, Any], items: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """A dict of ``like``'s kind (dict, OrderedDict, defaultdict, ...) holding ``items``."""
    if isinstance(like, collections.defaultdict):
        out: dict[Any, Any] = collections.defaultdict(like.default_factory)
        out.update(items)
        return out
    try:
        return type(like)(items)
    except TypeError:  # a dict subclass whose constructor takes other arguments
        return dict(items)


def _retuple(like: tuple[Any, ...], items: list[Any]) -> tuple[Any, ...]:
    if hasattr(like, "_fields"):  # a namedtuple
        return type(like)(*items)
    return tuple(items)


def _outgoing(t: torch.Tensor) -> torch.Tensor:
    """A source tensor as a broadcast takes it: detached, dense, contiguous, resolved."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t.contiguous()


async def broadcast_state(comm: Any, state: Any, src: int, timeout: float | None) -> Any:
    """See ``Communicator.broadcast_state`` (``comm``: the Communicator; typed loosely, as
    this module must not import the one that imports it)."""
    src = validate.rank(src, comm.world_size, "src")
    if timeout is not None:
        validate.timeout(timeout, comm.timeout)
    if comm.rank == src:
        tensors: list[torch.Tensor] = []
        skeleton = _strip(state, tensors, {})
        try:
            if any(t.is_cuda for t in tensors) and not _serves_cuda(comm):
                raise InvalidArgument(
                    f"broadcast_state: the state holds CUDA tensors, and this {comm.backend!r} "
                    "communicator serves no CUDA device"
                )
            if any(not t.is_cuda for t in tensors) and not _serves_cpu(comm):
                raise InvalidArgument(
                    "broadcast_state: the state holds CPU tensors, and an 'nccl' communicator "
                    "moves CUDA tensors only (use backend='auto')"
                )
            sent = comm.broadcast_object(skeleton, src, timeout=timeout)
        except InvalidArgument as exc:
            await comm.broadcast_object(_Refused(str(exc)), src, timeout=timeout)
            raise
        await sent
        outgoing = [_outgoing(t) for t in tensors]
    else:
        skeleton = await comm.broadcast_object(None, src, timeout=timeout)
        if isinstance(skeleton, _Refused):
            raise InvalidArgument(
                f"broadcast_state: rank {src} refused its state: {skeleton.reason}"
            )
        slots: dict[int, _Slot] = {}
        _collect(skeleton, slots)
        outgoing = [
            torch.empty(s.shape, dtype=s.dtype, device=comm.device if s.cuda else "cpu")
            for s in (slots[i] for i in range(len(slots)))
        ]
    # Every rank splits alike (by size, from the skeleton): large tensors as broadcasts of
    # their own, all in flight at once; the small ones in one coalesced batch.
    large = [t for t in outgoing if t.numel() * t.element_size() >= DIRECT]
    small = [t for t in outgoing if 0 < t.numel() * t.element_size() < DIRECT]
    works = [comm.broadcast(t, src, timeout=timeout) for t in large]
    if small:
        async with comm.coalescing():
            for t in small:
                comm.broadcast(t, src, timeout=timeout)
    for work in works:
        await work
    return state if comm.rank == src else _fill(skeleton, outgoing)


def _collect(obj: Any, slots: dict[int, _Slot]) -> None:
    if isinstance(obj, _Slot):
        slots[obj.index] = obj
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, slots)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect(v, slots)
