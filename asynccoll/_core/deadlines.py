"""One timer thread per communicator that enforces every operation's deadline.

Deadlines live in a heap with lazy deletion: settling a Work only drops its entry
from a dict (O(1)); the heap is compacted when stale entries dominate, so a high
rate of short operations does not grow memory. The thread sleeps on a condition
until the earliest deadline, and is woken only when a new earliest one arrives.
"""

from __future__ import annotations

import heapq
import threading
import time
from typing import Callable


class DeadlineTimer:
    """Calls ``on_expire(key)`` from its own thread when a registered deadline passes."""

    def __init__(self, on_expire: Callable[[int], None], name: str = "asynccoll-deadlines") -> None:
        self._on_expire = on_expire
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, float] = {}
        self._thread: threading.Thread | None = None
        self._stopped = False

    def add(self, key: int, deadline: float) -> None:
        """Register ``key`` to expire at ``deadline`` (``time.monotonic()`` seconds)."""
        with self._cond:
            if self._stopped:
                return
            self._live[key] = deadline
            heap = self._heap
            earliest = not heap or deadline < heap[0][0]
            heapq.heappush(heap, (deadline, key))
            if len(heap) > 2 * len(self._live) + 64:
                self._compact()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            elif earliest:
                self._cond.notify()

    def remove(self, key: int) -> None:
        """Forget ``key`` (its Work settled). Never blocks on the timer thread."""
        self._live.pop(key, None)

    def stop(self, join_timeout: float = 1.0) -> None:
        """Stop the thread; pending deadlines are dropped. Idempotent and bounded."""
        with self._cond:
            self._stopped = True
            self._live.clear()
            self._heap.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_timeout)

    def __len__(self) -> int:
        return len(self._live)

    def _compact(self) -> None:
        self._heap = [(d, k) for k, d in self._live.items()]
        heapq.heapify(self._heap)

    def _run(self) -> None:
        cond = self._cond
        while True:
            expired: list[int] = []
            with cond:
                while not self._stopped:
                    heap = self._heap
                    while heap and self._live.get(heap[0][1]) != heap[0][0]:
                        heapq.heappop(heap)  # settled, or re-registered later
                    if not heap:
                        cond.wait()
                        continue
                    delay = heap[0][0] - time.monotonic()
                    if delay > 0:
                        cond.wait(delay)
                        continue
                    now = time.monotonic()
                    while heap and heap[0][0] <= now:
                        _, key = heapq.heappop(heap)
                        if self._live.pop(key, None) is not None:
                            expired.append(key)
                    break
                if self._stopped:
                    return
            for key in expired:
                try:
                    self._on_expire(key)
                except Exception as exc:  # the timer must survive a failing handler
                    threading.excepthook(
                        threading.ExceptHookArgs((type(exc), exc, exc.__traceback__, None))
                    )
