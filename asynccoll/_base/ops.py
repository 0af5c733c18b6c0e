"""Reduce operations and the backend-neutral description of one operation."""

from __future__ import annotations

import enum
from typing import Any


class ReduceOp(enum.Enum):
    """Reduction applied by ``all_reduce``, ``reduce`` and ``reduce_scatter``."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"


class OpKind(str, enum.Enum):
    """The operations a backend executes; the value is the public op name."""

    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    GATHER = "gather"
    SCATTER = "scatter"
    SEND = "send"
    RECV = "recv"
    BARRIER = "barrier"


#: ``OpSpec.peer`` of a receive from any source (``Communicator.recv_any``).
ANY_SOURCE = -1


class OpSpec:
    """What to run: filled by the communicator after validation, read by a backend.

    ``tensor`` is the in/out tensor for in-place ops and the input otherwise;
    ``output`` is the separate output (all_gather, reduce_scatter, all_to_all, gather
    on the root, scatter). ``peer`` is the root (src/dst) or the p2p peer
    (:data:`ANY_SOURCE` for a receive from any peer).
    ``timeout`` is the op's deadline in seconds, for backends with their own timers.
    """

    __slots__ = ("kind", "tensor", "output", "reduce_op", "peer", "timeout")

    def __init__(
        self,
        kind: OpKind,
        tensor: Any = None,
        output: Any = None,
        reduce_op: ReduceOp = ReduceOp.SUM,
        peer: int = -1,
        timeout: float = 0.0,
    ) -> None:
        self.kind = kind
        self.tensor = tensor
        self.output = output
        self.reduce_op = reduce_op
        self.peer = peer
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"OpSpec({self.kind.value}, peer={self.peer}, op={self.reduce_op.name})"
