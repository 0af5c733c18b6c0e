"""Batched cross-thread wake-ups of one asyncio (or uvloop) event loop."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from typing import Any, Callable

__all__ = ["LoopWaker", "loop_waker"]


class LoopWaker:
    """Runs callables on one event loop, posted from any thread, in FIFO order, in batches.

    :meth:`post` appends ``(fn, args)`` to a queue and schedules :meth:`_drain` with
    ``loop.call_soon_threadsafe`` only when no drain is already scheduled, so a burst of 1000
    posts from a worker thread costs about one self-pipe write and one loop iteration instead
    of 1000. :meth:`_drain` runs on the loop and calls every queued callable in the order
    they were posted. Posting from the loop thread itself works too (it uses ``call_soon``).

    Works with any :class:`asyncio.AbstractEventLoop` that implements ``call_soon_threadsafe``
    (asyncio, uvloop). Nothing here needs CUDA. Use :func:`loop_waker` to share one waker per
    loop.
    """

    #: Upper bound on callables run by one drain before yielding to other loop callbacks
    #: (timers and other tasks run between batches; this bounds the loop lag a burst causes).
    max_batch = 256

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        """Create a waker for ``loop``."""
        self._loop = loop
        self._queue: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._lock = threading.Lock()
        # Invariant: True from the moment a drain is scheduled until a drain finds the queue
        # empty (under the lock), so every posted item is run by some scheduled drain.
        self._scheduled = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop this waker wakes."""
        return self._loop

    def post(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Arrange for ``fn(*args)`` to run on the loop; callable from any thread.

        Returns:
            True if queued; False if the loop is closed (then ``fn`` never runs).
        """
        if self._loop.is_closed():
            return False
        with self._lock:
            self._queue.append((fn, args))
            if self._scheduled:
                return True
            self._scheduled = True
        try:
            if _running_loop() is self._loop:
                self._loop.call_soon(self._drain)
            else:
                self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # closed between the check and the call
            with self._lock:
                self._queue.clear()
                self._scheduled = False
            return False
        return True

    def pending(self) -> int:
        """Number of posted callables not run yet."""
        return len(self._queue)

    def _drain(self) -> None:
        """Run the queued callables in FIFO order (on the loop thread)."""
        with self._lock:
            n = min(len(self._queue), self.max_batch)
            batch = [self._queue.popleft() for _ in range(n)]
        for fn, args in batch:
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - a callable's failure must not drop the rest
                self._loop.call_exception_handler(
                    {"message": f"exception in LoopWaker callback {fn!r}", "exception": exc}
                )
        with self._lock:
            if not self._queue:
                self._scheduled = False
                return
        # More arrived meanwhile (or the batch was capped): let other callbacks run first.
        self._loop.call_soon(self._drain)

    def __repr__(self) -> str:
        return f"LoopWaker(loop={self._loop!r}, pending={len(self._queue)})"


def _running_loop() -> asyncio.AbstractEventLoop | None:
    return asyncio._get_running_loop()


# One waker per loop, created on first use; entries vanish with their loops.
_wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWaker] = (
    weakref.WeakKeyDictionary()
)
_wakers_lock = threading.Lock()


def loop_waker(loop: asyncio.AbstractEventLoop | None = None) -> LoopWaker:
    """Return the shared :class:`LoopWaker` of ``loop`` (default: the running loop).

    Raises:
        RuntimeError: ``loop`` is None and no loop is running in this thread.
    """
    if loop is None:
        loop = asyncio.get_running_loop()
    waker = _wakers.get(loop)
    if waker is None:
        with _wakers_lock:
            waker = _wakers.get(loop)
            if waker is None:
                waker = LoopWaker(loop)
                _wakers[loop] = waker
    return waker
