"""``init()`` and ``wrap()``: rendezvous through a TCPStore and backend construction.

Nothing here blocks the event loop: creating or connecting to the store, and
building each backend (Gloo's full-mesh connect, NCCL's polled init), run on
executor threads, bounded by ``timeout``.
"""

from __future__ import annotations

import functools
import operator
import os
import socket
import threading
import weakref
from datetime import timedelta
from typing import Any, Callable, Generator

import torch
import torch.distributed as dist

from ._backends.common import kind_of
from ._backends.torch_pg import TorchGroupBackend
from ._core import validate
from ._core.aio import run_in_thread
from ._core.backend import Backend
from ._core.communicator import Communicator, exit_scope
from ._core.diagnostics import Diagnostics
from ._core.errors import (
    AsyncCollError,
    BackendUnavailable,
    CollectiveTimeout,
    CommAborted,
    InvalidArgument,
    PeerFailure,
)

_BACKENDS = ("auto", "gloo", "nccl")


def _int(value: Any, what: str, low: int, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]``, or ``InvalidArgument`` saying what to pass."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{what} must be an int, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{what} must be an int, got {value!r} ({type(value).__name__})") from None
    if number < low or (high is not None and number > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidArgument(f"{what} must be {bound}, got {number}")
    return number


def _env_int(value: Any, var: str, what: str, low: int, high: int | None = None) -> int:
    if value is not None:
        return _int(value, what, low, high)
    raw = os.environ.get(var)
    if raw is None:
        raise InvalidArgument(f"{what} not given and ${var} is not set (launch with torchrun or pass {what}=)")
    try:
        number = int(raw)
    except ValueError:
        raise InvalidArgument(f"${var}={raw!r} is not an integer") from None
    return _int(number, f"${var}", low, high)


def _check_args(
    backend: Any, store: Any, master_addr: Any, device: Any, timeout: Any, heartbeat: Any
) -> float:
    """Type and range checks of ``init``'s own arguments; returns the timeout as a float."""
    if not isinstance(backend, str) or backend not in _BACKENDS:
        raise InvalidArgument(f"backend must be one of {_BACKENDS}, got {backend!r}")
    timeout = validate.seconds(timeout, "timeout")
    if heartbeat is not None:
        validate.seconds(heartbeat, "heartbeat", allow_zero=True)
    if store is not None and not isinstance(store, dist.Store):
        raise InvalidArgument(f"store must be a torch.distributed.Store (TCPStore, FileStore...), got {type(store).__name__}")
    if master_addr is not None and (not isinstance(master_addr, str) or not master_addr):
        raise InvalidArgument(f"master_addr must be a host name or IP address (str), got {master_addr!r}")
    if device is not None:
        if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
            raise InvalidArgument(f"device must be None, an int, a str or a torch.device, got {device!r}")
        try:
            torch.device(device)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"device={device!r} is not a device: {exc}") from None
    return float(timeout)


class _StoreCache:
    """One TCPStore per ``(master_addr, master_port)`` per process, shared by its communicators.

    A second server on the same port would fail with EADDRINUSE; the contract's
    "many communicators in one process" reuses the first store instead (each
    communicator still gets its own prefix). A store is dropped when no
    communicator built on it is alive.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key_locks: dict[tuple[str, int], threading.Lock] = {}
        self._stores: dict[tuple[str, int], list[Any]] = {}  # key -> [store, holders]

    def acquire(self, key: tuple[str, int], create: Callable[[], Any]) -> Any:
        """The store for ``key`` (made by ``create`` if none), with one hold taken. Blocking."""
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:  # one creation per key; other keys proceed
            with self._lock:
                entry = self._stores.get(key)
                if entry is not None:
                    entry[1] += 1
                    return entry[0]
            store = create()
            with self._lock:
                self._stores[key] = [store, 1]
            return store

    def hold(self, key: tuple[str, int], owner: object) -> None:
        """One more hold on ``key``'s store, released when ``owner`` is garbage-collected."""
        with self._lock:
            entry = self._stores.get(key)
            if entry is None:
                return
            entry[1] += 1
        weakref.finalize(owner, self.release, key)

    def release(self, key: tuple[str, int]) -> None:
        with self._lock:
            entry = self._stores.get(key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._stores[key]

    def __contains__(self, key: tuple[str, int]) -> bool:
        with self._lock:
            return key in self._stores


_STORES = _StoreCache()

# Creation of communicators on one store, per process, one at a time. Gloo's
# constructor blocks inside the store client, which serves one request at a time:
# two creations interleaved on one client can each wait for a key that the other
# rank publishes only through the blocked client (a deadlock until the timeout).
# One at a time, each process builds its n-th communicator before its (n+1)-th,
# and the n-th pair with each other across ranks.
_CREATION_LOCKS: weakref.WeakKeyDictionary[Any, dict[int, threading.Lock]] = weakref.WeakKeyDictionary()
_CREATION_GUARD = threading.Lock()


async def _exclusive(store: Any, rank: int, timeout: float) -> threading.Lock:
    """Take ``rank``'s creation lock of ``store`` off the loop, within ``timeout``; the
    caller releases it. (Ranks run as threads of one process, as in the simulated-GPU
    tests, each have their own: only one rank's creations may not interleave.)"""
    with _CREATION_GUARD:
        lock = _CREATION_LOCKS.setdefault(store, {}).setdefault(rank, threading.Lock())

    def late(got: bool) -> None:  # cancelled while waiting: give it back once taken
        if got:
            lock.release()

    got = await run_in_thread(lambda: lock.acquire(True, timeout), None, on_late=late)
    if not got:
        raise CollectiveTimeout(
            f"another communicator on this store was still being created after {timeout} s "
            "(creations on one store run one at a time)"
        )
    return lock


class Rendezvous:
    """Where a communicator's ranks meet: a store, and a prefix unique to this communicator.

    ``key``: the ``(master_addr, master_port)`` of a store from the process's cache
    (this rendezvous holds one reference to it), or None for a store given by the user.
    """

    def __init__(self, store: Any, rank: int, world_size: int, key: tuple[str, int] | None = None) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.key = key

    def prefixed(self, prefix: str) -> Any:
        return dist.PrefixStore(prefix, self.store)


async def _off_loop(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """Run blocking ``fn`` on an executor thread; ``CollectiveTimeout`` after ``timeout``."""
    try:
        return await run_in_thread(fn, timeout)
    except AsyncCollError:
        raise
    except TimeoutError:
        raise CollectiveTimeout(f"{what}: peers did not arrive within {timeout} s") from None
    except RuntimeError as exc:  # torch gives no finer type for these (torch 2.13)
        kind = kind_of(exc)
        if kind == "timeout":
            raise CollectiveTimeout(f"{what}: peers did not arrive within {timeout} s: {exc}") from exc
        if kind == "peer":
            raise PeerFailure(f"{what}: a peer failed while the communicator was created: {exc}") from exc
        raise CommAborted(f"{what} failed: {exc}") from exc


def _store_error(exc: BaseException, addr: str, port: int, timeout: float) -> Exception:
    """A TCPStore constructor's DistNetworkError/DistStoreError as the contract's error."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    low = text.lower()
    if "eaddrinuse" in low or "address already in use" in low:
        return InvalidArgument(
            f"master_port {port} is already in use on this host (by another process): pick a free "
            f"port, or pass store= ({text})"
        )
    if "timed out" in low or "timeout" in low:
        return CollectiveTimeout(f"store at {addr}:{port}: peers did not arrive within {timeout} s: {text}")
    return InvalidArgument(
        f"no asynccoll/torch store answers at {addr}:{port} (check master_addr and master_port): {text}"
    )


async def _tcp_store(addr: str, port: int, rank: int, world_size: int, timeout: float) -> tuple[Any, tuple[str, int]]:
    """The process's TCPStore for ``addr:port`` (shared), with one hold taken for the caller."""
    # Under torchrun's agent the store already runs; every rank is a client.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_server = rank == 0 and not agent_store
    key = (addr, port)

    def create() -> Any:
        try:
            socket.getaddrinfo(addr, port)
        except (OSError, UnicodeError) as exc:
            raise InvalidArgument(f"master_addr {addr!r} does not resolve to an address: {exc}") from None
        try:
            return dist.TCPStore(
                addr, port, world_size, is_server,
                timeout=timedelta(seconds=timeout), wait_for_workers=False,
            )
        except (dist.DistError, RuntimeError) as exc:  # DistNetworkError, DistStoreError
            raise _store_error(exc, addr, port, timeout) from exc

    try:
        # A hold the thread still takes after we stopped waiting is given back.
        store = await run_in_thread(
            lambda: _STORES.acquire(key, create), timeout, on_late=lambda _: _STORES.release(key)
        )
    except AsyncCollError:
        raise
    except TimeoutError:
        raise CollectiveTimeout(f"store at {addr}:{port}: peers did not arrive within {timeout} s") from None
    return store, key


async def rendezvous(
    *,
    rank: int | None,
    world_size: int | None,
    master_addr: str | None,
    master_port: int | None,
    store: Any,
    timeout: float,
) -> Rendezvous:
    """Resolve the torchrun environment and meet the other ranks' store.

    Without ``store=``, the store for ``master_addr:master_port`` is the process's
    shared one (``_STORES``): the returned rendezvous holds one reference to it.
    """
    world_size = _env_int(world_size, "WORLD_SIZE", "world_size", 1)
    rank = _env_int(rank, "RANK", "rank", 0)
    if rank >= world_size:
        raise InvalidArgument(f"rank {rank} is out of range for world_size {world_size}")
    if store is not None:
        return Rendezvous(store, rank, world_size)
    master_addr = master_addr or os.environ.get("MASTER_ADDR")
    if not master_addr or (master_port is None and os.environ.get("MASTER_PORT") is None):
        raise InvalidArgument(
            "no store: pass store=, or master_addr/master_port (or set $MASTER_ADDR/$MASTER_PORT)"
        )
    port = _env_int(master_port, "MASTER_PORT", "master_port", 1, 65535)
    tcp, key = await _tcp_store(master_addr, port, rank, world_size, timeout)
    return Rendezvous(tcp, rank, world_size, key)


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

    backend: Backend = await nccl.create(rdv, prefix + "nccl/", device, timeout)
    return backend


def _nccl_missing() -> str | None:
    from ._backends.nccl import missing

    return missing()


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
    nccl_backend: Backend | None = None,
) -> Communicator:
    # nccl_backend: a ready NCCL backend (shrink's ncclCommShrink) used instead of a new init.
    timeout = _check_args(backend, store, master_addr, device, timeout, heartbeat)
    if check not in (None, "fingerprint"):
        raise InvalidArgument(f"check must be None or 'fingerprint', got {check!r}")
    if trace_dir is not None and not isinstance(trace_dir, (str, os.PathLike)):
        raise InvalidArgument(f"trace_dir must be a path, got {type(trace_dir).__name__}")
    use_nccl = False
    if backend in ("nccl", "auto"):
        # "auto" serves CUDA tensors with NCCL whenever CUDA, nccl4py, cuda-bindings
        # and libnccl are all usable here; "nccl" insists on them.
        missing = _nccl_missing()
        if missing is None:
            use_nccl = True
        elif backend == "nccl":
            raise BackendUnavailable(missing)
    rdv = await rendezvous(
        rank=rank, world_size=world_size, master_addr=master_addr,
        master_port=master_port, store=store, timeout=timeout,
    )
    try:
        lock = await _exclusive(rdv.store, rdv.rank, timeout)
        try:
            comm = await _connect(rdv, backend, use_nccl, device, timeout, check, trace_dir, heartbeat, nccl_backend)
        finally:
            lock.release()
    except BaseException:
        if rdv.key is not None:
            _STORES.release(rdv.key)
        raise
    if rdv.key is not None:
        # The hold taken by rendezvous() ends with this communicator.
        weakref.finalize(comm, _STORES.release, rdv.key)
    return comm


async def _connect(
    rdv: Rendezvous, backend: str, use_nccl: bool, device: Any, timeout: float,
    check: str | None, trace_dir: Any, heartbeat: float | None, nccl_backend: Backend | None = None,
) -> Communicator:
    """Build the backends and the Communicator on a met rendezvous."""
    prefix = await _comm_prefix(rdv, timeout)
    backends: dict[str | None, Backend] = {}
    if backend in ("gloo", "auto"):
        backends["cpu"] = await _gloo(rdv, prefix, timeout)
    if use_nccl:
        backends["cuda"] = nccl_backend or await _nccl(rdv, prefix, device, timeout)
    dev = getattr(backends.get("cuda"), "device", None) or torch.device("cpu")
    diagnostics = await _diagnostics(rdv, prefix, backends, backend, check, trace_dir, timeout)
    # Heartbeats: detection on where a dead peer would hang (NCCL) or when asked
    # for; otherwise a slower census-only beat that names ranks Gloo lost.
    detect = heartbeat is not None or use_nccl
    interval = heartbeat if heartbeat is not None else (1.0 if use_nccl else 0.25)

    async def rebuild(
        new_rank: int, new_size: int, suffix: str, failed: bool = False, excluded: tuple[int, ...] = ()
    ) -> Communicator:
        # For a backend-level shrink (see _core/shrink.py): ``excluded`` are the old
        # ranks left out, ``failed`` says it follows a failure (its abort flag).
        # A store connection of its own: a group construction that waits for a
        # survivor who died meanwhile must not hold the connection that the
        # liveness service and shrink's watch use (a client serialises requests).
        store = await _off_loop(rdv.prefixed(prefix + suffix).clone, timeout, "store")
        # NCCL: ncclCommShrink of the old (revoked) communicator, ABORT flag after a
        # failure, DEFAULT for a planned shrink; None (a new init) unless every survivor can.
        shrink_agreed, shrunk = getattr(backends.get("cuda"), "shrink_agreed", None), None
        if shrink_agreed is not None:
            job = functools.partial(shrink_agreed, store, new_rank, new_size, excluded, failed, timeout)
            shrunk = await _off_loop(job, timeout, "nccl shrink")
        try:
            new = await _build(
                backend, rank=new_rank, world_size=new_size, master_addr=None, master_port=None,
                store=store, device=device, timeout=timeout, check=check,
                trace_dir=trace_dir, heartbeat=heartbeat, nccl_backend=shrunk,
            )
        except BaseException:
            if shrunk is not None:
                shrunk.release()  # bounded ncclCommAbort of the unused child
            raise
        if rdv.key is not None:
            _STORES.hold(rdv.key, new)  # it uses the shared store too
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

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._comm is not None:
            await exit_scope(self._comm, exc)


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
    the store. ``None`` (default): NCCL detects dead peers with 1 s beats; Gloo
    reports a dead peer's closed connection by itself, and an immediate census
    names the failed rank (the 0.25 s beats only back it up where no answer
    settles it). A number turns detection on for every backend (a peer silent
    for 3 beats, and then to a census, raises ``PeerFailure``); ``0`` turns
    heartbeats and the census off.
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
    timeout = validate.seconds(timeout, "timeout")
    if store is not None and not isinstance(store, dist.Store):
        raise InvalidArgument(f"store must be a torch.distributed.Store, got {type(store).__name__}")
    ws = process_group.size()
    name = process_group.name() if hasattr(process_group, "name") else "torch"
    # A Gloo group gets Gloo's capability table (validate.CAPS); any other kind, torch's checks.
    kind = "gloo" if name == "gloo" else "torch"
    backend = TorchGroupBackend(process_group, name=kind, device_type=None, world_size=ws, timeout=timeout)
    return Communicator(
        rank=process_group.rank(),
        world_size=ws,
        backends={None: backend},
        backend_name=f"torch:{name}",
        device=torch.device("cpu"),
        store=store,
        timeout=timeout,
    )
