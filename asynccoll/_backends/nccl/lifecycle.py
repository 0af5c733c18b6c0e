"""Communicator lifecycle: device choice, bootstrap (unique id through the store),
polled non-blocking init and :func:`create`; a backend's abort, close (finalize,
destroy) and shrink."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from ..._base.errors import (
    BackendUnavailable,
    CollectiveTimeout,
    CommAborted,
    InvalidArgument,
    PeerFailure,
)
from .lib import _PEER_ERRORS, IN_PROGRESS, SUCCESS, NcclError, NcclLib, missing, poll_async_error

if TYPE_CHECKING:
    from .launcher import NcclBackend

#: Queued to a backend's launcher: stop.
STOP = object()


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
    except Exception:  # noqa: BLE001, S110 - the original error is what gets reported; abort frees what it can
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


# ------------------------------------------------------------- a backend's end
def abort_backend(be: NcclBackend) -> None:
    """Stop the backend: bounded (``abort_timeout``), idempotent.

    Where NCCL has ``ncclCommRevoke`` (and ``be._use_revoke``), the communicator is
    revoked instead of aborted: its in-flight ops stop but it stays shrinkable
    (``ncclCommShrink``); the destructive ``ncclCommAbort`` comes with
    :func:`close_backend`, ``release()`` or after the shrink. If the revoke does not
    quiesce within half the bound, the communicator is aborted as before.
    """
    with be._lock:
        if be._aborted:
            return
        be._aborted = True
        last = be._next
    while True:  # drop queued jobs (and their tensors); the launcher never runs them
        try:
            job = be._queue.get_nowait()
        except queue.Empty:
            break
        if job is not STOP:
            job.specs = ()
    be._queue.put(STOP)
    be._rt.release_gate(last)  # nothing stays blocked on wait_stream
    be._watcher.close(timeout=0, drain=False)
    comm = be._comm
    if be._closed or comm is None:
        drop_inflight(be)
        return
    done = be._abort_done = threading.Event()
    revoke = be._use_revoke and be._lib.can_revoke(comm)
    threading.Thread(target=_stop_comm, args=(be, done, revoke), name="asynccoll-nccl-abort", daemon=True).start()
    done.wait(be._abort_timeout)


def drop_inflight(be: NcclBackend) -> None:
    """Forget the jobs whose kernels abort terminated (their tensors may be freed now)."""
    with be._lock:
        for job in list(be._inflight) + be._stuck:
            job.specs = ()
        be._inflight.clear()
        be._stuck.clear()


def _stop_comm(be: NcclBackend, done: threading.Event, revoke: bool = False) -> None:
    """Stop the communicator's ops: ``ncclCommRevoke`` (``revoke``, keeps it shrinkable)
    or ``ncclCommAbort``; bounded by ``abort_timeout``.

    The launcher holds ``_nccl_lock`` only around single non-blocking calls and
    re-checks ``_aborted`` under it, so normally the lock comes at once. If a call
    hangs inside NCCL, ``ncclCommAbort`` is what unblocks it: abort anyway. A revoke
    leaves the communicator InProgress until it is quiescent; after that it may be
    shrunk (or aborted/destroyed), never finalized. It gets half of ``abort_timeout``
    (a quarter to take the lock), then ``ncclCommAbort`` as before.
    """
    deadline = time.monotonic() + be._abort_timeout / 2
    got = be._nccl_lock.acquire(timeout=be._abort_timeout / (4 if revoke else 2))
    try:
        comm = be._comm
        if revoke and got and comm is not None and _revoke(be, comm, deadline):
            be._revoked = True
        else:
            comm, be._comm = be._comm, None
            if comm is not None:
                abort_quietly(comm)
    finally:
        if got:
            be._nccl_lock.release()
        # The ops were stopped (revoke) or terminated (abort): their tensors may go.
        drop_inflight(be)
        done.set()


def _revoke(be: NcclBackend, comm: Any, deadline: float) -> bool:
    """Revoke ``comm`` and poll until it is quiescent; False: not done by ``deadline``."""
    try:
        be._lib.revoke(comm)
    except Exception:  # noqa: BLE001 - NCCLError/NcclInvalid, or a libnccl without the symbol: abort instead
        return False
    delay = 1e-4
    while True:
        try:
            status = int(comm.get_async_error())
        except Exception:  # noqa: BLE001 - NcclInvalid: unusable, abort instead
            return False
        if status != IN_PROGRESS:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 2e-3)


def discard_revoked(be: NcclBackend) -> None:
    """``ncclCommAbort`` a revoked communicator nobody will shrink (bounded, idempotent)."""
    if be._abort_done is not None:
        be._abort_done.wait(be._abort_timeout)  # a revoke still running
    if not be._revoked or be._comm is None:
        return
    done = threading.Event()
    threading.Thread(target=_stop_comm, args=(be, done), name="asynccoll-nccl-abort", daemon=True).start()
    done.wait(be._abort_timeout)


def close_backend(be: NcclBackend) -> None:
    """Finalize (polled, bounded) and destroy the communicator; stop the threads.

    After an NCCL error, or if finalize does not complete within
    ``close_timeout``, the communicator is aborted instead (NCCL's advice).
    """
    with be._lock:
        if be._closed:
            return
        be._closed = True
    be._queue.put(STOP)
    if be._launcher is not threading.current_thread():
        be._launcher.join(5.0)
    be._watcher.close(timeout=5.0, drain=not be._aborted)
    be._barrier_buf = None
    if be._aborted:
        if be._abort_done is not None:
            be._abort_done.wait(be._abort_timeout)
        discard_revoked(be)  # finalize after revoke is invalid: abort it
        return
    comm = be._comm
    if comm is None:
        return
    if not be._broken and _finalize(be, comm):
        be._rt.close(True)
        return
    with be._lock:
        be._aborted = True
    be._rt.release_gate(be._next)
    done = be._abort_done = threading.Event()
    threading.Thread(target=_stop_comm, args=(be, done), name="asynccoll-nccl-abort", daemon=True).start()
    done.wait(be._abort_timeout)


def _finalize(be: NcclBackend, comm: Any) -> bool:
    try:
        with be._nccl_lock:
            comm.finalize()
        if be._poll(time.monotonic() + be._close_timeout) != SUCCESS:
            return False
        with be._nccl_lock:
            be._comm = None
            comm.destroy()
        return True
    except Exception:  # noqa: BLE001 - NCCLError from finalize/destroy: fall back to abort
        return False


def can_shrink(be: NcclBackend) -> bool:
    """Whether ``ncclCommShrink`` can run on ``be``: its communicator is alive (healthy,
    or revoked by abort) and not closed. Waits (bounded) for a revoke still running."""
    done = be._abort_done
    if done is not None:
        done.wait(be._abort_timeout)
    return not be._closed and be._comm is not None and (not be._aborted or be._revoked)


def shrink_agreed(
    be: NcclBackend, store: Any, new_rank: int, new_size: int, exclude: Sequence[int],
    abort_pending: bool | None, timeout: float,
) -> NcclBackend | None:
    """``shrink_backend`` if every survivor can shrink, else None (build a new one).

    Every survivor calls it (blocking, off the loop) with the new communicator's
    store: each publishes whether its communicator can still be shrunk (a revoke
    that fell back to abort cannot), and all take the same way, so no survivor
    waits in ``ncclCommShrink`` for one that re-initialises.
    """
    deadline = time.monotonic() + timeout
    mine = can_shrink(be)
    store.set(f"nccl-shrink/{new_rank}", "1" if mine else "0")
    keys = [f"nccl-shrink/{r}" for r in range(new_size)]
    store.wait(keys, timedelta(seconds=max(0.001, deadline - time.monotonic())))
    if not all(bytes(v) == b"1" for v in store.multi_get(keys)):
        discard_revoked(be)  # nobody shrinks it: free it before the new init
        return None
    return be.shrink(exclude, abort_pending, timeout=max(0.001, deadline - time.monotonic()))


def _poll_parent(be: NcclBackend, comm: Any, deadline: float) -> int | None:
    """Poll the shrunk parent until it leaves InProgress; None once it was aborted."""
    return poll_async_error(be._nccl_lock, lambda: comm if be._comm is comm else None, deadline)


def shrink_backend(be: NcclBackend, exclude: Sequence[int], abort_pending: bool | None, timeout: float) -> NcclBackend:
    """A new backend over ``ncclCommShrink`` without the ``exclude`` ranks (blocking).

    Every surviving rank must call it; excluded ranks must not. ``abort_pending``
    (default: whether ops are queued or in flight here, or an error was seen)
    shrinks with ``CommShrinkFlag.ABORT``, which first terminates the parent's
    outstanding ops; otherwise ``DEFAULT``, which needs them quiesced. Survivors
    are renumbered in order; the new backend gets its own comm stream. Needs the
    parent communicator alive or revoked (``abort()`` revokes where NCCL can);
    after an ``ncclCommAbort`` build a new one with ``create``. A revoked parent
    (or one shrunk with ABORT: no resources shared) is aborted once the new
    communicator is ready. Run it off the event loop.
    """
    if not can_shrink(be):
        raise CommAborted("the NCCL communicator was aborted; create a new one instead of shrinking")
    drop = sorted(set(int(r) for r in exclude))
    if be.rank in drop:
        raise InvalidArgument(f"rank {be.rank} cannot shrink a communicator it is excluded from")
    if any(not 0 <= r < be.world_size for r in drop) or len(drop) >= be.world_size:
        raise InvalidArgument(f"cannot exclude {drop} from a communicator of {be.world_size} ranks")
    if abort_pending is None:
        abort_pending = bool(be._inflight) or not be._queue.empty() or be._broken
    deadline = time.monotonic() + timeout
    with be._nccl_lock:
        parent = be._comm
        if parent is None:
            raise CommAborted("the NCCL communicator was aborted; create a new one instead of shrinking")
        new = be._lib.shrink(parent, drop, abort_pending)
    # Non-blocking: both the parent and the child must leave ncclInProgress.
    status = _poll_parent(be, parent, deadline)
    if status not in (SUCCESS, None):
        abort_quietly(new)
        raise be._async_failure(status)
    wait_ready(new, be._lib, deadline, "NCCL shrink")
    if be._revoked:  # a revoked parent shares nothing with the child: free it now
        with be._nccl_lock:
            old, be._comm = be._comm, None
        if old is not None:
            abort_quietly(old)
    rank = be.rank - sum(1 for r in drop if r < be.rank)
    return type(be)(
        new, rank=rank, world_size=be.world_size - len(drop), device=be.device,
        lib=be._lib, runtime=be._rt.sibling(), health_interval=be._health_interval,
        abort_timeout=be._abort_timeout, close_timeout=be._close_timeout, use_revoke=be._use_revoke,
    )
