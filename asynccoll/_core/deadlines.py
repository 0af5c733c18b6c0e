"""One timer thread per communicator that enforces every operation's deadline.

Deadlines live in a heap with lazy deletion: nothing is removed when a Work
settles; the thread asks ``is_live(key)`` when an entry comes due, and ``add``
compacts the heap whenever it has doubled over the live entries, so a high rate
of short operations does not grow memory. ``add`` takes no lock in the common case (``heappush`` is
atomic under the GIL), and the sleeping thread is woken only when a new deadline
is earlier than the one it sleeps towards. With nothing due, the thread sleeps
for the shortest timeout seen so far: any later ``add`` with a timeout at least
that long then falls after its wake-up, so a stream of short operations with the
usual timeout never wakes it (one context switch per op would cost more than the
op's whole Python overhead on a small machine).
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from typing import Callable


class DeadlineTimer:
    """Calls ``on_expire(key)`` from its own thread when a live key's deadline passes."""

    def __init__(
        self,
        on_expire: Callable[[int], None],
        is_live: Callable[[int], bool],
        name: str = "asynccoll-deadlines",
    ) -> None:
        self._on_expire = on_expire
        self._is_live = is_live
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int]] = []
        # When the thread will next look at the heap (inf: sleeping until notified).
        self._wake_at = math.inf
        self._horizon = math.inf  # the shortest timeout ever added
        self._compact_at = 1024  # heap size that triggers dropping settled entries
        self._thread: threading.Thread | None = None
        self._stopped = False

    def add(self, key: int, timeout: float, deadline: float | None = None) -> None:
        """Register ``key`` to expire ``timeout`` seconds from now (or at ``deadline``,
        a ``time.monotonic()`` instant, when given)."""
        if deadline is None:
            deadline = time.monotonic() + timeout
        heap = self._heap
        heapq.heappush(heap, (deadline, key))
        if len(heap) > self._compact_at:
            self._compact()
        if timeout < self._horizon:
            self._horizon = timeout
            self._kick()
        elif deadline < self._wake_at:
            self._kick()

    def _kick(self) -> None:
        with self._cond:
            if self._stopped:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def stop(self, join_timeout: float = 1.0) -> None:
        """Stop the thread; pending deadlines are dropped. Idempotent and bounded."""
        with self._cond:
            self._stopped = True
            self._heap = []
            self._cond.notify()
            thread = self._thread
        if thread is not None and join_timeout and thread is not threading.current_thread():
            thread.join(join_timeout)

    def __len__(self) -> int:
        return len(self._heap)

    def _compact(self) -> None:
        """Drop settled entries (amortised O(1) per ``add``: it runs when the heap
        has doubled over the live count since the last compaction)."""
        with self._cond:
            is_live = self._is_live
            live = [entry for entry in self._heap if is_live(entry[1])]
            heapq.heapify(live)
            self._heap = live
            self._compact_at = 2 * len(live) + 1024

    def _due(self) -> list[int]:
        """Pop the entries that are due; return the live ones. Sets ``_wake_at``."""
        heap, is_live = self._heap, self._is_live
        now = time.monotonic()
        expired = []
        while heap:
            deadline, key = heap[0]
            if not is_live(key):
                heapq.heappop(heap)
            elif deadline <= now:
                heapq.heappop(heap)
                expired.append(key)
            else:
                break
        self._wake_at = heap[0][0] if heap else now + self._horizon
        return expired

    def _run(self) -> None:
        cond = self._cond
        while True:
            with cond:
                if self._stopped:
                    return
                expired = self._due()
                if not expired:
                    delay = self._wake_at - time.monotonic()
                    cond.wait(None if delay == math.inf else max(delay, 0.0))
                    continue
            for key in expired:
                try:
                    self._on_expire(key)
                except Exception as exc:  # the timer must survive a failing handler
                    threading.excepthook(
                        threading.ExceptHookArgs((type(exc), exc, exc.__traceback__, None))
                    )
