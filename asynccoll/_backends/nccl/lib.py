"""nccl4py access for the NCCL backend: result codes, ``missing()``, version gates, and
:class:`NcclLib`. What NCCL can run is in ``caps.py``.

``NcclLib`` wraps every nccl4py entry point the backend uses. It takes the
``nccl.core`` module as an optional argument so the test kit can put its
simulated communicator behind the *real* wrapper (``asynccoll.testing.simgpu``).
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Callable

import torch

from ..._base.ops import ReduceOp

# ncclResult_t values (nccl.h, stable ABI; the contract tests pin them to
# ``nccl.bindings.nccl.Result``). The error codes that mean more than "failed"
# (a peer's, a timeout) belong to the boundary (``_base/foreign.py``).
SUCCESS = 0
INTERNAL_ERROR = 3
INVALID_ARGUMENT = 4
INVALID_USAGE = 5
IN_PROGRESS = 7

#: The first libnccl with ``ncclCommRevoke`` (NCCL 2.28.7-1 release; NVIDIA/nccl ae7aed19).
REVOKE_SINCE = (2, 28, 7)
#: The first libnccl with ``ncclCommShrink`` (NCCL 2.27; ``python -m asynccoll.doctor`` reports it).
SHRINK_SINCE = (2, 27, 0)
#: The first libnccl with ``ncclCommGrow``/``ncclCommGetUniqueId`` (NCCL 2.29.2-1; ebd1e929).
GROW_SINCE = (2, 29, 2)


def _how() -> str:
    """The install line for this torch's CUDA major (extras ``nccl-cu12``, ``nccl-cu13``)."""
    major = (torch.version.cuda or "").split(".")[0]
    extra = f"nccl-cu{major}" if major in ("12", "13") else "nccl-cu12' or 'asynccoll[nccl-cu13"
    return (
        f"pip install 'asynccoll[{extra}]' (nccl4py, cuda-bindings and libnccl of torch's CUDA major; "
        "python -m asynccoll.doctor shows what is installed)"
    )


def library_problem(importer: Callable[[str], Any] = importlib.import_module) -> str | None:
    """Why nccl4py, cuda-bindings or libnccl cannot be used here, or None. Needs no GPU."""
    for mod in ("cuda.bindings.driver", "nccl.core"):
        try:
            importer(mod)
        except Exception as exc:  # noqa: BLE001 - ImportError, or OSError from a broken native library
            return (
                f"NCCL backend needs {mod.split('.')[0]}: importing {mod} failed ({exc}); {_how()}"
            )
    try:
        nc = importer("nccl.core")
        nc.get_version()  # loads libnccl.so
    except Exception as exc:  # noqa: BLE001 - OSError/RuntimeError: libnccl missing or unloadable
        return f"NCCL backend cannot load libnccl ({exc}); {_how()}"
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
        self._version: tuple[int, int, int] | None = None
        self._ops = {
            ReduceOp.SUM: nc.NcclRedOp.SUM,
            ReduceOp.PROD: nc.NcclRedOp.PROD,
            ReduceOp.MIN: nc.NcclRedOp.MIN,
            ReduceOp.MAX: nc.NcclRedOp.MAX,
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

    def error_string(self, status: int) -> str:
        try:
            return str(self._nc.get_error_string(status))
        except Exception:  # noqa: BLE001 - an unknown code or a broken library: the number is enough
            return "unknown NCCL error"

    def version(self) -> tuple[int, int, int]:
        """The loaded libnccl's version, (0, 0, 0) when nccl4py cannot say."""
        if self._version is None:
            try:
                v = self._nc.get_version().libnccl.version
                self._version = (int(v.major), int(v.minor), int(v.micro))
            except (AttributeError, TypeError, ValueError, OSError, RuntimeError):
                self._version = (0, 0, 0)  # no libnccl info: the features below are not used
        return self._version

    def can_revoke(self, comm: Any) -> bool:
        """Whether ``comm`` can be revoked: nccl4py has ``Communicator.revoke`` and the
        loaded libnccl is at least :data:`REVOKE_SINCE` (an older one lacks the symbol)."""
        return hasattr(comm, "revoke") and self.version() >= REVOKE_SINCE

    def can_grow(self, comm: Any) -> bool:
        """Whether ``comm`` can grow (``Communicator.grow`` and libnccl >= :data:`GROW_SINCE`)."""
        return (
            hasattr(comm, "grow")
            and hasattr(comm, "get_unique_id")
            and self.version() >= GROW_SINCE
        )

    def revoke(self, comm: Any) -> None:
        """Start ``ncclCommRevoke``: in-flight ops stop, the state is InProgress until quiescent."""
        comm.revoke()

    def shrink(self, comm: Any, exclude: list[int], abort_pending: bool) -> Any:
        """``ncclCommShrink`` without ``exclude``; ``abort_pending`` aborts the parent's ops."""
        nc = self._nc
        flag = nc.CommShrinkFlag.ABORT if abort_pending else nc.CommShrinkFlag.DEFAULT
        return comm.shrink(list(exclude), self.config(), flag)

    def split(self, comm: Any, color: int | None, key: int) -> Any:
        """``ncclCommSplit``: ranks of one ``color`` form a child, ordered by ``key``; ``color``
        None is NCCL_SPLIT_NOCOLOR (nccl4py then returns a null communicator). The child
        does not share the parent's resources (no ``splitShare``): with it NCCL gives the
        child the parent's abort flag (init.cc ``ncclCommInitChildComm``), and aborting
        the parent would abort its subgroups."""
        return comm.split(color, key, self.config())

    def grow_id(self, comm: Any) -> bytes:
        """``ncclCommGetUniqueId`` (the grow root only; consumed by one grow)."""
        return bytes(comm.get_unique_id())

    def grow(self, comm: Any, nranks: int, uid: bytes | None) -> Any:
        """``ncclCommGrow`` of an existing rank (``uid``: the root's id; None elsewhere)."""
        nc = self._nc
        return comm.grow(
            nranks, None if uid is None else nc.UniqueId.from_bytes(uid), config=self.config()
        )

    def join_grow(self, nranks: int, rank: int, uid: bytes) -> Any:
        """``ncclCommGrow`` of a new rank, on a null ``Communicator()``."""
        nc = self._nc
        return nc.Communicator().grow(
            nranks, nc.UniqueId.from_bytes(uid), rank=rank, config=self.config()
        )

    def poison_group(self, comm: Any, buf: torch.Tensor, stream: int, nranks: int) -> None:
        """Make NCCL fail the open group: a send to a rank that does not exist fails
        NCCL's argument check, which sets the group error (NCCL src/group.h
        ``ncclGroupErrCheck``), so ``ncclGroupEnd`` launches nothing (group.cc ``goto
        fail``). Used when a call inside a group failed before reaching NCCL."""
        try:
            comm.send(buf, nranks, stream=stream)
        except Exception:  # noqa: BLE001, S110 - the expected NCCLError (ncclInvalidArgument): the group error is set
            pass


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
