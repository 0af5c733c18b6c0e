"""Creating NCCL backends: device choice, the unique id through the store, the polled
non-blocking init (:func:`create`), and joining a grown communicator (:func:`join_grown`)."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch

from streams._errors import InvalidDevice, device_index

from ..._base.aio import run_in_thread
from ..._base.errors import BackendUnavailable, CollectiveTimeout, CommAborted, InvalidArgument
from ..._base.foreign import creation_error, nccl_kind
from . import agree
from .handle import abort_quietly, wait_ready
from .launcher import NcclBackend
from .lib import NcclLib, missing


def current_device() -> int:
    """The calling thread's current CUDA device, without initializing CUDA here: before
    torch initializes CUDA nobody can have chosen one (``torch.cuda.set_device``
    initializes it), so it is 0; ``torch.cuda.current_device()`` would initialize CUDA
    on the caller's thread, the event loop's."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0


def choose_device(
    device: Any, count: int, current: Callable[[], int], env: Any = os.environ
) -> int:
    """The CUDA device an NCCL communicator uses: ``device``, else ``$LOCAL_RANK``, else
    the current one (``count``, ``current``: see ``streams``' ``device_index``, which
    parses it). A bad one is ``InvalidArgument``."""
    if device is None and env.get("LOCAL_RANK") is not None:
        local = env["LOCAL_RANK"]
        try:
            device = int(local)
        except ValueError:
            raise InvalidArgument(f"$LOCAL_RANK={local!r} is not an integer") from None
        if count == 1 and device >= count:  # one GPU per process (CUDA_VISIBLE_DEVICES)
            device = 0
    try:
        return device_index(device, "the NCCL backend", count=count, current=current)
    except InvalidDevice as exc:
        raise InvalidArgument(f"the NCCL backend needs a visible CUDA device: {exc}") from exc


def load_lib() -> Any:
    """The real :class:`NcclLib`, or ``BackendUnavailable`` saying what is missing."""
    reason = missing()
    if reason is not None:
        raise BackendUnavailable(reason)
    try:
        return NcclLib()
    except (ImportError, OSError, RuntimeError) as exc:
        raise BackendUnavailable(f"NCCL backend cannot load nccl4py: {exc}") from exc


def _runtime(index: int) -> Any:
    from .cuda import CudaRuntime

    return CudaRuntime(index)


def _backend(comm: Any, rank: int, ws: int, index: int, lib: Any, runtime: Any) -> NcclBackend:
    return NcclBackend(
        comm, rank=rank, world_size=ws, device=torch.device("cuda", index), lib=lib, runtime=runtime
    )


async def create(rdv: Any, prefix: str, device: Any, timeout: float, *, lib: Any = None) -> Any:
    """Build the NCCL backend: unique id through the store, non-blocking init, polled.

    Rank 0 publishes the NCCL unique id under ``prefix`` in ``rdv``'s store; the
    others wait for it. The device is resolved here, on the caller's thread (its
    current device, when ``device`` and ``$LOCAL_RANK`` say nothing); everything
    blocking (store waits, CUDA setup, the polled ``ncclCommInitRankConfig``) runs
    on an executor thread with that device current, bounded by ``timeout``
    (``CollectiveTimeout``). ``lib`` is the test kit's seam (a simulated nccl4py).
    """
    if lib is None:
        lib = load_lib()
    index = choose_device(device, torch.cuda.device_count(), current_device)
    store = rdv.prefixed(prefix)
    rank, ws = rdv.rank, rdv.world_size
    deadline = time.monotonic() + timeout
    cancel = threading.Event()

    def build() -> NcclBackend:
        # ncclCommInitRank binds to the calling thread's current device.
        with torch.cuda.device(index):
            return _build()

    def _build() -> NcclBackend:
        runtime = _runtime(index)
        key = "unique_id"
        if rank == 0:
            store.set(key, lib.unique_id().hex())
        else:
            store.wait([key], timedelta(seconds=max(0.001, deadline - time.monotonic())))
        uid = bytes.fromhex(bytes(store.get(key)).decode())
        if cancel.is_set():
            runtime.close(True)
            raise CollectiveTimeout("NCCL init cancelled")
        comm = lib.init(ws, rank, uid)
        try:
            wait_ready(comm, lib, deadline, f"NCCL init (rank {rank}/{ws}, cuda:{index})", cancel)
        except BaseException:
            runtime.close(True)
            raise
        backend = _backend(comm, rank, ws, index, lib, runtime)
        if cancel.is_set():  # ready just as the caller gave up: nobody will use it
            backend.release()
            raise CollectiveTimeout("NCCL init cancelled")
        return backend

    try:  # loop-neutral (asyncio, uvloop, trio); the thread is never left to block exit
        return await run_in_thread(build, timeout, name="asynccoll-nccl-init")
    except (BackendUnavailable, CommAborted, InvalidArgument):
        raise
    except TimeoutError:
        cancel.set()  # the thread aborts the half-built communicator
        raise CollectiveTimeout(f"NCCL init: peers did not arrive within {timeout} s") from None
    except Exception as exc:
        what = f"NCCL init on rank {rank}"
        raise creation_error(
            exc, nccl_kind(exc), what=what, timeout=timeout, otherwise=BackendUnavailable
        ) from exc
    except BaseException:  # cancelled (asyncio, trio): the thread releases what it builds
        cancel.set()
        raise


def join_grown(
    store: Any, rank: int, new_size: int, device: Any, timeout: float, *, lib: Any = None
) -> Any:
    """A new rank's backend of a communicator the members grow (``NcclBackend.grow_agreed``
    with the same ``store``), or None when they build a new one instead (then join that
    init with :func:`create`). Blocking: run it off the loop, on a thread whose current
    device is the one to use (``device`` None)."""
    if lib is None:
        lib = load_lib()
    index = choose_device(device, torch.cuda.device_count(), current_device)
    deadline = time.monotonic() + timeout
    if agree.joined_mode(store, deadline) != "grow":
        return None
    uid = agree.grow_uid(store)
    with torch.cuda.device(index):  # ncclCommGrow of a new rank uses the current device
        runtime = _runtime(index)
        try:
            comm = lib.join_grow(new_size, rank, uid)
            wait_ready(comm, lib, deadline, f"NCCL grow (new rank {rank}/{new_size}, cuda:{index})")
        except BaseException as exc:
            runtime.close(True)
            if isinstance(
                exc, (BackendUnavailable, CommAborted, InvalidArgument)
            ) or not isinstance(exc, Exception):
                raise
            what = f"NCCL grow on new rank {rank}"
            raise creation_error(
                exc, nccl_kind(exc), what=what, timeout=timeout, otherwise=BackendUnavailable
            ) from exc
    return _backend(comm, rank, new_size, index, lib, runtime)


__all__ = ["abort_quietly", "choose_device", "create", "join_grown", "load_lib", "wait_ready"]
