"""What the NCCL backend can run: the one capability table of the NCCL package.

``NcclBackend.caps`` is :data:`CAPS` for its device (:meth:`NcclCaps.for_device`: fp8
reductions only from sm_90), of the shape ``_core.backend.Capabilities`` declares, and
``validate.py`` asks it at the call. ``encode.py`` uses the same sets to map dtypes.
"""

from __future__ import annotations

import torch

from ..._base.ops import OpKind, ReduceOp


def _dtypes(*names: str) -> frozenset[torch.dtype]:
    return frozenset(
        getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype)
    )


# ---------------------------------------------------------------- capabilities
#: torch dtypes nccl4py 0.6 maps to an ``ncclDataType_t`` (nccl/core/interop/torch.py
#: ``_to_nccl_dtype``; the contract test pins it): moved and reduced as they are.
#: ``torch.bool`` travels as ``ncclUint8`` ("NCCL has no bool"). Any other dtype is
#: moved as its bytes (a flat ``uint8`` view) and never reduced, except complex.
NATIVE = _dtypes(
    "int8",
    "uint8",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "bool",
)
COMPLEX = _dtypes("complex64", "complex128")
FP8 = _dtypes("float8_e4m3fn", "float8_e5m2")
#: fp8 reductions need sm_90 ("FP8 reduction support begins with sm90 capable
#: devices": ncclInvalidArgument below, and a non-blocking communicator is then broken;
#: NCCL src/enqueue.cc taskAppend).
FP8_REDUCE_SINCE = (9, 0)
_NUMERIC = NATIVE - {torch.bool}
# What the backend reduces, per op. bool: as uint8 with MAX (SUM = logical or) and MIN
# (PROD = logical and) — a uint8 SUM would store 2 in a bool, and AVG has no meaning
# for bool (torch's ProcessGroupNCCL refuses it too). complex: SUM/AVG on the real view.
# fp8 has no AVG: NCCL's ncclAvg (src/enqueue.cc hostToDevRedOp) maps the integer types
# and float16/bfloat16/float32/float64 only; measured on an H100 with NCCL 2.28.9, an fp8
# AVG all_reduce failed with ncclInvalidArgument and broke the communicator.
_REDUCE = {
    ReduceOp.SUM: _NUMERIC | {torch.bool} | COMPLEX,
    ReduceOp.PROD: _NUMERIC | {torch.bool},
    ReduceOp.MIN: _NUMERIC | {torch.bool},
    ReduceOp.MAX: _NUMERIC | {torch.bool},
    ReduceOp.AVG: (_NUMERIC - FP8) | COMPLEX,
}
REDUCING = (OpKind.ALL_REDUCE, OpKind.REDUCE, OpKind.REDUCE_SCATTER)


class NcclCaps:
    """What the NCCL backend can run (the shape of ``_core.validate.Caps``).

    ``move``: None (every dtype moves: natively, or as bytes). ``reduce``: per
    reduce op, the dtypes reductions accept on a device of ``capability`` (fp8 only
    from :data:`FP8_REDUCE_SINCE`). ``any_source``: False (NCCL receives from a named
    peer only).
    """

    __slots__ = ("any_source", "as_bytes", "capability", "move", "name", "reduce", "sum", "text")

    def __init__(self, capability: tuple[int, int] | None = None) -> None:
        self.name = "nccl"
        self.move: frozenset[torch.dtype] | None = None
        self.as_bytes = False
        self.any_source = False
        self.capability = capability
        old_gpu = capability is not None and tuple(capability) < FP8_REDUCE_SINCE
        drop = FP8 if old_gpu else frozenset()
        self.reduce: dict[ReduceOp, frozenset[torch.dtype]] = {
            op: dts - drop for op, dts in _REDUCE.items()
        }
        self.sum = self.reduce[ReduceOp.SUM]
        self.text = {
            op: ", ".join(sorted(str(d).replace("torch.", "") for d in dts))
            for op, dts in self.reduce.items()
        }

    def for_device(self, capability: tuple[int, int]) -> NcclCaps:
        """The table of a device of compute capability ``capability`` (major, minor)."""
        return NcclCaps(capability)

    def refusal(self, op: ReduceOp, dtype: torch.dtype) -> str | None:
        """Why ``op`` cannot reduce ``dtype`` here, or None."""
        if dtype in self.reduce[op]:
            return None
        if dtype in FP8 and dtype in _REDUCE[op] and self.capability is not None:
            major, minor = self.capability
            return (
                f"NCCL reduces {dtype} only on sm_90 or newer (this device is sm_{major}{minor}); "
                "reduce in bfloat16 or float16 instead"
            )
        if op is ReduceOp.AVG and dtype is torch.bool:
            return f"ReduceOp.AVG is not defined for {dtype}"
        if op is ReduceOp.AVG and dtype in FP8:
            return (
                f"NCCL has no ReduceOp.AVG for {dtype}: use SUM and divide, or average in bfloat16"
            )
        return f"NCCL cannot reduce {dtype} with ReduceOp.{op.name}; it supports: {self.text[op]}"


#: The one table of what NCCL runs (any device; see :meth:`NcclCaps.for_device`).
CAPS = NcclCaps()
