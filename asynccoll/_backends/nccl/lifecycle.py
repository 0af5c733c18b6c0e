"""Communicator lifecycle: device choice, bootstrap (unique id through the store),
polled non-blocking init, bounded abort, and :func:`create`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch

from ..._core.errors import (
    BackendUnavailable,
    CollectiveTimeout,
    CommAborted,
    InvalidArgument,
    PeerFailure,
)
from .lib import _PEER_ERRORS, IN_PROGRESS, SUCCESS, NcclError, NcclLib, missing


def wait_ready(comm: Any, lib: Any, deadline: float, what: str, cancel: threading.Event | None = None) -> None:
    """Poll a new communicator until it leaves InProgress; abort it on failure."""
    delay = 1e-4
    while True:
        try:
            status = int(comm.get_async_error())
        except Exception as exc:  # NcclInvalid/NCCLError: the communicator is unusable
            abort_quietly(comm)
            raise BackendUnavailable(f"{what} failed: {exc}") from exc
        if status == SUCCESS:
            return
        if status != IN_PROGRESS:
            abort_quietly(comm)
            text = lib.error_string(status)
            cls = PeerFailure if status in _PEER_ERRORS else BackendUnavailable
            raise cls(f"{what} failed: NCCL error {status} ({text})") from NcclError(status, text)
        if time.monotonic() > deadline or (cancel is not None and cancel.is_set()):
            abort_quietly(comm)
            raise CollectiveTimeout(f"{what}: peers did not arrive in time (still ncclInProgress)")
        time.sleep(delay)
        delay = min(delay * 2, 5e-3)


def abort_quietly(comm: Any) -> None:
    """``comm.abort()``, for a communicator being thrown away after another error."""
    try:
        comm.abort()
    except Exception:  # the original error is what gets reported; abort frees what it can
        pass


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


def load_lib() -> Any:
    """The real :class:`NcclLib`, or ``BackendUnavailable`` saying what is missing."""
    reason = missing()
    if reason is not None:
        raise BackendUnavailable(reason)
    try:
        return NcclLib()
    except (ImportError, OSError, RuntimeError) as exc:
        raise BackendUnavailable(f"NCCL backend cannot load nccl4py: {exc}") from exc


async def create(
    rdv: Any,
    prefix: str,
    device: Any,
    timeout: float,
    *,
    lib: Any = None,
    runtime_factory: Callable[[int], Any] | None = None,
    device_count: Callable[[], int] | None = None,
    device_guard: Callable[[int], Any] | None = None,
) -> Any:
    """Build the NCCL backend: unique id through the store, non-blocking init, polled.

    Rank 0 publishes the NCCL unique id under ``prefix`` in ``rdv``'s store; the
    others wait for it. Everything blocking (store waits, CUDA setup, the polled
    ``ncclCommInitRankConfig``) runs on an executor thread, bounded by ``timeout``
    (``CollectiveTimeout``). ``lib``/``runtime_factory``/``device_count``/
    ``device_guard`` are the simulator's seams (tests).
    """
    from .launcher import NcclBackend

    if lib is None:
        lib = load_lib()
    store = rdv.prefixed(prefix)
    rank, ws = rdv.rank, rdv.world_size
    deadline = time.monotonic() + timeout
    cancel = threading.Event()

    def build() -> tuple[Any, Any, int]:
        count = (device_count or torch.cuda.device_count)()
        index = device_index(device, count, torch.cuda.current_device)
        runtime = (runtime_factory or _cuda_runtime)(index)  # may create the CUDA context
        key = "unique_id"
        if rank == 0:
            store.set(key, lib.unique_id().hex())
        else:
            store.wait([key], timedelta(seconds=max(0.001, deadline - time.monotonic())))
        uid = bytes.fromhex(bytes(store.get(key)).decode())
        if cancel.is_set():
            raise CollectiveTimeout("NCCL init cancelled")
        if device_guard is not None:
            guard = device_guard(index)
        else:
            guard = torch.cuda.device(index) if runtime_factory is None else contextlib.nullcontext()
        with guard:  # ncclCommInitRank binds to the calling thread's current device
            comm = lib.init(ws, rank, uid)
        wait_ready(comm, lib, deadline, f"NCCL init (rank {rank}/{ws}, cuda:{index})", cancel)
        return comm, runtime, index

    def orphaned(f: asyncio.Future[Any]) -> None:
        # Nobody awaits it after a timeout: retrieve its outcome, abort a late communicator.
        if not f.cancelled() and f.exception() is None and cancel.is_set():
            threading.Thread(target=abort_quietly, args=(f.result()[0],), daemon=True).start()

    loop = asyncio.get_running_loop()
    fut = loop.run_in_executor(None, build)
    fut.add_done_callback(orphaned)
    try:
        comm, runtime, index = await asyncio.wait_for(asyncio.shield(fut), timeout)
    except asyncio.TimeoutError:
        cancel.set()  # the executor thread aborts the half-built communicator
        raise CollectiveTimeout(f"NCCL init: peers did not arrive within {timeout} s") from None
    except asyncio.CancelledError:
        cancel.set()
        raise
    except (BackendUnavailable, CollectiveTimeout, CommAborted, InvalidArgument):
        raise
    except Exception as exc:
        low = str(exc).lower()
        if "timeout" in low or "timed out" in low:
            raise CollectiveTimeout(f"NCCL init: peers did not arrive within {timeout} s: {exc}") from exc
        raise BackendUnavailable(f"NCCL init failed on rank {rank}: {exc}") from exc
    return NcclBackend(comm, rank=rank, world_size=ws, device=torch.device("cuda", index), lib=lib, runtime=runtime)


def _cuda_runtime(index: int) -> Any:
    from .cuda import CudaRuntime

    return CudaRuntime(index)
