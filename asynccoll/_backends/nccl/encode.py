"""From OpSpecs to the NCCL calls of one launch, all resolved before anything starts.

:func:`plan` runs on the caller's thread at submit: it checks every argument the way
nccl4py and NCCL would (dtype, device, counts), maps dtypes and reduce ops, and
binds each NCCL call to its arguments. The launcher then only makes the calls, so
nothing can fail between ``ncclGroupStart`` and ``ncclGroupEnd`` for a reason known
beforehand: on a non-blocking communicator a half-built group cannot be discarded
(``ncclGroupSimulateEnd`` launches it: NCCL src/group.cc ``groupLaunchNonBlocking``),
it would run on this rank alone.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from ..._base.errors import InvalidArgument
from ..._base.ops import OpKind, OpSpec, ReduceOp
from .caps import COMPLEX, NATIVE, REDUCING, NcclCaps

#: One NCCL call: ``call(communicator, stream_handle)``.
Call = Callable[[Any, int], None]
Post = list[Callable[[], object]]

#: Ops issued as several NCCL point-to-point calls that must form one group.
P2P_KINDS = (OpKind.ALL_TO_ALL, OpKind.GATHER, OpKind.SCATTER)


class Plan:
    """The NCCL calls of one launch, the fix-ups after them, and the tensors they use."""

    __slots__ = ("calls", "post", "tensors", "grouped")

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.post: Post = []
        self.tensors: list[torch.Tensor] = []
        self.grouped = False


def plan(
    specs: Sequence[OpSpec],
    *,
    device: torch.device,
    rank: int,
    ws: int,
    caps: NcclCaps,
    lib: Any,
    scratch: torch.Tensor,
) -> Plan:
    """The plan of ``specs`` (one op, or a coalesced batch run as one NCCL group).

    Raises InvalidArgument for anything NCCL cannot run; nothing has started then.
    """
    p = Plan()
    if len(specs) == 1 and specs[0].kind is OpKind.ALL_REDUCE:  # the common case, with fewest reads
        spec = specs[0]
        t = spec.tensor
        dt = check(spec, t, device, caps)
        p.tensors.append(t)
        v, op = reducible(t, spec.reduce_op, ws, p.post, dt)
        p.calls.append(functools.partial(_allreduce, v, lib.redop(op)))
        return p
    for spec in specs:
        for t in (spec.tensor, spec.output):
            if t is not None:
                check(spec, t, device, caps)
                p.tensors.append(t)
    for spec in specs:
        _calls(spec, rank, ws, lib, scratch, p)
    p.grouped = len(specs) > 1 or any(s.kind in P2P_KINDS for s in specs)
    return p


def check(spec: OpSpec, t: torch.Tensor, device: torch.device, caps: NcclCaps) -> torch.dtype:
    """Refuse (InvalidArgument) what NCCL cannot run, before anything starts; ``t``'s dtype."""
    if t.device != device:
        raise InvalidArgument(
            f"{spec.kind.value}: tensor on {t.device}, but this NCCL communicator uses {device}"
        )
    dt = t.dtype
    if spec.kind in REDUCING and (spec.reduce_op is not ReduceOp.SUM or dt not in caps.sum):
        why = caps.refusal(spec.reduce_op, dt)
        if why is not None:
            raise InvalidArgument(f"{spec.kind.value}: {why}")
    return dt


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` as NCCL can move it: as is, or as bytes for dtypes nccl4py cannot map (e.g. complex)."""
    if t.dtype in NATIVE:
        return t
    return t.reshape(-1).view(torch.uint8)


def reducible(
    t: torch.Tensor,
    op: ReduceOp,
    ws: int,
    post: Post,
    dt: torch.dtype | None = None,
) -> tuple[torch.Tensor, ReduceOp]:
    """The tensor view and op to reduce ``t`` (of dtype ``dt``) with ``op``; queues fix-ups on ``post``."""
    if dt is None:
        dt = t.dtype
    if dt is torch.bool:  # as uint8: SUM/MAX = logical or, PROD/MIN = logical and
        as_uint8 = ReduceOp.MAX if op in (ReduceOp.SUM, ReduceOp.MAX) else ReduceOp.MIN
        return t.view(torch.uint8), as_uint8
    if dt in COMPLEX:
        t = torch.view_as_real(t)
        dt = t.dtype
    if op is ReduceOp.AVG and not dt.is_floating_point and dt not in UNSIGNED:
        # Rounded down, as Gloo and torch do.
        post.append(functools.partial(t.div_, ws, rounding_mode="floor"))
        op = ReduceOp.SUM
    return t, op


#: Unsigned integers average with NCCL's own ncclAvg: for an integer type it is a sum, then
#: a division by nranks (``ncclDevSumPostDiv``, NCCL src/enqueue.cc ``hostToDevRedOp``), which
#: truncates: the floor, as for the signed types' fix-up. That fix-up (``div_`` with
#: ``rounding_mode="floor"``) does not exist in torch for uint16/32/64 (NotImplementedError
#: "div_floor" not implemented for 'UInt32', torch 2.13): it would fail on the comm stream.
UNSIGNED = frozenset(
    getattr(torch, n) for n in ("uint8", "uint16", "uint32", "uint64") if hasattr(torch, n)
)


def _need(ok: bool, spec: OpSpec, what: str) -> None:
    if not ok:
        raise InvalidArgument(f"{spec.kind.value}: {what}")


def _allreduce(v: Any, op: Any, comm: Any, stream: int) -> None:
    comm.allreduce(v, v, op, stream=stream)


def _reduce(v: Any, op: Any, root: int, comm: Any, stream: int) -> None:
    comm.reduce(v, v, op, root, stream=stream)


def _reduce_scatter(vi: Any, vo: Any, op: Any, comm: Any, stream: int) -> None:
    comm.reduce_scatter(vi, vo, op, stream=stream)


def _broadcast(v: Any, root: int, comm: Any, stream: int) -> None:
    comm.broadcast(v, v, root, stream=stream)


def _allgather(vi: Any, vo: Any, comm: Any, stream: int) -> None:
    comm.allgather(vi, vo, stream=stream)


def _send(v: Any, peer: int, comm: Any, stream: int) -> None:
    comm.send(v, peer, stream=stream)


def _recv(v: Any, peer: int, comm: Any, stream: int) -> None:
    comm.recv(v, peer, stream=stream)


def _calls(spec: OpSpec, rank: int, ws: int, lib: Any, scratch: torch.Tensor, p: Plan) -> None:
    """Append the NCCL call(s) of one op to ``p`` (a P2P op must run inside a group)."""
    kind = spec.kind
    t, out = spec.tensor, spec.output
    add, post = p.calls.append, p.post
    P = functools.partial
    if kind is OpKind.ALL_REDUCE:
        v, op = reducible(t, spec.reduce_op, ws, post)
        add(P(_allreduce, v, lib.redop(op)))
    elif kind is OpKind.REDUCE:
        v, op = reducible(t, spec.reduce_op, ws, post if spec.peer == rank else [])
        add(P(_reduce, v, lib.redop(op), spec.peer))
    elif kind is OpKind.REDUCE_SCATTER:
        vi, op = reducible(t, spec.reduce_op, ws, [])
        vo, _ = reducible(out, spec.reduce_op, ws, post)
        _need(
            vi.dtype == vo.dtype and vi.numel() >= vo.numel() * ws,
            spec,
            "input must be world_size * output",
        )
        add(P(_reduce_scatter, vi, vo, lib.redop(op)))
    elif kind is OpKind.BROADCAST:
        add(P(_broadcast, raw(t), spec.peer))
    elif kind is OpKind.ALL_GATHER:
        vi, vo = raw(t), raw(out)
        _need(
            vi.dtype == vo.dtype and vo.numel() >= vi.numel() * ws,
            spec,
            "output must be world_size * input",
        )
        add(P(_allgather, vi, vo))
    elif kind is OpKind.ALL_TO_ALL:
        ins, outs = t.chunk(ws), out.chunk(ws)
        for peer in range(ws):
            add(P(_send, raw(ins[peer]), peer))
            add(P(_recv, raw(outs[peer]), peer))
    elif kind is OpKind.GATHER:
        root = spec.peer
        if rank != root:
            add(P(_send, raw(t), root))
        else:
            outs = out.chunk(ws)
            for peer in range(ws):
                if peer != root:
                    add(P(_recv, raw(outs[peer]), peer))
            post.append(P(outs[root].copy_, t))
    elif kind is OpKind.SCATTER:
        root = spec.peer
        if rank != root:
            add(P(_recv, raw(out), root))
        else:
            ins = t.chunk(ws)
            for peer in range(ws):
                if peer != root:
                    add(P(_send, raw(ins[peer]), peer))
            post.append(P(out.copy_, ins[root]))
    elif kind is OpKind.SEND:
        add(P(_send, raw(t), spec.peer))
    elif kind is OpKind.RECV:
        add(P(_recv, raw(t), spec.peer))
    elif kind is OpKind.BARRIER:
        add(P(_allreduce, scratch, lib.redop(ReduceOp.SUM)))
    else:  # pragma: no cover - OpKind is closed
        raise InvalidArgument(f"unsupported op {kind}")
