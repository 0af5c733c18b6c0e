"""Object collectives through the rendezvous store, pickled.

Objects travel on a channel of their own: one worker thread per communicator runs
them strictly in call order, so they keep the contract's ordering among
themselves without stalling tensor collectives (and work for every backend,
NCCL included). Keys are named by the operation's sequence number, and the last
rank to read an operation's keys deletes them.

Payloads of any size: each rank's pickle is published under one header key, inline
when small, else as chunks of at most ``CHUNK`` bytes under ``<header>/<i>`` keys
written before the header (so a header that exists names chunks that exist). No
store value or reply ever nears TCPStore's payload limit.
"""

from __future__ import annotations

import collections
import pickle
import queue
import threading
import time
from typing import Any, Callable, Iterable

from .._base import shutdown
from .._base.errors import CommAborted, InvalidArgument

# TCPStore refuses a value over 8 MiB ("Invalid payload size ... max: 8388608") by
# dropping the client's connection, which breaks every user of that client (every
# communicator of the process on that store): values stay far below it.
#: Largest store value a payload chunk may take.
CHUNK = 4 << 20
#: Payloads up to this size ride in their header; headers are read
#: ``_HEADER_BATCH`` at a time, so one multi_get reply stays under ``CHUNK``.
INLINE = 64 << 10
_HEADER_BATCH = CHUNK // (INLINE + 32)
_INLINE, _CHUNKED = b"i", b"c"
#: While an object collective waits: how often it asks ``watch`` whether a peer died.
_WATCH_EVERY = 0.02
#: How many of the last operations begun an abort reports as possibly left (``unreleased``).
_RECENT = 8


def poll_keys(store: Any, keys: list[str], deadline: float) -> bool:
    """Wait until every key exists, until ``deadline`` (``time.monotonic()``).

    Polls ``check`` instead of a blocking ``wait``: a torch store client serialises
    its requests, so one long wait would stall every other thread sharing the
    client (the heartbeats among them, which peers would then read as death).
    """
    delay = 0.0005
    while not store.check(keys):
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    return True


def dumps(obj: Any) -> bytes:
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise InvalidArgument(f"object cannot be pickled: {exc}") from exc


class ObjectChannel:
    """Runs object collectives over ``store`` (a per-communicator prefix store).

    ``watch(ranks)``, when set, is asked now and then while an operation waits for
    ``ranks`` to publish: an exception it returns (a peer proven dead, the store
    gone) fails the operation at once instead of at its deadline.
    """

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self.watch: Callable[[list[int]], BaseException | None] | None = None
        #: Operations begun here and not released (a failure or an abort ended them), and
        #: the last ones begun (a peer may have dropped out before reading them: a
        #: broadcast's source runs ahead of its receivers): after an abort, their keys
        #: may stay until the communicator is forgotten (``drop_ops``).
        self._open: set[int] = set()
        self._recent: collections.deque[int] = collections.deque(maxlen=_RECENT)

    def run(self, fn: Callable[[], Any], done: Callable[[Any, BaseException | None], None]) -> None:
        """Run ``fn`` on the channel's thread, after every earlier call; report to ``done``."""

        def job() -> None:
            try:
                if self._stopped.is_set():
                    raise CommAborted("the communicator aborted before this object collective ran")
                value = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the Work, raised where it is awaited
                done(None, exc)
            else:
                done(value, None)

        with self._lock:
            if self._stopped.is_set():
                done(
                    None, CommAborted("the communicator aborted before this object collective ran")
                )
                return
            if self._jobs is None:
                # A daemon thread of its own (a pool's worker would hold interpreter
                # exit until a pending operation's deadline).
                self._jobs = queue.SimpleQueue()
                thread = self._thread = threading.Thread(
                    target=_serve, args=(self._jobs,), name="asynccoll-objects", daemon=True
                )
                thread.start()
                shutdown.register_native_thread(thread)  # store calls
            self._jobs.put(job)

    def unreleased(self) -> tuple[int, ...]:
        """After an abort: the operations whose keys may be left (see ``drop_ops``)."""
        with self._lock:
            return tuple(sorted(self._open.union(self._recent)))

    def _begin(self, seq: int) -> None:
        with self._lock:
            self._open.add(seq)
            self._recent.append(seq)

    def all_gather(self, seq: int, payload: bytes, timeout: float) -> list[Any]:
        keys = [f"obj/{seq}/{r}" for r in range(self._world_size)]
        self._begin(seq)
        self._publish(keys[self._rank], payload)
        self._wait(keys, list(range(self._world_size)), timeout)
        headers: list[bytes] = []
        for i in range(0, len(keys), _HEADER_BATCH):
            headers += self._store.multi_get(keys[i : i + _HEADER_BATCH])
        values = [
            payload if r == self._rank else self._fetch(key, header)  # our own: not read back
            for r, (key, header) in enumerate(zip(keys, headers))
        ]
        self._release(seq, keys, headers)
        return [pickle.loads(v) for v in values]

    def broadcast(self, seq: int, payload: bytes | None, src: int, timeout: float) -> Any:
        key = f"obj/{seq}/{src}"
        self._begin(seq)
        if self._rank == src:
            assert payload is not None
            self._publish(key, payload)
        self._wait([key], [src], timeout)
        header = self._store.get(key)
        value = self._fetch(key, header)
        self._release(seq, [key], [header])
        return pickle.loads(value)

    def _publish(self, key: str, payload: bytes) -> None:
        """Write ``payload`` under ``key``: inline, or chunks first and the header last."""
        if len(payload) <= INLINE:
            self._store.set(key, _INLINE + payload)
            return
        view = memoryview(payload)
        count = 0
        for start in range(0, len(payload), CHUNK):
            self._store.set(f"{key}/{count}", bytes(view[start : start + CHUNK]))
            count += 1
        self._store.set(key, _CHUNKED + str(count).encode())

    def _fetch(self, key: str, header: bytes) -> bytes:
        if header[:1] == _INLINE:
            return header[1:]
        return b"".join(self._store.get(f"{key}/{i}") for i in range(_chunks(header)))

    def _wait(self, keys: list[str], ranks: list[int], timeout: float) -> None:
        """Until every key exists (ranks[i] publishes keys[i]); polled like ``poll_keys``,
        and between polls the communicator's abort and ``watch`` can end the wait."""
        deadline = time.monotonic() + timeout
        next_watch = time.monotonic() + _WATCH_EVERY
        delay = 0.0005
        while not self._store.check(keys):
            if self._stopped.is_set():
                raise CommAborted("the communicator aborted")
            now = time.monotonic()
            if now >= deadline:
                missing = [k for k in keys if not self._store.check([k])]
                raise TimeoutError(f"object collective: {missing} not published within {timeout} s")
            watch = self.watch
            if watch is not None and now >= next_watch:
                next_watch = now + _WATCH_EVERY
                error = watch([r for r, k in zip(ranks, keys) if not self._store.check([k])])
                if error is not None:
                    raise error
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def _release(self, seq: int, keys: list[str], headers: list[bytes]) -> None:
        """The last rank to have read the operation's keys deletes them all."""
        last = self._store.add(f"obj/{seq}/read", 1) == self._world_size
        with self._lock:
            self._open.discard(seq)
        if last:
            for key, header in zip(keys, headers):
                if header[:1] == _CHUNKED:
                    for i in range(_chunks(header)):
                        self._store.delete_key(f"{key}/{i}")
                self._store.delete_key(key)
            self._store.delete_key(f"obj/{seq}/read")

    def shutdown(self, wait: float = 0.0) -> None:
        """Fail queued jobs and the one waiting (at its next poll); the thread then ends.

        ``wait``: seconds to wait for it to end (before the communicator's keys are
        deleted: a job between its wait and its ``get`` of a key deleted meanwhile would
        block in the store, and every request of its store client behind it, until the
        store's timeout; seen once in a shrink after a death during ``broadcast_state``)."""
        self._stopped.set()
        with self._lock:
            jobs, self._jobs = self._jobs, None
            thread = self._thread
        if jobs is not None:
            jobs.put(None)
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join(wait)


def drop_ops(store: Any, seqs: Iterable[int], world_size: int) -> None:
    """Delete what object collectives ``seqs`` left under ``store`` (their last reader never
    came: a failure or an abort ended them). Writes nothing and reads nothing: a chunk's
    header may be gone already, and the chunks of a header are numbered from 0 up."""
    for seq in seqs:
        for r in range(world_size):
            key = f"obj/{seq}/{r}"
            i = 0
            while store.delete_key(f"{key}/{i}"):
                i += 1
            store.delete_key(key)
        store.delete_key(f"obj/{seq}/read")


def _serve(jobs: queue.SimpleQueue[Callable[[], None] | None]) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        job()


def _chunks(header: bytes) -> int:
    return int(header[1:])
