"""``init()`` and ``wrap()``: rendezvous through a TCPStore and backend construction.

Nothing here blocks the event loop: creating or connecting to the store, and
building each backend (Gloo's full-mesh connect, NCCL's polled init), run on
executor threads, bounded by ``timeout``.
"""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta
from typing import Any, Callable, Generator

import torch
import torch.distributed as dist

from ._backends.torch_pg import TorchGroupBackend
from ._core.backend import Backend
from ._core.communicator import Communicator
from ._core.diagnostics import Diagnostics
from ._core.errors import BackendUnavailable, CollectiveTimeout, InvalidArgument

_BACKENDS = ("auto", "gloo", "nccl")


def _waker_factory() -> Callable[[asyncio.AbstractEventLoop], Any] | None:
    from streams import loop_waker

    return loop_waker


def _env_int(value: int | None, var: str, what: str) -> int:
    if value is not None:
        return value
    raw = os.environ.get(var)
    if raw is None:
        raise InvalidArgument(f"{what} not given and ${var} is not set (launch with torchrun or pass {what}=)")
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgument(f"${var}={raw!r} is not an integer") from None


class Rendezvous:
    """Where a communicator's ranks meet: a store, and a prefix unique to this communicator."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size

    def prefixed(self, prefix: str) -> Any:
        return dist.PrefixStore(prefix, self.store)


async def _off_loop(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """Run blocking ``fn`` on an executor thread; ``CollectiveTimeout`` after ``timeout``."""
    loop = asyncio.get_running_loop()
    fut = loop.run_in_executor(None, fn)
    try:
        return await asyncio.wait_for(fut, timeout)
    except asyncio.TimeoutError:
        raise CollectiveTimeout(f"{what}: peers did not arrive within {timeout} s") from None
    except RuntimeError as exc:
        text = str(exc).lower()
        if "timeout" in text or "timed out" in text:
            raise CollectiveTimeout(f"{what}: peers did not arrive within {timeout} s: {exc}") from exc
        raise


async def rendezvous(
    *,
    rank: int | None,
    world_size: int | None,
    master_addr: str | None,
    master_port: int | None,
    store: Any,
    timeout: float,
) -> Rendezvous:
    """Resolve the torchrun environment and meet the other ranks' store."""
    rank = _env_int(rank, "RANK", "rank")
    world_size = _env_int(world_size, "WORLD_SIZE", "world_size")
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidArgument(f"rank {rank} is out of range for world_size {world_size}")
    if store is None:
        master_addr = master_addr or os.environ.get("MASTER_ADDR")
        port = master_port if master_port is not None else os.environ.get("MASTER_PORT")
        if not master_addr or port is None:
            raise InvalidArgument(
                "no store: pass store=, or master_addr/master_port (or set $MASTER_ADDR/$MASTER_PORT)"
            )
        port = int(port)
        # Under torchrun's agent the store already runs; every rank is a client.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        is_server = rank == 0 and not agent_store

        def connect() -> Any:
            return dist.TCPStore(
                master_addr, port, world_size, is_server,
                timeout=timedelta(seconds=timeout), wait_for_workers=False,
            )

        store = await _off_loop(connect, timeout, f"store at {master_addr}:{port}")
    return Rendezvous(store, rank, world_size)


async def _comm_prefix(rdv: Rendezvous, timeout: float) -> str:
    # The n-th communicator a rank creates on a store pairs with every other rank's
    # n-th one (creation order must match across ranks, as in torch and NCCL).
    key = f"asynccoll/count/{rdv.rank}"
    n = await _off_loop(lambda: rdv.store.add(key, 1), timeout, "store")
    return f"asynccoll/{n}/"


async def _gloo(rdv: Rendezvous, prefix: str, timeout: float) -> TorchGroupBackend:
    store = rdv.prefixed(prefix + "gloo/")

    def build() -> Any:
        return dist.ProcessGroupGloo(store, rdv.rank, rdv.world_size, timedelta(seconds=timeout))

    pg = await _off_loop(build, timeout, "gloo init")
    return TorchGroupBackend(pg, name="gloo", device_type="cpu", world_size=rdv.world_size, timeout=timeout)


async def _nccl(rdv: Rendezvous, prefix: str, device: Any, timeout: float) -> Backend:
    from ._backends import nccl

    return await nccl.create(rdv, prefix + "nccl/", device, timeout)


def _nccl_missing() -> str | None:
    from ._backends import nccl

    return nccl.missing()


async def _build(
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
) -> Communicator:
    if backend not in _BACKENDS:
        raise InvalidArgument(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise InvalidArgument(f"timeout must be a positive number of seconds, got {timeout!r}")
    if check not in (None, "fingerprint"):
        raise InvalidArgument(f"check must be None or 'fingerprint', got {check!r}")
    if trace_dir is not None and not isinstance(trace_dir, (str, os.PathLike)):
        raise InvalidArgument(f"trace_dir must be a path, got {type(trace_dir).__name__}")
    if heartbeat is not None and (isinstance(heartbeat, bool) or not isinstance(heartbeat, (int, float)) or heartbeat < 0):
        raise InvalidArgument(f"heartbeat must be None or a number of seconds >= 0, got {heartbeat!r}")
    timeout = float(timeout)
    use_nccl = backend == "nccl"
    if backend in ("nccl", "auto"):
        missing = _nccl_missing()
        if missing is not None:
            if backend == "nccl":
                raise BackendUnavailable(missing)
            use_nccl = False
    rdv = await rendezvous(
        rank=rank, world_size=world_size, master_addr=master_addr,
        master_port=master_port, store=store, timeout=timeout,
    )
    prefix = await _comm_prefix(rdv, timeout)
    backends: dict[str | None, Backend] = {}
    if backend in ("gloo", "auto"):
        backends["cpu"] = await _gloo(rdv, prefix, timeout)
    if use_nccl:
        backends["cuda"] = await _nccl(rdv, prefix, device, timeout)
    dev = getattr(backends.get("cuda"), "device", None) or torch.device("cpu")
    diagnostics = await _diagnostics(rdv, prefix, backends, backend, check, trace_dir, timeout)
    # Heartbeats: detection on where a dead peer would hang (NCCL) or when asked
    # for; otherwise a slower census-only beat that names ranks Gloo lost.
    detect = heartbeat is not None or use_nccl
    interval = heartbeat if heartbeat is not None else (1.0 if use_nccl else 0.25)

    async def rebuild(new_rank: int, new_size: int, suffix: str) -> Communicator:
        return await _build(
            backend, rank=new_rank, world_size=new_size, master_addr=None, master_port=None,
            store=rdv.prefixed(prefix + suffix), device=device, timeout=timeout, check=check,
            trace_dir=trace_dir, heartbeat=heartbeat,
        )

    return Communicator(
        rank=rdv.rank,
        world_size=rdv.world_size,
        backends=backends,
        backend_name=backend,
        device=dev,
        store=rdv.prefixed(prefix),
        timeout=timeout,
        waker_factory=_waker_factory(),
        heartbeat=interval or None,
        detect_failures=detect,
        rebuild=rebuild,
        diagnostics=diagnostics,
    )


async def _diagnostics(
    rdv: Rendezvous, prefix: str, backends: dict[str | None, Backend], name: str,
    check: str | None, trace_dir: Any, timeout: float,
) -> Diagnostics:
    """The communicator's diagnostics (API.md §6); with ``check``, wraps ``backends`` in place."""
    checker = None
    if check == "fingerprint" and rdv.world_size > 1:
        from ._core.fingerprint import FingerprintChecker, store_host

        store = rdv.prefixed(prefix)
        host = store_host(rdv.store)
        checker = await _off_loop(
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


class _Init:
    """What ``init()`` returns: awaitable, and an async context manager that closes."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self._kwargs = kwargs
        self._comm: Communicator | None = None

    def __await__(self) -> Generator[Any, None, Communicator]:
        return _build(**self._kwargs).__await__()

    async def __aenter__(self) -> Communicator:
        self._comm = await _build(**self._kwargs)
        return self._comm

    async def __aexit__(self, *exc: Any) -> None:
        if self._comm is not None:
            await self._comm.close()


def init(
    backend: str = "auto",
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    store: Any = None,
    device: Any = None,
    timeout: float = 60.0,
    check: str | None = None,
    trace_dir: Any = None,
    heartbeat: float | None = None,
) -> _Init:
    """Create a communicator: ``comm = await init(...)`` or ``async with init(...) as comm``.

    ``rank``/``world_size``/``master_addr``/``master_port`` default to torchrun's
    environment; ``store`` rendezvous through an existing torch Store instead.
    ``backend``: ``"gloo"`` (CPU), ``"nccl"`` (CUDA via nccl4py) or ``"auto"`` (both,
    dispatching each op by its tensors' device). Peers that do not arrive within
    ``timeout`` seconds raise ``CollectiveTimeout``; nothing blocks the event loop.

    ``heartbeat`` (an asynccoll extension): seconds between liveness beats through
    the store. ``None`` (default): NCCL detects dead peers with 1 s beats; Gloo,
    which reports a dead peer's closed connection by itself, beats every 0.25 s
    only to name the failed rank (a census of up to 3 beats after the failure). A number turns detection on for every backend (a peer
    silent for 3 beats raises ``PeerFailure``); ``0`` turns heartbeats off.
    """
    return _Init(
        dict(
            backend=backend, rank=rank, world_size=world_size, master_addr=master_addr,
            master_port=master_port, store=store, device=device, timeout=timeout,
            check=check, trace_dir=trace_dir, heartbeat=heartbeat,
        )
    )


def wrap(process_group: Any, *, store: Any = None, timeout: float = 60.0) -> Communicator:
    """A Communicator over an existing ``torch.distributed.ProcessGroup`` (any backend).

    A backend object such as ``ProcessGroupGloo`` built directly is accepted too.

    Ops are dispatched to the group as they are; ``await`` follows the group's own
    futures (for NCCL groups that means stream-ordered completion, as in torch).
    Object collectives need ``store`` (any torch Store shared by the group's ranks).
    """
    from torch._C._distributed_c10d import Backend as _TorchBackend

    if not isinstance(process_group, (dist.ProcessGroup, _TorchBackend)):
        raise InvalidArgument(f"wrap() needs a torch.distributed.ProcessGroup, got {type(process_group).__name__}")
    ws = process_group.size()
    name = process_group.name() if hasattr(process_group, "name") else "torch"
    backend = TorchGroupBackend(process_group, name="torch", device_type=None, world_size=ws, timeout=timeout)
    return Communicator(
        rank=process_group.rank(),
        world_size=ws,
        backends={None: backend},
        backend_name=f"torch:{name}",
        device=torch.device("cpu"),
        store=store,
        timeout=timeout,
        waker_factory=_waker_factory(),
    )
