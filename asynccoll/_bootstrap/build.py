"""Building a communicator on a met rendezvous: its backends, diagnostics and the
``rebuild`` closure that ``shrink()`` uses.

Nothing here blocks the event loop: building each backend (Gloo's full-mesh
connect, NCCL's polled init) runs on executor threads, bounded by ``timeout``.
"""

from __future__ import annotations

import functools
import os
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._backends.torch_pg import TorchGroupBackend
from .._base.errors import BackendUnavailable, InvalidArgument
from .._core.backend import Backend
from .._core.communicator import Communicator
from .._diag.diagnostics import Diagnostics
from .args import check_args
from .rendezvous import Rendezvous, agree_options, comm_prefix, forget, off_loop, rendezvous
from .stores import STORES, exclusive

#: Seconds Gloo's connect timeout outlasts ours.
_GLOO_MARGIN = 30.0


async def build_gloo(rdv: Rendezvous, prefix: str, timeout: float) -> TorchGroupBackend:
    store = rdv.prefixed(prefix + "gloo/")

    def build() -> Any:
        # Gloo's own connect timeout outlasts ours: when we give up (CollectiveTimeout,
        # Ctrl-C) and the process exits, its wait is still quietly under way instead of
        # printing C++ warnings on the way out. Its ops then get our timeout again
        # (ProcessGroupGloo._set_default_timeout, torch >= 2.1).
        pg = dist.ProcessGroupGloo(store, rdv.rank, rdv.world_size, timedelta(seconds=timeout + _GLOO_MARGIN))
        set_default = getattr(pg, "_set_default_timeout", None)
        if set_default is not None:
            set_default(timedelta(seconds=timeout))
        return pg

    pg = await off_loop(build, timeout, "gloo init")
    return TorchGroupBackend(pg, name="gloo", device_type="cpu", world_size=rdv.world_size, timeout=timeout)


async def build_nccl(rdv: Rendezvous, prefix: str, device: Any, timeout: float) -> Backend:
    from .._backends import nccl

    backend: Backend = await nccl.create(rdv, prefix + "nccl/", device, timeout)
    return backend


def nccl_missing() -> str | None:
    from .._backends.nccl import missing

    return missing()


async def build_communicator(
    backend: str,
    *,
    rank: int | None,
    world_size: int | None,
    master_addr: str | None,
    master_port: int | None,
    store: Any,
    device: Any,
    timeout: float,
    check: str | None,
    trace_dir: Any,
    heartbeat: float | None = None,
    nccl_backend: Backend | None = None,
) -> Communicator:
    # nccl_backend: a ready NCCL backend (shrink's ncclCommShrink) used instead of a new init.
    timeout = check_args(backend, store, master_addr, device, timeout, heartbeat)
    if check not in (None, "fingerprint"):
        raise InvalidArgument(f"check must be None or 'fingerprint', got {check!r}")
    if trace_dir is not None and not isinstance(trace_dir, (str, os.PathLike)):
        raise InvalidArgument(f"trace_dir must be a path, got {type(trace_dir).__name__}")
    use_nccl = False
    if backend in ("nccl", "auto"):
        # "auto" serves CUDA tensors with NCCL whenever CUDA, nccl4py, cuda-bindings
        # and libnccl are all usable here; "nccl" insists on them.
        missing = nccl_missing()
        if missing is None:
            use_nccl = True
        elif backend == "nccl":
            raise BackendUnavailable(missing)
    rdv = await rendezvous(
        rank=rank, world_size=world_size, master_addr=master_addr,
        master_port=master_port, store=store, timeout=timeout,
    )
    try:
        lock = await exclusive(rdv.store, rdv.rank, timeout)
        try:
            comm = await connect(rdv, backend, use_nccl, device, timeout, check, trace_dir, heartbeat, nccl_backend)
        finally:
            lock.release()
    except BaseException:
        if rdv.key is not None:
            STORES.release(rdv.key)
        raise
    if rdv.key is not None:
        # The hold taken by rendezvous() ends with this communicator.
        weakref.finalize(comm, STORES.release, rdv.key)
    return comm


async def connect(
    rdv: Rendezvous, backend: str, use_nccl: bool, device: Any, timeout: float,
    check: str | None, trace_dir: Any, heartbeat: float | None, nccl_backend: Backend | None = None,
) -> Communicator:
    """Build the backends and the Communicator on a met rendezvous."""
    prefix = await comm_prefix(rdv, timeout)
    await agree_options(rdv, prefix, {
        "backend": backend, "nccl": use_nccl, "check": check, "heartbeat": heartbeat, "world_size": rdv.world_size,
    }, timeout)
    backends: dict[str | None, Backend] = {}
    if backend in ("gloo", "auto"):
        backends["cpu"] = await build_gloo(rdv, prefix, timeout)
    if use_nccl:
        backends["cuda"] = nccl_backend or await build_nccl(rdv, prefix, device, timeout)
    dev = getattr(backends.get("cuda"), "device", None) or torch.device("cpu")
    diagnostics = await build_diagnostics(rdv, prefix, backends, backend, check, trace_dir, timeout)
    # Heartbeats: detection on where a dead peer would hang (NCCL) or when asked
    # for; otherwise a slower census-only beat that names ranks Gloo lost.
    detect = heartbeat is not None or use_nccl
    interval = heartbeat if heartbeat is not None else (1.0 if use_nccl else 0.25)

    async def rebuild(
        new_rank: int, new_size: int, suffix: str, failed: bool = False, excluded: tuple[int, ...] = ()
    ) -> Communicator:
        # For a backend-level shrink (see _faults/shrink.py): ``excluded`` are the old
        # ranks left out, ``failed`` says it follows a failure (its abort flag).
        # A store connection of its own: a group construction that waits for a
        # survivor who died meanwhile must not hold the connection that the
        # liveness service and shrink's watch use (a client serialises requests).
        store = await off_loop(rdv.prefixed(prefix + suffix).clone, timeout, "store")
        # NCCL: ncclCommShrink of the old (revoked) communicator, ABORT flag after a
        # failure, DEFAULT for a planned shrink; None (a new init) unless every survivor can.
        shrink_agreed, shrunk = getattr(backends.get("cuda"), "shrink_agreed", None), None
        if shrink_agreed is not None:
            job = functools.partial(shrink_agreed, store, new_rank, new_size, excluded, failed, timeout)
            shrunk = await off_loop(job, timeout, "nccl shrink")
        try:
            new = await build_communicator(
                backend, rank=new_rank, world_size=new_size, master_addr=None, master_port=None,
                store=store, device=device, timeout=timeout, check=check,
                trace_dir=trace_dir, heartbeat=heartbeat, nccl_backend=shrunk,
            )
        except BaseException:
            if shrunk is not None:
                shrunk.release()  # bounded ncclCommAbort of the unused child
            raise
        if rdv.key is not None:
            STORES.hold(rdv.key, new)  # it uses the shared store too
        return new

    return Communicator(
        rank=rdv.rank,
        world_size=rdv.world_size,
        backends=backends,
        backend_name=backend,
        device=dev,
        store=rdv.prefixed(prefix),
        timeout=timeout,
        heartbeat=interval or None,
        detect_failures=detect,
        rebuild=rebuild,
        diagnostics=diagnostics,
        forget=functools.partial(forget, rdv, prefix),
    )


async def build_diagnostics(
    rdv: Rendezvous, prefix: str, backends: dict[str | None, Backend], name: str,
    check: str | None, trace_dir: Any, timeout: float,
) -> Diagnostics:
    """The communicator's diagnostics (API.md §6); with ``check``, wraps ``backends`` in place."""
    checker = None
    if check == "fingerprint" and rdv.world_size > 1:
        from .._diag.fingerprint import FingerprintChecker, store_host

        store = rdv.prefixed(prefix)
        host = store_host(rdv.store)
        checker = await off_loop(
            lambda: FingerprintChecker.connect(store, rdv.rank, rdv.world_size, timeout, host),
            timeout, "fingerprint channel",
        )
        for key, be in list(backends.items()):
            # Not NCCL yet: its submit records the caller's current stream, so it cannot
            # be deferred to the checker's thread (see fingerprint.py, "Scope").
            if be.device_type != "cuda":
                backends[key] = checker.wrap(be)
    return Diagnostics(
        rank=rdv.rank, world_size=rdv.world_size, backend=name,
        trace_dir=os.fspath(trace_dir) if trace_dir is not None else None, checker=checker,
    )


