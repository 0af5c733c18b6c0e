"""Argument checks: every bad input becomes ``InvalidArgument`` at the call.

Each check uses only what the calling rank holds, and every rank makes it, root
or not, so all ranks that make the same call reject it alike. What a backend can
run is its own declaration, ``Backend.caps`` (:class:`~asynccoll._core.backend.Capabilities`):
the communicator passes the table of the backend chosen for the op's tensors.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch

from .._base.errors import InvalidArgument
from .._base.ops import ReduceOp
from .backend import ANY, Capabilities, dtype_names, dtypes

#: Longest timeout accepted, in seconds (about 31 years): larger values overflow
#: ``datetime.timedelta`` and C++ millisecond counts inside torch and Gloo.
MAX_TIMEOUT = 1e9


# Quantized tensors look dense and contiguous, but no backend here moves or reduces
# them meaningfully (their scale and zero point are not data).
_QUANTIZED = dtypes("quint8", "qint8", "qint32", "quint4x2", "quint2x4")
_SUM = ReduceOp.SUM  # a module global: the hot path's check reads no class attribute


def tensor(obj: Any, name: str) -> torch.Tensor:
    """``obj`` as a dense contiguous torch tensor (CuPy and DLPack objects are wrapped)."""
    if (
        type(obj) is torch.Tensor
        and obj.is_contiguous()
        and obj.layout is torch.strided
        and not obj.is_conj()
        and not obj.is_neg()
    ):
        return obj  # the common case, checked cheaply
    if not isinstance(obj, torch.Tensor):
        if hasattr(obj, "__dlpack__"):
            try:
                obj = torch.from_dlpack(obj)
            except Exception as exc:
                raise InvalidArgument(
                    f"{name}: cannot import {type(obj).__name__} via DLPack: {exc}"
                ) from exc
        elif hasattr(obj, "__cuda_array_interface__"):
            obj = torch.as_tensor(obj, device="cuda")
        else:
            raise InvalidArgument(f"{name} must be a tensor, got {type(obj).__name__}")
    if obj.layout != torch.strided:
        raise InvalidArgument(f"{name} must be a dense (strided) tensor, got layout {obj.layout}")
    if not obj.is_contiguous():
        raise InvalidArgument(f"{name} must be contiguous (call .contiguous() first)")
    if obj.is_conj() or obj.is_neg():
        # The lazy conjugate/negative bit is not in the bytes a backend sends.
        raise InvalidArgument(
            f"{name} is a lazy conjugate/negative view; call .resolve_conj().resolve_neg() first"
        )
    return cast(torch.Tensor, obj)


def reduce_op(op: Any, dtype: torch.dtype, table: Capabilities = ANY) -> ReduceOp:
    """``op`` as a ReduceOp that a backend with capabilities ``table`` can apply to ``dtype``."""
    if op is _SUM and (dtype in table.sum if table.sum is not None else dtype not in _QUANTIZED):
        return op  # the common case, first
    if dtype in _QUANTIZED:
        raise InvalidArgument(
            f"quantized tensors ({dtype}) cannot be reduced; reduce a float tensor instead"
        )
    if not isinstance(op, ReduceOp):
        try:
            op = ReduceOp[str(op).rsplit(".", 1)[-1].upper()]
        except KeyError:
            raise InvalidArgument(f"unknown reduce op {op!r}; use asynccoll.ReduceOp") from None
    if op is ReduceOp.AVG and dtype is torch.bool:
        raise InvalidArgument(f"ReduceOp.AVG is not defined for {dtype}")
    if table.reduce is not None and dtype not in table.reduce[op]:
        raise InvalidArgument(
            f"{table.name} cannot reduce {dtype} with ReduceOp.{op.name}; "
            f"it supports: {table.text[op]}"
        )
    return cast(ReduceOp, op)


def movable(t: torch.Tensor, table: Capabilities, what: str) -> torch.Tensor:
    """``t`` as a backend with capabilities ``table`` can move it: as is, or as a flat byte view."""
    if t.dtype in _QUANTIZED:
        raise InvalidArgument(
            f"{what}: quantized tensors ({t.dtype}) are not supported; send int_repr() instead"
        )
    if table.move is None or t.dtype in table.move:
        return t
    if not table.as_bytes:
        raise InvalidArgument(
            f"{what}: {table.name} cannot move {t.dtype}; it supports: {dtype_names(table.move)}"
        )
    try:
        return t.reshape(-1).view(torch.uint8)
    except RuntimeError as exc:
        raise InvalidArgument(f"{what}: {table.name} cannot move {t.dtype} ({exc})") from exc


def chunk(t: torch.Tensor) -> torch.Tensor:
    """A 0-d tensor as a 1-element view (one rank's chunk of a stacked tensor).

    Gloo crashes the process (SIGSEGV) on a 0-d reduce_scatter output and rejects
    0-d chunks elsewhere; a shape-(1,) view of the same storage is what it takes.
    """
    return t.reshape(1) if t.dim() == 0 else t


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def no_overlap(
    output: torch.Tensor, input: torch.Tensor, what: str, own_slot: int | None = None
) -> None:
    """Refuse ``output`` whose memory overlaps ``input`` (the op would read what it overwrites).

    ``own_slot``: the index of the chunk of the larger tensor that may be exactly
    the smaller one (in-place all_gather / reduce_scatter, as NCCL defines them).
    """
    if output.device != input.device or output.numel() == 0 or input.numel() == 0:
        return
    (a0, a1), (b0, b1) = _span(output), _span(input)
    if a0 >= b1 or b0 >= a1:
        return
    if own_slot is not None:
        big, small = (output, input) if a1 - a0 >= b1 - b0 else (input, output)
        (s0, s1), (g0, _) = _span(small), _span(big)
        if s0 == g0 + own_slot * (s1 - s0):
            return
        raise InvalidArgument(
            f"{what}: output and input overlap; in place, the smaller one must be exactly "
            f"chunk {own_slot} (this rank's) of the larger one"
        )
    raise InvalidArgument(f"{what}: output and input overlap in memory; use separate buffers")


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
    return int(value)


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
        raise InvalidArgument(
            f"{what}: output shape {tuple(output.shape)} != input shape {tuple(input.shape)}"
        )
    if input.dim() == 0 or input.shape[0] % world_size:
        raise InvalidArgument(
            f"{what}: dim 0 ({tuple(input.shape)}) must split evenly into {world_size}"
        )


def seconds(value: Any, name: str, *, allow_zero: bool = False) -> float:
    """A finite number of seconds, > 0 (or >= 0 with ``allow_zero``), at most ``MAX_TIMEOUT``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name} must be a number of seconds, got {value!r}")
    value = float(value)
    if (
        not (value >= 0 if allow_zero else value > 0)
        or not math.isfinite(value)
        or value > MAX_TIMEOUT
    ):
        bound = ">= 0" if allow_zero else "> 0"
        raise InvalidArgument(
            f"{name} must be a finite number of seconds {bound} and at most {MAX_TIMEOUT:g}, got {value!r}"
        )
    return float(value)


def timeout(value: Any, default: float) -> float:
    if value is None:
        return default
    if type(value) is float and 0 < value <= MAX_TIMEOUT:
        return value  # the common case
    return seconds(value, "timeout")
