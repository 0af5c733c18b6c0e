"""What every backend shares: error translation, the integer-AVG fix-up, and the
ordered completion thread.

Completion discipline (every backend): an op is an *ordered thing to wait on* —
a torch Work (``wait()``), a CUDA event (``synchronize()``) — queued at submit in
issue order. One :class:`Completer` thread per queue waits on them in that order
and reports each outcome to the backend's sink (the communicator's ledger).
Successes are reported in batches, and always before the thread blocks again, so
a burst of completions costs each event loop one wake-up while the waiting thread
never holds finished Works back.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import torch

from .._base import shutdown
from .._base.errors import CollectiveTimeout, CommAborted, PeerFailure
from .._base.ops import ReduceOp
from .._core.backend import Sink
from .._core.work import Bundle, Work

Target = Work | Bundle

# torch 2.13 gives no type finer than its message for these, so the kind is read
# from the message, here only: Gloo raises a plain RuntimeError for every transport
# failure (no DistNetworkError subclass); a TCPStore's constructor raises
# DistNetworkError alike for a port in use ("... name: EADDRINUSE, message: address
# already in use"), a connect that times out and a refused connection (measured; no
# errno attribute).
_IN_USE = ("eaddrinuse", "address already in use")
_PEER_LOST = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "socket closed",
    "connection refused",
    "end of file",
)
_TIMED_OUT = ("timed out", "timeout")


def kind_of(exc: BaseException) -> str | None:
    """``"peer"`` (a peer's connection went away), ``"timeout"``, ``"in use"`` (a store
    server's port is taken), or None, for a torch/Gloo error: by type where torch gives
    one, else by its message."""
    low = str(exc).lower()
    if any(s in low for s in _IN_USE):
        return "in use"
    if isinstance(exc, TimeoutError) or any(s in low for s in _TIMED_OUT):
        return "timeout"  # torch's DistNetworkError covers socket timeouts too
    if isinstance(exc, torch.distributed.DistNetworkError) or any(s in low for s in _PEER_LOST):
        return "peer"
    return None


def translate(exc: BaseException, target: Target, backend: str) -> BaseException:
    """A backend error of ``target`` as one of the contract's exceptions (``__cause__``: ``exc``)."""
    if isinstance(exc, (CommAborted, CollectiveTimeout)):
        return exc
    what = f"{target.op} (seq {target.seq})"
    kind = kind_of(exc)
    new: BaseException
    if kind == "peer":
        new = PeerFailure(f"{what}: a peer failed: {exc}")
    elif kind == "timeout":
        new = CollectiveTimeout(f"{what} timed out in {backend}: {exc}", target.seq, target.op)
    else:
        new = CommAborted(f"{what} failed in {backend}: {exc}")
    new.__cause__ = exc
    return new


def avg_fixup(op: ReduceOp, out: torch.Tensor, world_size: int) -> tuple[ReduceOp, Callable[[], object] | None]:
    """How to run ``op`` on a backend without native AVG for ``out``'s dtype.

    Returns the op to run and a fix-up for the result: AVG of integers is a SUM
    then a floor division (as torch does), of complex numbers a SUM then a division.
    Floating-point AVG runs as it is.
    """
    if op is not ReduceOp.AVG or out.is_floating_point():
        return op, None
    if out.is_complex():
        return ReduceOp.SUM, lambda: out.div_(world_size)
    return ReduceOp.SUM, lambda: out.copy_(torch.div(out, world_size, rounding_mode="floor"))


class Completer:
    """One thread that waits on ordered things and reports their outcomes.

    ``watch(waitable, target, fixup)``: after everything queued before it,
    ``wait(waitable)`` is called on this thread; on success ``fixup()`` (if any)
    runs and ``target`` succeeds; on an exception, ``on_error(exc, target)``
    returns the error to fail it with. Started lazily, stopped by :meth:`stop`.
    """

    _STOP = object()
    #: Successes reported together at most (bounds each loop's batch of settles).
    batch = 64

    def __init__(
        self,
        name: str,
        sink: Callable[[], Sink],
        wait: Callable[[Any], object],
        is_done: Callable[[Any], bool],
        on_error: Callable[[BaseException, Target], BaseException],
    ) -> None:
        self._name = name
        self._sink = sink
        self._wait = wait
        self._is_done = is_done
        self._on_error = on_error
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._stopped = False

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def watch(self, waitable: Any, target: Target, fixup: Callable[[], object] | None = None) -> None:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None and not self._stopped:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
        self._queue.put((waitable, target, fixup))

    def stop(self, join_timeout: float = 0.0) -> None:
        """Stop after the wait in progress; queued items are dropped (their Works
        were failed by the ledger's abort, or all are done at close)."""
        with self._start_lock:
            self._stopped = True
            thread = self._thread
        self._queue.put((self._STOP, None, None))
        if join_timeout and thread is not None and thread is not threading.current_thread():
            thread.join(join_timeout)

    def _run(self) -> None:
        get, empty = self._queue.get, self._queue.empty
        wait, is_done, on_error, sink = self._wait, self._is_done, self._on_error, self._sink
        ready: list[Target] = []
        while True:
            waitable, target, fixup = get()
            if waitable is self._STOP:
                return
            if ready and not is_done(waitable):
                sink().succeed_all(ready)  # about to block: report what is done first
                ready = []
            error: BaseException | None = None
            try:
                wait(waitable)
                if fixup is not None:
                    fixup()
            except Exception as exc:  # noqa: BLE001 - any failure of the wait or fix-up fails this op
                error = exc
            if error is not None:
                if ready:
                    sink().succeed_all(ready)
                    ready = []
                sink().fail(target, on_error(error, target))
            else:
                ready.append(target)
                # Reported as soon as nothing else is queued (measured: the cheapest
                # test on the critical path), or when the batch is full.
                if len(ready) >= self.batch or empty():
                    sink().succeed_all(ready)
                    ready = []
            # Drop the torch Work here, after reporting and before the next get(): its
            # destructor retakes the GIL, which aborts the process if it runs on a
            # daemon thread during interpreter shutdown.
            del waitable, target, fixup, error


# ----------------------------------------------------------------- exit guard
# A thread left inside a native wait by an aborted Gloo group (Gloo cannot
# interrupt an op in flight) must not return into Python while the interpreter
# finalizes: CPython then ends it with pthread_exit, whose forced unwind through
# torch's C++ frames aborts the whole process ("terminate called without an
# active exception", SIGABRT; seen here with torch 2.13 on Ctrl-C). If such a
# thread is still alive at exit, the process leaves with os._exit instead
# (``_base/shutdown.py``).
def strand(thread: threading.Thread | None) -> None:
    """``thread`` may stay blocked in native code after an abort (see above)."""
    shutdown.native(thread)
