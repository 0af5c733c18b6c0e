"""What the simulated NCCL's collectives compute (on the ranks' plain tensors)."""

from __future__ import annotations

from typing import Any

import nccl.core as _nc
import torch

from .device import plain


def _reduce(xs: list[torch.Tensor], op: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    wide = torch.float64 if (dtype.is_floating_point or dtype in (torch.bfloat16,)) else torch.int64
    st = torch.stack([x.reshape(-1).to(wide) for x in xs])
    R = _nc.NcclRedOp
    if op == R.SUM:
        out = st.sum(0)
    elif op == R.PROD:
        out = st.prod(0)
    elif op == R.MAX:
        out = st.amax(0)
    elif op == R.MIN:
        out = st.amin(0)
    elif op == R.AVG:
        out = (
            st.sum(0) / n
            if wide is torch.float64
            else torch.div(st.sum(0), n, rounding_mode="trunc")
        )
    else:
        raise ValueError(f"unknown NCCL reduce op {op}")
    return out.to(dtype)


def compute(ops: list[Any], n: int) -> None:
    kind, count = ops[0].kind, ops[0].count
    if kind in ("allreduce", "reduce"):
        res = _reduce([plain(o.send).reshape(-1)[:count] for o in ops], ops[0].op, n, ops[0].dtype)
        for rank, o in enumerate(ops):
            if kind == "allreduce" or rank == o.root:
                plain(o.recv).reshape(-1)[:count].copy_(res)
    elif kind == "broadcast":
        src = plain(ops[ops[0].root].send).reshape(-1).clone()
        for o in ops:
            plain(o.recv).reshape(-1).copy_(src)
    elif kind == "allgather":
        res = torch.cat([plain(o.send).reshape(-1)[:count] for o in ops])
        for o in ops:
            plain(o.recv).reshape(-1)[: res.numel()].copy_(res)
    elif kind == "reduce_scatter":
        res = _reduce(
            [plain(o.send).reshape(-1)[: count * n] for o in ops], ops[0].op, n, ops[0].dtype
        )
        for rank, o in enumerate(ops):
            plain(o.recv).reshape(-1).copy_(res[rank * count : (rank + 1) * count])
