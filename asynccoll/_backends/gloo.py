"""Gloo as torch 2.13's ``ProcessGroupGloo`` runs it: its capability table.

The backend itself is the generic :class:`~asynccoll._backends.torch_pg.TorchGroupBackend`;
a Gloo group (built by ``init`` or given to ``wrap``) declares :data:`CAPS`.
"""

from __future__ import annotations

import torch

from .._base.ops import ReduceOp
from .._core.backend import Caps, dtypes

# Measured op by op with 2 ranks: these 9 dtypes work for every op; any other
# (uint16/32/64, int16, float8, complex in all_gather/all_to_all/gather/scatter)
# fails only when the op runs ("Invalid scalar type") and leaves the group
# unusable, so it must never reach Gloo. send/recv carry any dtype.
_BASIC = dtypes(
    "float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64", "bool"
)
# Complex reductions: SUM works (Gloo sums the real view); PROD/MIN/MAX fail in the
# op ("does not support complex"); AVG is SUM + a division, which complex32 lacks.
_COMPLEX = dtypes("complex64", "complex128", "complex32")

#: What Gloo can run: other dtypes move as bytes; reductions take only these.
CAPS = Caps(
    "gloo",
    move=_BASIC,
    as_bytes=True,
    reduce={
        ReduceOp.SUM: _BASIC | _COMPLEX,
        ReduceOp.PROD: _BASIC,
        ReduceOp.MIN: _BASIC,
        ReduceOp.MAX: _BASIC,
        ReduceOp.AVG: (_BASIC - {torch.bool}) | dtypes("complex64", "complex128"),
    },
    any_source=True,  # ProcessGroupGloo.recv_anysource
)
