"""Building each collective's :class:`OpSpec` from the user's arguments.

``Communicator``'s collectives are thin: :class:`Specs` validates their arguments
(``validate.py``; a bad one raises ``InvalidArgument`` at the call, and nothing is
issued), picks the backend that serves the tensors' device, and returns what the
communicator issues: ``(backend, spec, value, keep)`` — the backend, the op it runs,
the Work's result (known at issue for in-place ops), and the tensors that must
outlive the op. A rank checks what it can see of its own arguments the same way
whether or not it is the root.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .._base.errors import InvalidArgument
from .._base.ops import ANY_SOURCE, OpKind, OpSpec, ReduceOp
from . import validate
from .backend import Backend

#: What the communicator issues for one collective: backend, spec, result, kept tensors.
Issue = tuple[Backend, OpSpec, Any, Any]

_ALL_REDUCE = OpKind.ALL_REDUCE


class Specs:
    """The spec builder of one communicator (its rank, size and backends by device type)."""

    def __init__(
        self, rank: int, world_size: int, backends: Mapping[str | None, Backend], name: str
    ) -> None:
        self.rank = rank
        self.name = name  # the communicator's backend name, for messages
        self.world_size = world_size
        self.backends = backends
        self.cpu_backend = backends.get("cpu") or backends.get(None)
        self.cuda_backend = backends.get("cuda") or backends.get(None)

    def backend_for(self, tensor: torch.Tensor) -> Backend:
        """The backend that serves ``tensor``'s device; ``InvalidArgument`` if none does."""
        if tensor.is_cpu:
            backend = self.cpu_backend
        elif tensor.is_cuda:
            backend = self.cuda_backend
        else:
            backend = self.backends.get(tensor.device.type) or self.backends.get(None)
        if backend is None:
            raise InvalidArgument(
                f"tensor on {tensor.device} cannot be used with backend {self.name!r} "
                f"(it serves: {', '.join(str(k) for k in self.backends)})"
            )
        return backend

    def all_reduce(self, tensor: Any, op: ReduceOp = ReduceOp.SUM) -> Issue:
        t = validate.tensor(tensor, "tensor")
        # the hot path: a CPU tensor finds its backend without a call
        backend = (self.cpu_backend if t.is_cpu else None) or self.backend_for(t)
        spec = OpSpec(_ALL_REDUCE, t, None, validate.reduce_op(op, t.dtype, backend.caps))
        return backend, spec, t, t

    def broadcast(self, tensor: Any, src: int) -> Issue:
        t = validate.tensor(tensor, "tensor")
        backend = self.backend_for(t)
        spec = OpSpec(
            OpKind.BROADCAST,
            validate.movable(t, backend.caps, "broadcast"),
            peer=validate.rank(src, self.world_size, "src"),
        )
        return backend, spec, t, t

    def reduce(self, tensor: Any, dst: int, op: ReduceOp = ReduceOp.SUM) -> Issue:
        t = validate.tensor(tensor, "tensor")
        backend = self.backend_for(t)
        spec = OpSpec(
            OpKind.REDUCE,
            t,
            reduce_op=validate.reduce_op(op, t.dtype, backend.caps),
            peer=validate.rank(dst, self.world_size, "dst"),
        )
        return backend, spec, t, t

    def all_gather(self, output: Any, input: Any) -> Issue:
        out, inp = validate.tensor(output, "output"), validate.tensor(input, "input")
        validate.stacked(out, inp, self.world_size, "all_gather output")
        validate.no_overlap(out, inp, "all_gather", own_slot=self.rank)
        backend = self.backend_for(inp)
        caps = backend.caps
        spec = OpSpec(
            OpKind.ALL_GATHER,
            validate.movable(validate.chunk(inp), caps, "all_gather"),
            validate.movable(out, caps, "all_gather"),
        )
        return backend, spec, out, (out, inp)

    def reduce_scatter(self, output: Any, input: Any, op: ReduceOp = ReduceOp.SUM) -> Issue:
        out, inp = validate.tensor(output, "output"), validate.tensor(input, "input")
        validate.stacked(inp, out, self.world_size, "reduce_scatter input")
        validate.no_overlap(out, inp, "reduce_scatter", own_slot=self.rank)
        backend = self.backend_for(inp)
        rop = validate.reduce_op(op, inp.dtype, backend.caps)
        # chunk(): a 0-d output is a (1,) view; Gloo SIGSEGVs the process on a 0-d one.
        spec = OpSpec(OpKind.REDUCE_SCATTER, inp, validate.chunk(out), reduce_op=rop)
        return backend, spec, out, (out, inp)

    def all_to_all(self, output: Any, input: Any) -> Issue:
        out, inp = validate.tensor(output, "output"), validate.tensor(input, "input")
        validate.splittable(out, inp, self.world_size, "all_to_all")
        validate.no_overlap(out, inp, "all_to_all")
        backend = self.backend_for(inp)
        caps = backend.caps
        spec = OpSpec(
            OpKind.ALL_TO_ALL,
            validate.movable(inp, caps, "all_to_all"),
            validate.movable(out, caps, "all_to_all"),
        )
        return backend, spec, out, (out, inp)

    def gather(self, input: Any, dst: int, output: Any = None) -> Issue:
        inp = validate.tensor(input, "input")
        dst = validate.rank(dst, self.world_size, "dst")
        backend = self.backend_for(inp)
        caps = backend.caps
        # Every rank, root or not, checks and converts its own input alike.
        sent = validate.movable(validate.chunk(inp), caps, "gather")
        out = into = None
        if self.rank == dst:
            if output is None:
                raise InvalidArgument("gather: output is required on the dst rank")
            out = validate.tensor(output, "output")
            validate.stacked(out, inp, self.world_size, "gather output")
            validate.no_overlap(out, inp, "gather")
            into = validate.movable(out, caps, "gather")
        spec = OpSpec(OpKind.GATHER, sent, into, peer=dst)
        return backend, spec, out, (out, inp)

    def scatter(self, output: Any, src: int, input: Any = None) -> Issue:
        out = validate.tensor(output, "output")
        src = validate.rank(src, self.world_size, "src")
        backend = self.backend_for(out)
        caps = backend.caps
        # Every rank, root or not, checks and converts its own output alike.
        into = validate.movable(validate.chunk(out), caps, "scatter")
        inp = sent = None
        if self.rank == src:
            if input is None:
                raise InvalidArgument("scatter: input is required on the src rank")
            inp = validate.tensor(input, "input")
            validate.stacked(inp, out, self.world_size, "scatter input")
            validate.no_overlap(out, inp, "scatter")
            sent = validate.movable(inp, caps, "scatter")
        spec = OpSpec(OpKind.SCATTER, sent, into, peer=src)
        return backend, spec, out, (out, inp)

    def send(self, tensor: Any, dst: int) -> Issue:
        t = validate.tensor(tensor, "tensor")
        backend = self.backend_for(t)
        spec = OpSpec(
            OpKind.SEND,
            validate.movable(t, backend.caps, "send"),
            peer=validate.peer(dst, self.world_size, self.rank, "dst"),
        )
        return backend, spec, t, t

    def recv(self, tensor: Any, src: int) -> Issue:
        t = validate.tensor(tensor, "tensor")
        backend = self.backend_for(t)
        spec = OpSpec(
            OpKind.RECV,
            validate.movable(t, backend.caps, "recv"),
            peer=validate.peer(src, self.world_size, self.rank, "src"),
        )
        return backend, spec, t, t

    def recv_any(self, tensor: Any) -> Issue:
        t = validate.tensor(tensor, "tensor")
        backend = self.backend_for(t)
        if not backend.caps.any_source:
            raise InvalidArgument(
                f"recv_any: {backend.caps.name} receives from a named peer only; use recv(tensor, src)"
            )
        spec = OpSpec(OpKind.RECV, validate.movable(t, backend.caps, "recv"), peer=ANY_SOURCE)
        return backend, spec, None, t  # the result (the sender's rank) comes at completion
