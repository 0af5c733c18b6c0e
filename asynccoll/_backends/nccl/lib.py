"""nccl4py access for the NCCL backend: result codes, ``missing()``, and :class:`NcclLib`.

``NcclLib`` wraps every nccl4py entry point the backend uses. It takes the
``nccl.core`` module as an optional argument so the test kit can put its
simulated communicator behind the *real* wrapper (``asynccoll.testing.simgpu``).
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Callable

import torch

from ..._base.ops import OpKind, ReduceOp

# ncclResult_t values (nccl.h, stable ABI; the contract tests pin them to
# ``nccl.bindings.nccl.Result``).
SUCCESS = 0
SYSTEM_ERROR = 2
INTERNAL_ERROR = 3
INVALID_ARGUMENT = 4
INVALID_USAGE = 5
REMOTE_ERROR = 6
IN_PROGRESS = 7
_PEER_ERRORS = (SYSTEM_ERROR, REMOTE_ERROR)

#: The first libnccl with ``ncclCommRevoke`` (NCCL 2.29; ``NCCL_REVOKE_DEFAULT``).
REVOKE_SINCE = (2, 29)

# Dtypes NCCL reduces natively (torch.bool travels as uint8; see encode.reducible).
_NCCL_DTYPES = {
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
}
for _name in ("uint32", "uint64", "float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _NCCL_DTYPES.add(getattr(torch, _name))
_COMPLEX = {torch.complex64, torch.complex128}
_REDUCING = (OpKind.ALL_REDUCE, OpKind.REDUCE, OpKind.REDUCE_SCATTER)

_HOW = "pip install 'asynccoll[nccl]' (nccl4py[cu12]: nccl4py, cuda-bindings, nvidia-nccl-cu12)"


def library_problem(importer: Callable[[str], Any] = importlib.import_module) -> str | None:
    """Why nccl4py, cuda-bindings or libnccl cannot be used here, or None. Needs no GPU."""
    for mod in ("cuda.bindings.driver", "nccl.core"):
        try:
            importer(mod)
        except Exception as exc:  # noqa: BLE001 - ImportError, or OSError from a broken native library
            return f"NCCL backend needs {mod.split('.')[0]}: importing {mod} failed ({exc}); {_HOW}"
    try:
        nc = importer("nccl.core")
        nc.get_version()  # loads libnccl.so
    except Exception as exc:  # noqa: BLE001 - OSError/RuntimeError: libnccl missing or unloadable
        return f"NCCL backend cannot load libnccl ({exc}); {_HOW}"
    return None


def missing(
    cuda_available: Callable[[], bool] = torch.cuda.is_available,
    importer: Callable[[str], Any] = importlib.import_module,
) -> str | None:
    """Why NCCL cannot run here (and how to fix it), or None when it can."""
    if not cuda_available():
        return (
            "NCCL backend needs a CUDA GPU: torch.cuda.is_available() is False "
            "(CPU-only torch build or no visible device); use backend='gloo' for CPU tensors"
        )
    return library_problem(importer)


class NcclError(RuntimeError):
    """An NCCL result code reported asynchronously (``ncclCommGetAsyncError``)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"NCCL error {status}: {text}")
        self.status = status


class NcclLib:
    """The nccl4py entry points the backend uses.

    ``module``: the ``nccl.core`` module (default: imported here). Tests pass the
    simulator's stand-in, which exposes the real enums and classes.
    """

    def __init__(self, module: Any = None) -> None:
        if module is None:
            import nccl.core as module

        nc = module
        self._nc = nc
        self._revoke_ok: bool | None = None
        self._ops = {
            ReduceOp.SUM: nc.NcclRedOp.SUM, ReduceOp.PROD: nc.NcclRedOp.PROD,
            ReduceOp.MIN: nc.NcclRedOp.MIN, ReduceOp.MAX: nc.NcclRedOp.MAX,
            ReduceOp.AVG: nc.NcclRedOp.AVG,
        }

    def unique_id(self) -> bytes:
        return bytes(self._nc.get_unique_id())

    def config(self) -> Any:
        """The config of every communicator: non-blocking (calls return ncclInProgress)."""
        return self._nc.NCCLConfig(blocking=False)

    def init(self, nranks: int, rank: int, uid: bytes) -> Any:
        """Start a non-blocking ``ncclCommInitRankConfig``; poll ``get_async_error`` after."""
        uid_obj = self._nc.UniqueId.from_bytes(uid)
        return self._nc.Communicator.init(nranks, rank, uid_obj, self.config())

    def redop(self, op: ReduceOp) -> Any:
        return self._ops[op]

    def group_start(self) -> None:
        self._nc.group_start()

    def group_end(self) -> None:
        # Returns normally on ncclInProgress (check_status lets 7 through): the caller polls.
        self._nc.group_end()

    def group_discard(self) -> None:
        """Close an open group *without launching* it (after a call inside it failed).

        ``ncclGroupSimulateEnd`` ends the group and only estimates its time, so a
        partly built group never runs on this rank alone.
        """
        self._nc.group_end(simulate=True)

    def error_string(self, status: int) -> str:
        try:
            return str(self._nc.get_error_string(status))
        except Exception:  # noqa: BLE001 - an unknown code or a broken library: the number is enough
            return "unknown NCCL error"

    def can_revoke(self, comm: Any) -> bool:
        """Whether ``comm`` can be revoked: nccl4py has ``Communicator.revoke`` and the
        loaded libnccl is at least :data:`REVOKE_SINCE` (an older one lacks the symbol)."""
        if not hasattr(comm, "revoke"):
            return False
        ok = self._revoke_ok
        if ok is None:
            try:
                v = self._nc.get_version().libnccl.version
                ok = (int(v.major), int(v.minor)) >= REVOKE_SINCE
            except Exception:  # noqa: BLE001 - an nccl4py without version info: try revoke, abort if it fails
                ok = True
            self._revoke_ok = ok
        return ok

    def revoke(self, comm: Any) -> None:
        """Start ``ncclCommRevoke``: in-flight ops stop, the state is InProgress until quiescent."""
        comm.revoke()

    def shrink(self, comm: Any, exclude: list[int], abort_pending: bool) -> Any:
        """``ncclCommShrink`` without ``exclude``; ``abort_pending`` aborts the parent's ops."""
        nc = self._nc
        flag = nc.CommShrinkFlag.ABORT if abort_pending else nc.CommShrinkFlag.DEFAULT
        return comm.shrink(list(exclude), self.config(), flag)


def poll_async_error(lock: Any, current: Any, deadline: float) -> int | None:
    """Poll ``get_async_error`` of the communicator ``current()`` returns until it leaves
    InProgress or ``deadline`` passes; None once ``current()`` returns None (aborted).

    ``lock`` serialises every NCCL call against abort (nccl4py frees the handle).
    """
    delay = 0.0
    while True:
        with lock:
            comm = current()
            if comm is None:
                return None
            try:
                status = int(comm.get_async_error())
            except Exception:  # noqa: BLE001 - NcclInvalid: the communicator is unusable
                status = INTERNAL_ERROR
        if status != IN_PROGRESS or time.monotonic() > deadline:
            return status
        time.sleep(delay)
        delay = min(max(delay * 2, 1e-5), 1e-3)
