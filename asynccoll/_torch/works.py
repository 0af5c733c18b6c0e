"""The c10d ``Work`` of an operation issued through the process group.

:class:`C10dWork` is a ``torch.distributed.Work`` subclass over one or more of the
communicator's Works (a c10d call on lists of tensors may be several of ours). It
behaves as c10d's: ``wait()`` blocks (from any thread) and raises the op's error,
``is_completed()``/``is_success()``/``exception()`` never block, ``result()`` is the
output tensors, ``get_future()`` is a ``torch.futures.Future`` completed from the
communicator's completion path. Errors are the contract's, as c10d users catch them
(:func:`~.errors.as_c10d`).

A c10d op whose output is a list of tensors runs on one flat buffer; its ``finish``
copies the buffer out, once, before anyone sees the op complete.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Executor
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .._core.wakeups import trio_token
from .._core.work import Work
from .errors import as_c10d

_running_loop = asyncio._get_running_loop


def _unwrap(parent: torch.futures.Future[Any]) -> Any:
    """The child future's value, or its error: a future that torch's C++ side (DDP's
    reducer) sees failed, not completed with an exception as its value (which is all
    that ``Future.set_exception`` does, torch 2.13: it sets a value and a Python unwrap)."""
    ok, value = parent.value()
    if ok:
        return value
    raise as_c10d(value)  # a fresh copy: torch keeps only its text


class C10dWork(dist.Work):
    """A c10d Work over the communicator's Works ``works`` (issue order)."""

    def __init__(
        self,
        works: Sequence[Work],
        result: list[Any],
        finish: Callable[[], None] | None = None,
        relay: Callable[[], Executor] | None = None,
    ) -> None:
        super().__init__()
        self._works = works
        self._result = result
        self._finish = finish
        self._relay = relay
        self._lock = threading.Lock()
        self._cause: BaseException | None = None  # the first failed Work's own error
        self._error: BaseException | None = None  # ... as c10d users catch it
        self._future: torch.futures.Future[Any] | None = None
        self._parent: torch.futures.Future[Any] | None = None

    @property
    def handed_out(self) -> bool:
        """Whether someone asked for the future (a C++ caller such as DDP's reducer waits on it)."""
        return self._future is not None

    # ---------------------------------------------------------------- outcome
    def _outcome(self) -> bool:
        """True once every Work settled (running ``finish`` once, on success); never blocks."""
        for work in self._works:
            if not work.done():
                return False
        if self._error is None and (self._finish is not None):
            self._finished()
        return True

    def _failure(self) -> BaseException | None:
        """The first failed Work's error, as c10d users catch it (settled Works only)."""
        if self._error is None:
            for work in self._works:
                if work.done():
                    exc = work.exception()
                    if exc is not None:
                        self._cause = exc
                        self._error = as_c10d(exc)
                        break
        return self._error

    def _raise(self) -> None:
        """Raise the failure as a fresh copy: one raised through the caller's frames
        would keep them (and the model in them) alive from this Work, which DDP's
        reducer holds, through its traceback."""
        if self._failure() is not None:
            assert self._cause is not None
            raise as_c10d(self._cause)

    def _finished(self) -> None:
        with self._lock:
            finish, self._finish = self._finish, None
        if finish is not None and self._failure() is None:
            finish()

    # ------------------------------------------------------------------ c10d
    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until the op completes; raise its error. ``timeout`` (a ``timedelta`` or
        seconds; zero or None: no limit) expires with the builtin ``TimeoutError`` and
        leaves the op running."""
        limit = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        for work in self._works:
            try:
                work.wait(limit or None)
            except Exception as exc:  # noqa: BLE001 - the op's failure is raised below, typed for c10d
                # Our frames leave the shared error: a traceback keeps each frame's callers
                # alive (here a backward's, and the model in it; DDP's reducer holds this Work).
                exc.__traceback__ = None
                if not work.done():  # the wait's own limit (builtin TimeoutError), not the op's
                    raise TimeoutError(f"{self!r} not done after {limit} s") from exc
                break
        self._raise()
        if self._finish is not None:
            self._finished()
        return True

    def is_completed(self) -> bool:
        return self._outcome()

    def is_success(self) -> bool:
        return self._outcome() and self._failure() is None

    def exception(self) -> BaseException | None:
        return self._failure() if self._outcome() else None

    def result(self) -> list[Any]:
        return self._result

    def get_future(self) -> torch.futures.Future[Any]:
        """A future of ``result()``, completed (or failed) from the completion path.

        On a thread that runs an event loop the callback is registered from the
        relay thread, so that it runs where the op settles, not on a loop that may be
        blocked waiting for this very future."""
        with self._lock:
            if self._future is not None:
                return self._future
            self._parent = torch.futures.Future()
            self._future = future = self._parent.then(_unwrap)
        last = self._works[-1]
        if self._relay is not None and (_running_loop() is not None or trio_token() is not None):
            self._relay().submit(last.add_done_callback, self._complete)
        else:
            last.add_done_callback(self._complete)
        return future

    def _complete(self, _last: Work) -> None:
        """Every Work settled (they settle in issue order): complete the future."""
        parent = self._parent
        assert parent is not None
        for work in self._works[:-1]:
            if not work.done():  # an earlier one still running: the next settling completes
                work.add_done_callback(self._complete)
                return
        error = self._failure()
        if error is None:
            self._finished()
            parent.set_result((True, self._result))
        else:
            parent.set_result((False, self._cause))

    def __repr__(self) -> str:
        return f"<asynccoll C10dWork {', '.join(repr(w) for w in self._works)}>"


class RecvAnyWork(C10dWork):
    """A receive from any source (``dist.recv(t)`` without ``src``): its sender is the
    communicator's Work result, which ``_source_rank()`` reports as c10d's does."""

    def _source_rank(self) -> int:
        """The sender's rank in the group, once received (waits; raises the op's error)."""
        self.wait()
        return int(self._works[0].result())

    source_rank = _source_rank
