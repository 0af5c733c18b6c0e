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

The common case costs no lock and no heap push: a client's deadlines usually come
in order (every op with the same timeout, issued one after another), so each
client keeps them in a FIFO of its own and only its head sits in the shared heap
(under a negative seq: the arming's generation, so an entry armed before the
latest one is dead). When that entry comes due the client expires what is due in
its FIFO and arms its next head. A deadline earlier than the
FIFO's last one (a shorter per-op timeout) goes into the heap as itself. The FIFO
drops settled entries from its head as it grows, and is rebuilt from the live
ones when it holds more than twice as many as are live.
"""

from __future__ import annotations

import collections
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
    """One ledger's handle on the shared :class:`DeadlineService` (see the module docstring)."""

    __slots__ = ("_service", "_target", "_fifo", "_lock", "_limit", "_gen", "__weakref__")

    def __init__(self, service: DeadlineService, target: Expirable) -> None:
        self._service = service
        self._target = weakref.ref(target)
        self._fifo: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()  # guards the FIFO (uncontended: its ledger's lock is held)
        self._limit = 1024
        self._gen = 0  # the FIFO head's arming: its heap entry is seq -_gen

    def add(self, seq: int, timeout: float, deadline: float | None = None) -> None:
        """Expire ``seq`` ``timeout`` seconds from now (or at ``deadline``, monotonic)."""
        if deadline is None:
            deadline = time.monotonic() + timeout
        fifo = self._fifo
        with self._lock:
            if not fifo or deadline >= fifo[-1][0]:
                fifo.append((deadline, seq))
                if len(fifo) == 1:
                    self._arm(timeout, deadline)
                elif len(fifo) > self._limit:
                    self._trim()
                return
        self._service._add(self, seq, timeout, deadline)  # out of order: the heap

    def _arm(self, timeout: float, deadline: float) -> None:
        """Put the FIFO's head in the shared heap (an earlier arming is dead from now on).
        Caller holds ``_lock``."""
        self._gen += 1
        self._service._add(self, -self._gen, timeout, deadline)

    def _trim(self) -> None:
        """Drop settled entries: from the head, and all of them if that is not enough.
        Caller holds ``_lock``."""
        target = self._target()
        if target is None:
            return
        fifo = self._fifo
        while fifo and not target.is_live(fifo[0][1]):
            fifo.popleft()
        if len(fifo) > self._limit // 2:
            live = [e for e in fifo if target.is_live(e[1])]
            fifo.clear()
            fifo.extend(live)
        self._limit = max(1024, 2 * len(fifo))

    def is_live(self, seq: int) -> bool:
        if seq < 0:  # the FIFO's head entry: live if it is the latest arming
            return -seq == self._gen and bool(self._fifo)
        target = self._target()
        return target is not None and target.is_live(seq)

    def fire(self, seq: int) -> None:
        target = self._target()
        if target is None:
            return
        if seq < 0:
            self._fire_fifo(target)
            return
        self._expire(target, seq)

    @staticmethod
    def _expire(target: Expirable, seq: int) -> None:
        try:
            target.expired(seq)
        except Exception as exc:  # noqa: BLE001 - the shared timer must survive a failing handler
            threading.excepthook(
                threading.ExceptHookArgs((type(exc), exc, exc.__traceback__, None))
            )

    def _fire_fifo(self, target: Expirable) -> None:
        """The FIFO's head came due (timer thread): expire what is due, arm the rest."""
        due = []
        with self._lock:
            fifo = self._fifo
            now = time.monotonic()
            while fifo and (fifo[0][0] <= now or not target.is_live(fifo[0][1])):
                deadline, seq = fifo.popleft()
                if deadline <= now:
                    due.append(seq)
            if fifo:
                self._arm(
                    math.inf, fifo[0][0]
                )  # an infinite "timeout": the service's horizon stays
        for seq in due:
            if target.is_live(seq):
                self._expire(target, seq)

    def close(self) -> None:
        """Drop this client's entries; the thread ends once no client is left."""
        self._fifo.clear()
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
