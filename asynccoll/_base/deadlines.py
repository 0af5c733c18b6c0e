"""Operation deadlines: one timer thread per process, shared by every communicator.

Each communicator's ledger registers ``(deadline, seq)`` entries through its own
:class:`DeadlineClient`; the shared :class:`DeadlineService` thread calls the
client's ``expire(seq)`` when a live entry comes due.

Entries live in one heap with lazy deletion: nothing is removed when a Work
settles; the thread asks ``client.is_live(seq)`` when an entry comes due, and
``add`` compacts the heap whenever it has doubled over the live entries, so a high
rate of short operations does not grow memory. The sleeping thread is woken only
when a new deadline is earlier than the one it sleeps towards; with nothing due
it sleeps for the shortest timeout seen so far, so a steady stream of operations
with the usual timeout never wakes it (one context switch per op would cost more
than the op's whole Python overhead on a small machine).

Invariant (the lost-deadline race of the first version): every heap mutation —
push, pop, compaction — happens under ``_cond``; an entry pushed while the thread
examines the heap is never popped in place of another one.

Clients hold their ledger weakly, and the thread ends when no client is left, so
nothing here keeps a communicator (or a thread) alive after it is gone.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
import weakref
from typing import Protocol


class Expirable(Protocol):
    """What a client reports to: the communicator's ledger."""

    def is_live(self, seq: int) -> bool: ...

    def expired(self, seq: int) -> None: ...


class DeadlineService:
    """The process-wide timer thread (see the module docstring)."""

    def __init__(self, name: str = "asynccoll-deadlines") -> None:
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        # (deadline, tiebreak, seq, client)
        self._heap: list[tuple[float, int, int, DeadlineClient]] = []
        self._tiebreak = itertools.count()
        self._wake_at = math.inf  # when the thread next looks at the heap
        self._horizon = math.inf  # the shortest timeout ever added
        self._compact_at = 1024
        self._clients: weakref.WeakSet[DeadlineClient] = weakref.WeakSet()
        self._thread: threading.Thread | None = None

    def client(self, target: Expirable) -> DeadlineClient:
        """A handle through which ``target`` (held weakly) registers deadlines."""
        client = DeadlineClient(self, target)
        with self._cond:
            self._clients.add(client)
        return client

    @property
    def thread(self) -> threading.Thread | None:
        """The timer thread, while one runs."""
        return self._thread

    def __len__(self) -> int:
        return len(self._heap)

    # --------------------------------------------------------------- entries
    def _add(self, client: DeadlineClient, seq: int, timeout: float, deadline: float) -> None:
        entry = (deadline, next(self._tiebreak), seq, client)
        with self._cond:
            heap = self._heap
            heapq.heappush(heap, entry)
            if len(heap) > self._compact_at:
                self._compact()
            kick = timeout < self._horizon or deadline < self._wake_at
            if timeout < self._horizon:
                self._horizon = timeout
            if kick:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
                self._wake_at = deadline
                self._cond.notify()

    def _forget(self, client: DeadlineClient) -> None:
        with self._cond:
            self._clients.discard(client)
            self._heap = [e for e in self._heap if e[3] is not client]
            heapq.heapify(self._heap)
            self._cond.notify()

    def _compact(self) -> None:
        """Drop settled entries (caller holds ``_cond``; amortised O(1) per add)."""
        live = [e for e in self._heap if e[3].is_live(e[2])]
        heapq.heapify(live)
        self._heap = live
        self._compact_at = 2 * len(live) + 1024

    def _due(self) -> list[tuple[DeadlineClient, int]]:
        """Pop due and dead entries (caller holds ``_cond``); return the live due ones."""
        heap = self._heap
        now = time.monotonic()
        expired = []
        while heap:
            deadline, _, seq, client = heap[0]
            if deadline > now:
                if client.is_live(seq):
                    break
                heapq.heappop(heap)
                continue
            heapq.heappop(heap)
            if client.is_live(seq):
                expired.append((client, seq))
        self._wake_at = heap[0][0] if heap else now + self._horizon
        return expired

    def _run(self) -> None:
        cond = self._cond
        while True:
            with cond:
                expired = self._due()
                if not expired:
                    if not self._heap and not self._clients:
                        self._thread = None  # nobody left: a later add starts a new thread
                        self._wake_at = math.inf
                        return
                    delay = self._wake_at - time.monotonic()
                    cond.wait(None if delay == math.inf else max(delay, 0.0))
                    continue
            for client, seq in expired:
                client.fire(seq)
            del expired, client  # hold no client (and so no ledger) while asleep


class DeadlineClient:
    """One ledger's handle on the shared :class:`DeadlineService`."""

    __slots__ = ("_service", "_target", "__weakref__")

    def __init__(self, service: DeadlineService, target: Expirable) -> None:
        self._service = service
        self._target = weakref.ref(target)

    def add(self, seq: int, timeout: float, deadline: float | None = None) -> None:
        """Expire ``seq`` ``timeout`` seconds from now (or at ``deadline``, monotonic)."""
        if deadline is None:
            deadline = time.monotonic() + timeout
        self._service._add(self, seq, timeout, deadline)

    def is_live(self, seq: int) -> bool:
        target = self._target()
        return target is not None and target.is_live(seq)

    def fire(self, seq: int) -> None:
        target = self._target()
        if target is None:
            return
        try:
            target.expired(seq)
        except Exception as exc:  # noqa: BLE001 - the shared timer must survive a failing handler
            threading.excepthook(threading.ExceptHookArgs((type(exc), exc, exc.__traceback__, None)))

    def close(self) -> None:
        """Drop this client's entries; the thread ends once no client is left."""
        self._service._forget(self)


_service: DeadlineService | None = None
_service_lock = threading.Lock()


def service() -> DeadlineService:
    """The process's shared deadline service (created on first use; starts no thread)."""
    global _service
    if _service is None:
        with _service_lock:
            if _service is None:
                _service = DeadlineService()
    return _service

