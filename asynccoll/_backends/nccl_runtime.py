"""nccl4py and CUDA access for the NCCL backend, behind two small seams (tests use fakes).

``NcclLib`` wraps every nccl4py call the backend makes; ``CudaRuntime`` every
CUDA call. Also: NCCL result codes, ``missing()`` (why NCCL cannot run here),
device selection, and bounded polling of a non-blocking communicator.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from typing import Any, Callable

import torch

from .._core.errors import (
    BackendUnavailable,
    CollectiveTimeout,
    InvalidArgument,
    PeerFailure,
)
from .._core.ops import OpKind, ReduceOp

# ncclResult_t values (nccl.h; stable ABI).
SUCCESS = 0
SYSTEM_ERROR = 2
REMOTE_ERROR = 6
IN_PROGRESS = 7
_PEER_ERRORS = (SYSTEM_ERROR, REMOTE_ERROR)

# Dtypes NCCL reduces natively (torch.bool travels as uint8; see _reduce_op).
_NCCL_DTYPES = {
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
}
for _name in ("uint32", "uint64", "float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _NCCL_DTYPES.add(getattr(torch, _name))
_COMPLEX = {torch.complex64, torch.complex128}
_REDUCING = (OpKind.ALL_REDUCE, OpKind.REDUCE, OpKind.REDUCE_SCATTER)


def missing() -> str | None:
    """Why NCCL cannot run here (and how to fix it), or None when it can."""
    if not torch.cuda.is_available():
        return (
            "NCCL backend needs a CUDA GPU: torch.cuda.is_available() is False "
            "(CPU-only torch build or no visible device); use backend='gloo' for CPU tensors"
        )
    if importlib.util.find_spec("nccl") is None or importlib.util.find_spec("nccl.core") is None:
        return "NCCL backend needs nccl4py: pip install 'asynccoll[nccl]' (nccl4py, cuda-core)"
    return None


class NcclError(RuntimeError):
    """An NCCL result code reported asynchronously (``ncclCommGetAsyncError``)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"NCCL error {status}: {text}")
        self.status = status


# --------------------------------------------------------------------- adapters
class NcclLib:
    """The few nccl4py entry points the backend uses (imported lazily)."""

    def __init__(self) -> None:
        import nccl.core as nc

        self._nc = nc
        self._ops = {
            ReduceOp.SUM: nc.NcclRedOp.SUM, ReduceOp.PROD: nc.NcclRedOp.PROD,
            ReduceOp.MIN: nc.NcclRedOp.MIN, ReduceOp.MAX: nc.NcclRedOp.MAX,
            ReduceOp.AVG: nc.NcclRedOp.AVG,
        }

    def unique_id(self) -> bytes:
        return bytes(self._nc.get_unique_id())

    def init(self, nranks: int, rank: int, uid: bytes) -> Any:
        """Start a non-blocking ``ncclCommInitRankConfig``; poll ``get_async_error`` after."""
        uid_obj = self._nc.UniqueId.from_bytes(uid)
        return self._nc.Communicator.init(nranks, rank, uid_obj, self._nc.NCCLConfig(blocking=False))

    def redop(self, op: ReduceOp) -> Any:
        return self._ops[op]

    def group_start(self) -> None:
        self._nc.group_start()

    def group_end(self) -> None:
        # nccl4py's group_end() returns normally on ncclInProgress: the caller polls.
        self._nc.group_end()

    def error_string(self, status: int) -> str:
        try:
            return str(self._nc.get_error_string(status))
        except Exception:
            return "unknown NCCL error"

    def shrink(self, comm: Any, exclude: list[int], abort_pending: bool) -> Any:
        flag = self._nc.CommShrinkFlag.ABORT if abort_pending else self._nc.CommShrinkFlag.DEFAULT
        return comm.shrink(exclude, self._nc.NCCLConfig(blocking=False), flag)


class CudaRuntime:
    """The CUDA side: comm stream, event pool, caller streams (torch / CuPy)."""

    def __init__(self, index: int) -> None:
        import streams

        self._streams = streams
        self.index = index
        self.comm_stream = streams.comm_stream(index)
        self.events = streams.EventPool(index)

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.index)

    def caller_stream(self, tensor: Any) -> Any:
        return self._streams.current_stream(self.index if tensor is None else tensor)

    def target_stream(self, stream: Any) -> Any:
        """The stream ``wait_stream(stream)`` should hold back (None: current)."""
        if stream is None:
            return torch.cuda.current_stream(self.index)
        if isinstance(stream, int) and not isinstance(stream, bool):
            return torch.cuda.ExternalStream(stream, device=self.index)
        return self._streams.current_stream(stream)

    def handle(self, stream: Any) -> int:
        return int(stream.cuda_stream)

    def protect(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(self.comm_stream)

    def on_comm_stream(self) -> Any:
        return torch.cuda.stream(self.comm_stream)

    def scratch(self) -> torch.Tensor:
        """A 1-element buffer owned by the comm stream (the barrier's all_reduce)."""
        with torch.cuda.stream(self.comm_stream):
            return torch.empty(1, dtype=torch.float32, device=torch.device("cuda", self.index))




def _raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` as NCCL can move it: as is, or as bytes for dtypes NCCL lacks."""
    if t.dtype in _NCCL_DTYPES:
        return t
    return t.reshape(-1).view(torch.uint8)


def _wait_ready(comm: Any, lib: Any, deadline: float, what: str, cancel: threading.Event | None = None) -> None:
    """Poll a new communicator until it leaves InProgress; abort it on failure."""
    delay = 1e-4
    while True:
        try:
            status = int(comm.get_async_error())
        except Exception as exc:
            _abort_quietly(comm)
            raise BackendUnavailable(f"{what} failed: {exc}") from exc
        if status == SUCCESS:
            return
        if status != IN_PROGRESS:
            _abort_quietly(comm)
            text = lib.error_string(status)
            cls = PeerFailure if status in _PEER_ERRORS else BackendUnavailable
            raise cls(f"{what} failed: NCCL error {status} ({text})") from NcclError(status, text)
        if time.monotonic() > deadline or (cancel is not None and cancel.is_set()):
            _abort_quietly(comm)
            raise CollectiveTimeout(f"{what}: peers did not arrive in time (still ncclInProgress)")
        time.sleep(delay)
        delay = min(delay * 2, 5e-3)


def _abort_quietly(comm: Any) -> None:
    try:
        comm.abort()
    except Exception:
        pass


# ------------------------------------------------------------------- create
def device_index(device: Any, count: int, current: Callable[[], int], env: Any = os.environ) -> int:
    """The CUDA device index for ``device`` (None: ``$LOCAL_RANK``, else current)."""
    if device is None:
        local = env.get("LOCAL_RANK")
        if local is None:
            return current()
        try:
            index = int(local)
        except ValueError:
            raise InvalidArgument(f"$LOCAL_RANK={local!r} is not an integer") from None
        if index >= count and count == 1:  # one GPU per process (CUDA_VISIBLE_DEVICES)
            index = 0
    elif isinstance(device, bool):
        raise InvalidArgument(f"device must be a CUDA device, got {device!r}")
    elif isinstance(device, int):
        index = device
    elif isinstance(device, (str, torch.device)):
        try:
            dev = torch.device(device)
        except RuntimeError as exc:
            raise InvalidArgument(f"bad device {device!r}: {exc}") from None
        if dev.type != "cuda":
            raise InvalidArgument(f"the NCCL backend needs a CUDA device, got {dev}")
        index = current() if dev.index is None else dev.index
    else:
        raise InvalidArgument(f"device must be an int, 'cuda:N' or torch.device, got {type(device).__name__}")
    if not 0 <= index < count:
        raise InvalidArgument(f"CUDA device {index} is out of range: {count} device(s) visible")
    return index
