"""What every backend shares: the integer-AVG fix-up and the ordered completion
thread. (Their errors are translated in ``_base/foreign.py``, the one boundary.)

Completion discipline (the torch-group backends): an op is an *ordered thing to
wait on* — a torch Work — queued at submit in issue order in a :class:`Completer`,
which reports each outcome to the backend's sink (the communicator's ledger). The
Completer is the queue's :class:`~.._core.completion.Completion`: the op's outcome
is collected by whoever needs it first: the thread that awaits it or asks about it,
when the op has already finished (no thread hop), else the Completer's thread,
which waits on the ops in order. Successes are reported in
batches, and always before a thread blocks again, so a burst of completions costs
each event loop one wake-up.
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import Any, Callable

import torch

from .._base.ops import ReduceOp
from .._core.backend import Completion, Sink, Target


def avg_fixup(
    op: ReduceOp, out: torch.Tensor, world_size: int
) -> tuple[ReduceOp, Callable[[], object] | None]:
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


class Completer(Completion):
    """The ops of one ordered queue, and the thread that waits on them when someone must.

    ``watch(waitable, target, fixup)`` (at submit, in issue order) appends the op to
    a FIFO, attaches this queue to the target's Works, and wakes nobody. An op's
    outcome is collected — ``wait(waitable)``, then ``fixup()`` (if any) on success,
    then ``target`` reported to the sink — by whoever needs it first (the completion
    protocol, ``_core/completion.py``):

    * :meth:`settle_finished` (a Work someone starts waiting on, or asks about; the
      deadline service before it expires an op; an abort): the asking thread settles
      every op at the head of the FIFO that ``is_done`` says has finished (no thread
      hop: when ops finish before they are awaited — small ops, world size 1,
      GradSync's buckets during backward — the thread is never woken);
    * :meth:`watch_unfinished` (the awaited op has not finished): the thread is
      rung: it waits on the head ops in order (``wait`` releases the GIL) until the
      FIFO is empty, reporting successes in batches (at most ``batch``, and always
      before it blocks), so a burst costs each event loop one wake-up;
    * a FIFO that grows past ``backlog`` (ops nobody waits on) rings the thread to
      settle what has finished, so memory and kept tensors stay bounded.

    A failure found on an asking thread is handed to the thread (the abort it
    causes tells the peers and may write files: never on an event loop). With
    ``eager`` every op rings the thread at once and only the thread ever calls
    ``wait``: ops that finish only inside ``wait()`` (Gloo's send and recv) must be
    waited on by someone, and exactly once (``is_completed()`` turns true when the
    thread's wait returns; a second wait() on the same send or recv never returns).
    Started lazily, stopped by :meth:`stop`.
    """

    _STOP = object()
    #: Successes reported together at most (bounds each loop's batch of settles).
    batch = 64
    #: Ops in the FIFO beyond which the thread is rung to settle what has finished.
    backlog = 64

    def __init__(
        self,
        name: str,
        sink: Callable[[], Sink],
        wait: Callable[[Any], object],
        is_done: Callable[[Any], bool],
        on_error: Callable[[BaseException, Target], BaseException],
        *,
        eager: bool = False,
    ) -> None:
        self._name = name
        self._eager = eager
        self._sink = sink
        self._wait = wait
        self._is_done = is_done
        self._on_error = on_error
        # [waitable, target, fixup], in issue order; popped under ``_claim`` only.
        self._fifo: collections.deque[list[Any]] = collections.deque()
        self._claim = threading.Lock()
        # Ops popped by an asking thread whose wait() or fix-up raised: (target, exc).
        self._failed: collections.deque[tuple[Target, BaseException]] = collections.deque()
        # Rings: True = someone waits (wait on the head), False = settle what finished.
        self._bell: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._limit = self.backlog
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._stopped = False

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def watch(
        self,
        waitable: Any,
        target: Target,
        fixup: Callable[[], object] | None = None,
        result: Callable[[], Any] | None = None,
    ) -> None:
        """Queue ``waitable`` for ``target``. ``result``: the target's result, known only
        once the op has finished (a receive from any source: its sender), read after
        ``fixup``; without it, the result known at issue stays."""
        fifo = self._fifo
        fifo.append([waitable, target, fixup, result])
        target.attach(self)
        if self._eager:
            self._ring(True)
        elif len(fifo) >= self._limit:
            self._limit = 2 * len(fifo)
            self._ring(False)

    def hurry(self) -> None:
        """Have the thread wait for the queued ops until the queue is empty (an op held
        back behind them goes when they have finished, and someone must see that)."""
        self._ring(True)

    def refuse(self, target: Target, exc: BaseException) -> None:
        """``target`` failed before it reached this queue (a held op the group refused
        when its turn came): the thread reports it, after what it has settled."""
        self._failed.append((target, exc))
        self._ring(True)

    def settle_finished(self) -> None:
        """Settle, on this thread, the finished ops at the head of the FIFO (the protocol)."""
        if self._eager:
            return  # only its thread waits: a second wait() on a Gloo send/recv blocks for good
        fifo = self._fifo
        if fifo and self._is_done(fifo[0][0]):  # the common "nothing finished yet" costs one call
            self._reap()

    def watch_unfinished(self) -> None:
        """Have the thread wait on the queued ops in order until the FIFO is empty (the protocol)."""
        self._ring(True)

    def _ring(self, urgent: bool) -> None:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None and not self._stopped:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
        self._bell.put(urgent)

    def stop(self, join_timeout: float = 0.0) -> None:
        """Stop after the wait in progress; queued ops are dropped (their Works were
        failed by the ledger's abort, or all are done at close)."""
        with self._start_lock:
            self._stopped = True
            thread = self._thread
        self._bell.put(self._STOP)
        if join_timeout and thread is not None and thread is not threading.current_thread():
            thread.join(join_timeout)

    def _take(self) -> list[list[Any]]:
        """Pop the finished ops at the head, at most ``batch`` (none: empty, the head
        still runs, or a failure is waiting to be reported)."""
        fifo, is_done = self._fifo, self._is_done
        items: list[list[Any]] = []
        with self._claim:
            if self._failed:
                return items
            while fifo and is_done(fifo[0][0]):
                items.append(fifo.popleft())
                if len(items) == self.batch:
                    break
        return items

    def _finish(self, item: list[Any]) -> BaseException | None:
        """Collect a popped op's outcome (its wait returns at once): None on success."""
        try:
            self._wait(item[0])
        except Exception as exc:  # noqa: BLE001 - any failure of the wait fails this op
            return exc
        return self._after(item)

    @staticmethod
    def _after(item: list[Any]) -> BaseException | None:
        """Run a finished op's fix-up and read its late result (into ``item[3]``, boxed)."""
        try:
            if item[2] is not None:
                item[2]()
            if item[3] is not None:
                item[3] = (item[3](),)
        except Exception as exc:  # noqa: BLE001 - a failed fix-up fails this op
            return exc
        return None

    def _succeeded(self, item: list[Any], ready: list[Target]) -> list[Target]:
        """``item`` succeeded: add its target to ``ready``; one with a late result is
        reported at once, with it, after ``ready``. Returns what is still to report."""
        if item[3] is None:
            ready.append(item[1])
            return ready
        if ready:
            self._sink().succeed_all(ready)
        self._sink().succeed(item[1], item[3][0])
        return []

    def _reap(self) -> None:
        """Settle, on the calling thread, the finished ops at the head of the FIFO.

        A failure goes to the thread (after the successes before it); the ops popped
        after it are dropped: the abort it causes fails their Works."""
        while not self._stopped:
            items = self._take()
            if not items:
                return
            ready: list[Target] = []
            for item in items:
                error = self._finish(item)
                if error is not None:
                    self._failed.append((item[1], error))  # the thread reports it, after ``ready``
                    if ready:
                        self._sink().succeed_all(ready)
                    self._ring(True)
                    return
                ready = self._succeeded(item, ready)
            if ready:
                self._sink().succeed_all(ready)

    def _run(self) -> None:
        get, bell = self._bell.get, self._bell
        while True:
            urgent = get()
            if urgent is self._STOP or self._stopped:
                return
            self._drain(bool(urgent))
            # Hold no torch Work here between rings: its destructor retakes the GIL,
            # which aborts the process if it runs on a daemon thread during
            # interpreter shutdown.
            while not bell.empty() and not self._stopped:  # rings that came during the drain
                urgent = bell.get()
                if urgent is self._STOP:
                    return
                self._drain(bool(urgent))

    def _drain(self, urgent: bool) -> None:
        """Settle ops in order; while ``urgent``, wait for unfinished ones, until the FIFO is empty."""
        fifo, claim, wait, is_done, sink = (
            self._fifo,
            self._claim,
            self._wait,
            self._is_done,
            self._sink,
        )
        ready: list[Target] = []
        while not self._stopped:
            if self._failed:
                if ready:
                    sink().succeed_all(ready)
                    ready = []
                target, exc = self._failed.popleft()
                sink().fail(target, self._on_error(exc, target))
                continue
            with claim:
                if not fifo:
                    break
                item = fifo[0]
                done = is_done(item[0])
                if done:
                    fifo.popleft()
            if done:
                error = self._finish(item)
            else:
                if not urgent:
                    urgent = self._rung_meanwhile()
                    if not urgent:
                        break  # nobody waits: a waiter, a ring or the backlog comes back here
                if ready:
                    sink().succeed_all(ready)  # about to block: report what is done first
                    ready = []
                error = None
                try:
                    wait(item[0])  # Gloo's send/recv finish only inside wait()
                except Exception as exc:  # noqa: BLE001 - any failure of the wait fails this op
                    error = exc
                with claim:
                    if not fifo or fifo[0] is not item:
                        continue  # an asking thread settled it meanwhile
                    fifo.popleft()
                if error is None:
                    error = self._after(item)
            if error is not None:
                if ready:
                    sink().succeed_all(ready)
                    ready = []
                sink().fail(item[1], self._on_error(error, item[1]))
            else:
                ready = self._succeeded(item, ready)
                if len(ready) >= self.batch:
                    sink().succeed_all(ready)
                    ready = []
            # The op's torch Work lives on until the next op is done with (outside the
            # lock) or, the last one, until this call returns: after its waiters were
            # woken (its destructor took about 5 us before the wake-up). None outlives
            # this call (see ``_run``).
            spent = item  # noqa: F841 - held, not read
            del item
        if ready:
            sink().succeed_all(ready)
        if not fifo:
            self._limit = self.backlog

    def _rung_meanwhile(self) -> bool:
        """Consume rings that came while draining; True if one asked to wait."""
        bell = self._bell
        urgent = False
        while not bell.empty():
            token = bell.get()
            if token is self._STOP:
                self._stopped = True
                return False
            urgent = urgent or bool(token)
        return urgent
