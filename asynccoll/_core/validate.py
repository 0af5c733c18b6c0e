"""Argument checks: every bad input becomes ``InvalidArgument`` at the call."""

from __future__ import annotations

from typing import Any

import torch

from .errors import InvalidArgument
from .ops import ReduceOp

_NO_AVG = (torch.bool,)


def tensor(obj: Any, name: str) -> torch.Tensor:
    """``obj`` as a dense contiguous torch tensor (CuPy and DLPack objects are wrapped)."""
    if type(obj) is torch.Tensor and obj.is_contiguous() and obj.layout is torch.strided:
        return obj  # the common case, checked cheaply
    if not isinstance(obj, torch.Tensor):
        if hasattr(obj, "__dlpack__"):
            try:
                obj = torch.from_dlpack(obj)
            except Exception as exc:
                raise InvalidArgument(f"{name}: cannot import {type(obj).__name__} via DLPack: {exc}") from exc
        elif hasattr(obj, "__cuda_array_interface__"):
            obj = torch.as_tensor(obj, device="cuda")
        else:
            raise InvalidArgument(f"{name} must be a tensor, got {type(obj).__name__}")
    if obj.layout != torch.strided:
        raise InvalidArgument(f"{name} must be a dense (strided) tensor, got layout {obj.layout}")
    if not obj.is_contiguous():
        raise InvalidArgument(f"{name} must be contiguous (call .contiguous() first)")
    return obj


def reduce_op(op: Any, dtype: torch.dtype) -> ReduceOp:
    if op is ReduceOp.SUM:  # the common case, first
        return op
    if not isinstance(op, ReduceOp):
        try:
            op = ReduceOp[str(op).rsplit(".", 1)[-1].upper()]
        except KeyError:
            raise InvalidArgument(f"unknown reduce op {op!r}; use asynccoll.ReduceOp") from None
    if op is ReduceOp.AVG and dtype in _NO_AVG:
        raise InvalidArgument(f"ReduceOp.AVG is not defined for {dtype}")
    return op


def rank(value: Any, world_size: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an int rank, got {value!r}")
    if not 0 <= value < world_size:
        raise InvalidArgument(f"{name}={value} is out of range for world_size {world_size}")
    return value


def peer(value: Any, world_size: int, me: int, name: str) -> int:
    value = rank(value, world_size, name)
    if value == me:
        raise InvalidArgument(f"{name}={value} is this rank; point-to-point needs another rank")
    return value


def same_kind(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.dtype != b.dtype:
        raise InvalidArgument(f"{what}: dtype mismatch, {a.dtype} vs {b.dtype}")
    if a.device != b.device:
        raise InvalidArgument(f"{what}: device mismatch, {a.device} vs {b.device}")


def stacked(big: torch.Tensor, small: torch.Tensor, world_size: int, what: str) -> None:
    """``big`` must be ``world_size`` copies of ``small`` concatenated on dim 0."""
    same_kind(big, small, what)
    if small.dim() == 0:
        ok = big.dim() == 1 and big.shape[0] == world_size
    else:
        ok = (
            big.dim() == small.dim()
            and big.shape[0] == world_size * small.shape[0]
            and big.shape[1:] == small.shape[1:]
        )
    if not ok:
        raise InvalidArgument(
            f"{what}: expected shape [{world_size}*{tuple(small.shape)[:1] or (1,)}...] "
            f"({world_size} x {tuple(small.shape)} on dim 0), got {tuple(big.shape)}"
        )


def splittable(output: torch.Tensor, input: torch.Tensor, world_size: int, what: str) -> None:
    same_kind(output, input, what)
    if output.shape != input.shape:
        raise InvalidArgument(f"{what}: output shape {tuple(output.shape)} != input shape {tuple(input.shape)}")
    if input.dim() == 0 or input.shape[0] % world_size:
        raise InvalidArgument(f"{what}: dim 0 ({tuple(input.shape)}) must split evenly into {world_size}")


def timeout(value: Any, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidArgument(f"timeout must be a positive number of seconds, got {value!r}")
    return float(value)
