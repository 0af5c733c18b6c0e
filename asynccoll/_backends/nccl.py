"""NCCL backend through nccl4py (non-blocking communicator, CUDA-event completion)."""

from __future__ import annotations

import importlib.util
from typing import Any


def missing() -> str | None:
    """Why NCCL cannot run here (and how to fix it), or None when it can."""
    import torch

    if not torch.cuda.is_available():
        return (
            "NCCL backend needs a CUDA GPU: torch.cuda.is_available() is False "
            "(CPU-only torch build or no visible device); use backend='gloo' for CPU tensors"
        )
    if importlib.util.find_spec("nccl") is None or importlib.util.find_spec("nccl.core") is None:
        return "NCCL backend needs nccl4py: pip install 'asynccoll[nccl]' (nccl4py, cuda-core)"
    return None


async def create(rdv: Any, prefix: str, device: Any, timeout: float) -> Any:
    raise NotImplementedError
