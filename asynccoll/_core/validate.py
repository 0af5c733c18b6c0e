"""Argument checks: every bad input becomes ``InvalidArgument`` at the call.

Each check uses only what the calling rank holds, and every rank makes it, root
or not, so all ranks that make the same call reject it alike. What a backend can
run is in :data:`CAPS`, keyed by ``Backend.name``; the communicator consults it
with the backend chosen for the op's tensors.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, cast

import torch

from .._base.errors import InvalidArgument
from .._base.ops import ReduceOp

#: Longest timeout accepted, in seconds (about 31 years): larger values overflow
#: ``datetime.timedelta`` and C++ millisecond counts inside torch and Gloo.
MAX_TIMEOUT = 1e9


class Caps:
    """What one backend can run.

    ``move``: dtypes that data-movement ops (broadcast, all_gather, all_to_all,
    gather, scatter, send, recv) carry natively; ``None`` means any. Other dtypes
    travel as their bytes (a flat ``uint8`` view) when ``as_bytes`` is set.
    ``reduce``: per reduce op, the dtypes that reductions accept; ``None`` means
    any (a wrapped group of unknown kind: torch checks at the call).
    """

    __slots__ = ("as_bytes", "move", "name", "reduce", "sum", "text")

    def __init__(
        self,
        name: str,
        move: frozenset[torch.dtype] | None,
        as_bytes: bool,
        reduce: Mapping[ReduceOp, frozenset[torch.dtype]] | None,
    ) -> None:
        self.name = name
        self.move = move
        self.as_bytes = as_bytes
        self.reduce = dict(reduce) if reduce is not None else None
        #: ``reduce[SUM]``, looked up without hashing the enum (the hot path).
        self.sum = self.reduce[ReduceOp.SUM] if self.reduce is not None else None
        self.text = {op: _names(dts) for op, dts in (reduce or {}).items()}


def _names(dtypes: frozenset[torch.dtype]) -> str:
    return ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes))


def _dtypes(*names: str) -> frozenset[torch.dtype]:
    """The torch dtypes of these names that this torch build has."""
    return frozenset(getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype))


# Gloo (torch 2.13), measured op by op with 2 ranks: these 9 dtypes work for every op;
# any other (uint16/32/64, int16, float8, complex in all_gather/all_to_all/gather/
# scatter) fails only when the op runs ("Invalid scalar type") and leaves the group
# unusable, so it must never reach Gloo. send/recv carry any dtype.
_GLOO_BASIC = _dtypes("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64", "bool")
# Complex reductions: SUM works (Gloo sums the real view); PROD/MIN/MAX fail in the
# op ("does not support complex"); AVG is SUM + a division, which complex32 lacks.
_GLOO_COMPLEX = _dtypes("complex64", "complex128", "complex32")
_GLOO = Caps(
    "gloo",
    move=_GLOO_BASIC,
    as_bytes=True,
    reduce={
        ReduceOp.SUM: _GLOO_BASIC | _GLOO_COMPLEX,
        ReduceOp.PROD: _GLOO_BASIC,
        ReduceOp.MIN: _GLOO_BASIC,
        ReduceOp.MAX: _GLOO_BASIC,
        ReduceOp.AVG: (_GLOO_BASIC - {torch.bool}) | _dtypes("complex64", "complex128"),
    },
)

# NCCL: ncclDataType_t as nccl4py 0.6.0 enumerates it (Int8, Uint8, Int32, Uint32,
# Int64, Uint64, Float16, Float32, Float64, Bfloat16, Float8e4m3, Float8e5m2), every
# ncclRedOp_t (Sum, Prod, Max, Min, Avg). The NCCL backend adds bool (as uint8, with
# MAX/MIN) and complex SUM/AVG (as the real view); it moves any dtype as bytes.
_NCCL_NATIVE = _dtypes(
    "int8", "uint8", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "bfloat16", "float8_e4m3fn", "float8_e5m2",
)
_NCCL_COMPLEX = _dtypes("complex64", "complex128")
_NCCL = Caps(
    "nccl",
    move=None,
    as_bytes=False,
    reduce={
        ReduceOp.SUM: _NCCL_NATIVE | {torch.bool} | _NCCL_COMPLEX,
        ReduceOp.PROD: _NCCL_NATIVE | {torch.bool},
        ReduceOp.MIN: _NCCL_NATIVE | {torch.bool},
        ReduceOp.MAX: _NCCL_NATIVE | {torch.bool},
        ReduceOp.AVG: _NCCL_NATIVE | _NCCL_COMPLEX,
    },
)

# A wrapped torch group of unknown kind: torch validates at the call; only what no
# backend defines is refused here.
_TORCH = Caps("torch", move=None, as_bytes=False, reduce=None)

# Quantized tensors look dense and contiguous, but no backend here moves or reduces
# them meaningfully (their scale and zero point are not data).
_QUANTIZED = _dtypes("quint8", "qint8", "qint32", "quint4x2", "quint2x4")

_SUM = ReduceOp.SUM

#: Capabilities by ``Backend.name``.
CAPS: dict[str, Caps] = {"gloo": _GLOO, "nccl": _NCCL, "torch": _TORCH}


def caps(backend_name: str) -> Caps:
    """The capability table of a backend (unknown names: the permissive ``"torch"`` one)."""
    return CAPS.get(backend_name, _TORCH)


def tensor(obj: Any, name: str) -> torch.Tensor:
    """``obj`` as a dense contiguous torch tensor (CuPy and DLPack objects are wrapped)."""
    if (
        type(obj) is torch.Tensor and obj.is_contiguous() and obj.layout is torch.strided
        and not obj.is_conj() and not obj.is_neg()
    ):
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
    if obj.is_conj() or obj.is_neg():
        # The lazy conjugate/negative bit is not in the bytes a backend sends.
        raise InvalidArgument(f"{name} is a lazy conjugate/negative view; call .resolve_conj().resolve_neg() first")
    return cast(torch.Tensor, obj)


def reduce_op(op: Any, dtype: torch.dtype, backend: str = "torch") -> ReduceOp:
    """``op`` as a ReduceOp that ``backend`` can apply to ``dtype``."""
    table = CAPS.get(backend, _TORCH)
    if op is _SUM and (dtype in table.sum if table.sum is not None else dtype not in _QUANTIZED):
        return op  # the common case, first
    if dtype in _QUANTIZED:
        raise InvalidArgument(f"quantized tensors ({dtype}) cannot be reduced; reduce a float tensor instead")
    if not isinstance(op, ReduceOp):
        try:
            op = ReduceOp[str(op).rsplit(".", 1)[-1].upper()]
        except KeyError:
            raise InvalidArgument(f"unknown reduce op {op!r}; use asynccoll.ReduceOp") from None
    if op is ReduceOp.AVG and dtype is torch.bool:
        raise InvalidArgument(f"ReduceOp.AVG is not defined for {dtype}")
    if table.reduce is not None and dtype not in table.reduce[op]:
        raise InvalidArgument(
            f"{backend} cannot reduce {dtype} with ReduceOp.{op.name}; "
            f"it supports: {table.text[op]}"
        )
    return cast(ReduceOp, op)


def movable(t: torch.Tensor, backend: str, what: str) -> torch.Tensor:
    """``t`` as ``backend`` can move it: as is, or as a flat byte view of it."""
    if t.dtype in _QUANTIZED:
        raise InvalidArgument(f"{what}: quantized tensors ({t.dtype}) are not supported; send int_repr() instead")
    table = caps(backend)
    if table.move is None or t.dtype in table.move:
        return t
    if not table.as_bytes:
        raise InvalidArgument(f"{what}: {backend} cannot move {t.dtype}; it supports: {_names(table.move)}")
    try:
        return t.reshape(-1).view(torch.uint8)
    except RuntimeError as exc:
        raise InvalidArgument(f"{what}: {backend} cannot move {t.dtype} ({exc})") from exc


def chunk(t: torch.Tensor) -> torch.Tensor:
    """A 0-d tensor as a 1-element view (one rank's chunk of a stacked tensor).

    Gloo crashes the process (SIGSEGV) on a 0-d reduce_scatter output and rejects
    0-d chunks elsewhere; a shape-(1,) view of the same storage is what it takes.
    """
    return t.reshape(1) if t.dim() == 0 else t


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def no_overlap(output: torch.Tensor, input: torch.Tensor, what: str, own_slot: int | None = None) -> None:
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
        raise InvalidArgument(f"{what}: output shape {tuple(output.shape)} != input shape {tuple(input.shape)}")
    if input.dim() == 0 or input.shape[0] % world_size:
        raise InvalidArgument(f"{what}: dim 0 ({tuple(input.shape)}) must split evenly into {world_size}")


def seconds(value: Any, name: str, *, allow_zero: bool = False) -> float:
    """A finite number of seconds, > 0 (or >= 0 with ``allow_zero``), at most ``MAX_TIMEOUT``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name} must be a number of seconds, got {value!r}")
    value = float(value)
    if not (value >= 0 if allow_zero else value > 0) or not math.isfinite(value) or value > MAX_TIMEOUT:
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
