"""From an OpSpec to nccl4py calls: argument checks, dtype and reduce-op mapping, the calls.

Everything here runs on the launcher thread with the backend's NCCL lock held,
except :func:`check`, which runs at submit time on the caller's thread.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from ..._base.errors import InvalidArgument
from ..._base.ops import OpKind, OpSpec, ReduceOp
from .lib import _COMPLEX, _NCCL_DTYPES, _REDUCING

Post = list[Callable[[], object]]

#: Ops issued as several NCCL point-to-point calls that must form one group.
P2P_KINDS = (OpKind.ALL_TO_ALL, OpKind.GATHER, OpKind.SCATTER)


def check(spec: OpSpec, device: torch.device, tensors: list[torch.Tensor]) -> None:
    """Refuse (InvalidArgument) what NCCL cannot run, before anything starts."""
    for t in (spec.tensor, spec.output):
        if t is None:
            continue
        if t.device != device:
            raise InvalidArgument(f"{spec.kind.value}: tensor on {t.device}, but this NCCL communicator uses {device}")
        dt = t.dtype
        if spec.kind in _REDUCING:
            if dt in _COMPLEX and spec.reduce_op not in (ReduceOp.SUM, ReduceOp.AVG):
                raise InvalidArgument(f"{spec.kind.value}: {spec.reduce_op.name} is not defined for {dt}")
            if dt not in _NCCL_DTYPES and dt not in _COMPLEX:
                raise InvalidArgument(f"{spec.kind.value}: NCCL cannot reduce {dt}")
        tensors.append(t)


def needs_group(specs: Any) -> bool:
    """Whether a launch must be wrapped in one ``ncclGroupStart/End``."""
    return len(specs) > 1 or any(s.kind in P2P_KINDS for s in specs)


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` as NCCL can move it: as is, or as bytes for dtypes NCCL lacks (e.g. complex)."""
    if t.dtype in _NCCL_DTYPES:
        return t
    return t.reshape(-1).view(torch.uint8)


def reducible(t: torch.Tensor, op: ReduceOp, ws: int, lib: Any, post: Post) -> tuple[torch.Tensor, Any]:
    """The tensor view and NCCL op to reduce ``t`` with ``op``; queues fix-ups on ``post``."""
    if t.dtype is torch.bool:  # as uint8: SUM/MAX = logical or, PROD/MIN = logical and
        op = ReduceOp.MAX if op in (ReduceOp.SUM, ReduceOp.MAX) else ReduceOp.MIN
        return t.view(torch.uint8), lib.redop(op)
    if t.dtype in _COMPLEX:
        t = torch.view_as_real(t)
    if op is ReduceOp.AVG and not t.is_floating_point():
        post.append(lambda: t.div_(ws, rounding_mode="floor"))
        op = ReduceOp.SUM
    return t, lib.redop(op)


def enqueue(
    spec: OpSpec, comm: Any, lib: Any, stream: int, rank: int, ws: int,
    post: Post, scratch: Callable[[], torch.Tensor],
) -> None:
    """Issue the NCCL call(s) of one op on ``stream`` (a P2P op must be inside a group)."""
    kind = spec.kind
    t, out = spec.tensor, spec.output
    if kind is OpKind.ALL_REDUCE:
        v, op = reducible(t, spec.reduce_op, ws, lib, post)
        comm.allreduce(v, v, op, stream=stream)
    elif kind is OpKind.REDUCE:
        v, op = reducible(t, spec.reduce_op, ws, lib, post if spec.peer == rank else [])
        comm.reduce(v, v, op, spec.peer, stream=stream)
    elif kind is OpKind.REDUCE_SCATTER:
        vi, op = reducible(t, spec.reduce_op, ws, lib, [])
        vo, _ = reducible(out, spec.reduce_op, ws, lib, post)
        comm.reduce_scatter(vi, vo, op, stream=stream)
    elif kind is OpKind.BROADCAST:
        v = raw(t)
        comm.broadcast(v, v, spec.peer, stream=stream)
    elif kind is OpKind.ALL_GATHER:
        comm.allgather(raw(t), raw(out), stream=stream)
    elif kind is OpKind.ALL_TO_ALL:
        ins, outs = t.chunk(ws), out.chunk(ws)
        for p in range(ws):
            comm.send(raw(ins[p]), p, stream=stream)
            comm.recv(raw(outs[p]), p, stream=stream)
    elif kind is OpKind.GATHER:
        root = spec.peer
        if rank != root:
            comm.send(raw(t), root, stream=stream)
        else:
            outs = out.chunk(ws)
            for p in range(ws):
                if p != root:
                    comm.recv(raw(outs[p]), p, stream=stream)
            post.append(functools.partial(outs[root].copy_, t))
    elif kind is OpKind.SCATTER:
        root = spec.peer
        if rank != root:
            comm.recv(raw(out), root, stream=stream)
        else:
            ins = t.chunk(ws)
            for p in range(ws):
                if p != root:
                    comm.send(raw(ins[p]), p, stream=stream)
            post.append(functools.partial(out.copy_, ins[root]))
    elif kind is OpKind.SEND:
        comm.send(raw(t), spec.peer, stream=stream)
    elif kind is OpKind.RECV:
        comm.recv(raw(t), spec.peer, stream=stream)
    elif kind is OpKind.BARRIER:
        buf = scratch()
        comm.allreduce(buf, buf, lib.redop(ReduceOp.SUM), stream=stream)
    else:  # pragma: no cover - OpKind is closed
        raise InvalidArgument(f"unsupported op {kind}")
