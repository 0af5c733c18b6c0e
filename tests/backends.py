"""Which backends and loops the behavioural tests run on (one test body, every backend).

Gloo runs at world sizes 2 and 3 on any machine. NCCL runs at world size 1 (one
GPU cannot hold two ranks of one communicator) where CUDA and nccl4py exist, and
is skipped with the reason elsewhere.
"""

from __future__ import annotations

import pytest

from asynccoll._backends.nccl import missing as nccl_missing

_NCCL_MISSING = nccl_missing()

BACKENDS = [
    pytest.param("gloo", 2, id="gloo-2"),
    pytest.param("gloo", 3, id="gloo-3"),
    pytest.param(
        "nccl", 1, id="nccl-1",
        marks=pytest.mark.skipif(_NCCL_MISSING is not None, reason=f"NCCL unavailable: {_NCCL_MISSING}"),
    ),
]
LOOPS = ["asyncio", "uvloop"]
