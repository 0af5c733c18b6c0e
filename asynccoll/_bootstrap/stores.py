"""The process's TCPStores (one per address, shared by its communicators) and the
per-store creation lock that makes each rank build its communicators in order."""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable

import anyio
import torch.distributed as dist

from .._base.aio import run_in_thread
from .._base.errors import AsyncCollError, CollectiveTimeout, InvalidArgument
from .._base.foreign import store_error
from .._faults.service import HOST_KEY, Service, mark_host


class _StoreCache:
    """One TCPStore per ``(master_addr, master_port)`` per process, shared by its communicators.

    A second server on the same port would fail with EADDRINUSE; the contract's
    "many communicators in one process" reuses the first store instead (each
    communicator still gets its own prefix). A store is dropped when no
    communicator built on it is alive.

    A store whose server this process hosts (rank 0 without ``store=``) is
    marked as such on the server (``mark_host``: peers name this rank if the
    process dies), and before it is dropped, or at interpreter exit, the
    liveness services of the other processes are told and acknowledge
    (``Service.announce_leaving``): none of their requests meets a closed server.

    A store whose server is gone (its process died; one may have been restarted
    at the same address) is not handed out again: before a cached client is
    reused, it is checked (``_usable``), and a failed one is replaced by a new
    client (and its liveness service told, ``Service.forsake``). Communicators
    made on the old one keep it; the entry's holds count them all.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key_locks: dict[tuple[str, int], threading.Lock] = {}
        self._stores: dict[tuple[str, int], list[Any]] = {}  # key -> [store, holders, hosted here]

    def acquire(self, key: tuple[str, int], create: Callable[[], Any], hosted: bool = False) -> Any:
        """The store for ``key`` (made by ``create`` if none), with one hold taken. Blocking.

        ``hosted``: ``create`` makes the server, in this process."""
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:  # one creation per key; other keys proceed
            with self._lock:
                entry = self._stores.get(key)
            if entry is not None and (entry[2] or _usable(entry[0])):
                with self._lock:
                    if self._stores.get(key) is entry:  # (not released meanwhile)
                        entry[1] += 1
                        return entry[0]
            store = create()
            with self._lock:
                entry = self._stores.get(key)
                if entry is not None:  # the old client's server is gone: this one replaces it
                    entry[0] = store
                    entry[1] += 1
                    return store
            if hosted:
                mark_host(store)
            with self._lock:
                self._stores[key] = [store, 1, hosted]
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
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._stores[key]
        if entry[2]:
            Service.announce_leaving(entry[0])

    def leave_all(self) -> None:
        """At exit: tell the peers of every server this process still hosts."""
        with self._lock:
            hosted = [entry[0] for entry in self._stores.values() if entry[2]]
        for store in hosted:
            Service.announce_leaving(store)

    def __contains__(self, key: tuple[str, int]) -> bool:
        with self._lock:
            return key in self._stores


def _usable(store: Any) -> bool:
    """Whether a cached client's server still answers it (blocking: one request, unless its
    liveness service knows already). A client whose connection failed never recovers:
    torch's TCPStore client does not reconnect, to a restarted server either."""
    if Service.lost(store):
        return False
    try:
        store.check([HOST_KEY])
        return True
    except (dist.DistError, RuntimeError) as exc:  # DistNetworkError: broken pipe, reset
        Service.forsake(store, f"the rendezvous store failed: {exc}")
        return False


STORES = _StoreCache()
atexit.register(STORES.leave_all)

# Creation of communicators on one store, per process, one at a time. Gloo's
# constructor blocks inside the store client, which serves one request at a time:
# two creations interleaved on one client can each wait for a key that the other
# rank publishes only through the blocked client (a deadlock until the timeout).
# One at a time, each process builds its n-th communicator before its (n+1)-th,
# and the n-th pair with each other across ranks.
_CREATION_LOCKS: weakref.WeakKeyDictionary[Any, dict[int, threading.Lock]] = (
    weakref.WeakKeyDictionary()
)
_CREATION_GUARD = threading.Lock()


async def exclusive(store: Any, rank: int, timeout: float) -> threading.Lock:
    """Take ``rank``'s creation lock of ``store`` off the loop, within ``timeout``; the
    caller releases it. (Ranks run as threads of one process, as in the simulated-GPU
    tests, each have their own: only one rank's creations may not interleave.)"""
    with _CREATION_GUARD:
        lock = _CREATION_LOCKS.setdefault(store, {}).setdefault(rank, threading.Lock())
    if lock.acquire(blocking=False):  # the common case: no other creation; no thread needed
        return lock

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


async def _server_listening(addr: str, port: int, timeout: float) -> None:
    """Wait, on the loop, until something listens at ``addr:port``.

    A TCPStore client constructor with no server retries inside C++ until its
    timeout and prints a warning with a C++ stack trace per attempt, even when
    the process has given up and is exiting; it is started only once the server
    accepts connections (a bare connection, closed at once, leaves it silent).
    """
    try:
        await anyio.getaddrinfo(addr, port)
    except (OSError, UnicodeError) as exc:
        raise InvalidArgument(
            f"master_addr {addr!r} does not resolve to an address: {exc}"
        ) from None
    end = time.monotonic() + timeout
    delay = 0.01
    while True:
        try:
            with anyio.fail_after(max(0.001, min(1.0, end - time.monotonic()))):
                stream = await anyio.connect_tcp(addr, port)
            await stream.aclose()
            return
        except (OSError, TimeoutError):  # refused or unreachable: not up yet
            if time.monotonic() >= end:
                raise CollectiveTimeout(
                    f"store at {addr}:{port}: the store server did not arrive within {timeout} s: nothing "
                    "answered (is rank 0 running, and are master_addr/master_port right?)"
                ) from None
            await anyio.sleep(min(delay, max(0.0, end - time.monotonic())))
            delay = min(delay * 2, 0.2)


async def tcp_store(
    addr: str, port: int, rank: int, world_size: int, timeout: float
) -> tuple[Any, tuple[str, int]]:
    """The process's TCPStore for ``addr:port`` (shared), with one hold taken for the caller."""
    # Under torchrun's agent the store already runs; every rank is a client.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_server = rank == 0 and not agent_store
    key = (addr, port)

    def create() -> Any:
        try:
            socket.getaddrinfo(addr, port)
        except (OSError, UnicodeError) as exc:
            raise InvalidArgument(
                f"master_addr {addr!r} does not resolve to an address: {exc}"
            ) from None
        try:
            return dist.TCPStore(
                addr,
                port,
                world_size,
                is_server,
                timeout=timedelta(seconds=timeout),
                wait_for_workers=False,
            )
        except (dist.DistError, RuntimeError) as exc:  # DistNetworkError, DistStoreError
            raise store_error(exc, addr, port, timeout) from exc

    end = time.monotonic() + timeout
    if not is_server and key not in STORES:
        await _server_listening(addr, port, timeout)
    try:
        # A hold the thread still takes after we stopped waiting is given back.
        store = await run_in_thread(
            lambda: STORES.acquire(key, create, is_server),
            max(0.001, end - time.monotonic()),
            on_late=lambda _: STORES.release(key),
        )
    except AsyncCollError:
        raise
    except TimeoutError:
        raise CollectiveTimeout(
            f"store at {addr}:{port}: peers did not arrive within {timeout} s"
        ) from None
    return store, key
