"""What the NCCL backend can run (``NcclBackend.caps``), from the dtypes in ``lib``.

Reductions: every dtype NCCL reduces natively (``torch.bool`` as uint8 with
MAX/MIN, see ``encode.reducible``) with every ``ncclRedOp_t``, plus complex SUM/AVG
(as the real view); AVG is not defined for bool. Data movement: any dtype (as bytes).
"""

from __future__ import annotations

import torch

from ..._base.ops import ReduceOp
from ..._core.backend import Caps
from .lib import _COMPLEX, _NCCL_DTYPES

_NATIVE = frozenset(_NCCL_DTYPES)

CAPS = Caps(
    "nccl",
    move=None,
    as_bytes=False,
    reduce={
        ReduceOp.SUM: _NATIVE | _COMPLEX,
        ReduceOp.PROD: _NATIVE,
        ReduceOp.MIN: _NATIVE,
        ReduceOp.MAX: _NATIVE,
        ReduceOp.AVG: (_NATIVE - {torch.bool}) | _COMPLEX,
    },
)
