"""Backend over a torch ``ProcessGroup`` object: Gloo, or any group given to ``wrap()``.

Completion reaches asynccoll without a thread per op: one waiter thread per
backend waits on collectives in issue order (Gloo runs them in that order), a
second one on point-to-point ops, and each outcome is handed to the Work, which
wakes its event loop through a batched waker.
"""

from __future__ import annotations

import collections
import queue
import threading
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from .._core.backend import Backend
from .._core.errors import CollectiveTimeout, CommAborted, InvalidArgument, PeerFailure
from .._core.ops import OpKind, OpSpec, ReduceOp
from .._core.work import Work

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PROD: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.AVG: dist.ReduceOp.AVG,
}
_PEER_LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket closed",
    "connection refused",
    "end of file",
)
_TIMED_OUT = ("timed out", "timeout")


def translate(exc: BaseException, work: Work) -> BaseException:
    """Map a torch/Gloo error of ``work`` into the contract's exceptions."""
    if isinstance(exc, (CommAborted, CollectiveTimeout)):
        return exc
    text = str(exc)
    low = text.lower()
    new: BaseException
    if any(s in low for s in _PEER_LOST):
        new = PeerFailure(f"{work.op} (seq {work.seq}): a peer failed: {text}")
    elif any(s in low for s in _TIMED_OUT):
        new = CollectiveTimeout(f"{work.op} (seq {work.seq}) timed out in the backend: {text}", work.seq, work.op)
    else:
        new = CommAborted(f"{work.op} (seq {work.seq}) failed in the backend: {text}")
    new.__cause__ = exc
    return new


class _Waiter:
    """One thread that waits on torch works in issue order and reports each outcome.

    Measured here, a thread blocked in ``work.wait()`` wakes the event loop faster
    than a future done-callback (which must take the GIL inside Gloo's worker
    thread). Successes of Works issued from an event loop are not settled here:
    they are handed to that loop in batches (``_BATCH`` at most), and handed over
    before this thread blocks. Settling them here would keep the GIL on this
    thread through a burst of completions while the loop waits for it: the
    interpreter's 5 ms switch interval then shows up as event-loop lag.
    """

    _STOP = object()
    _BATCH = 64

    def __init__(self, name: str, finish: Callable[[Work, BaseException | None, Any], Any]) -> None:
        self._name = name
        # finish(work, error, fixup) -> the Work's loop waker when its success is
        # to be settled on that loop, else None (settled or failed already).
        self._finish = finish
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def watch(self, torch_work: Any, work: Work, fixup: Any) -> None:
        """Wait for ``torch_work`` after those before it, then ``finish(work, exc, fixup)``."""
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
        self._queue.put((torch_work, work, fixup))

    def stop(self, join_timeout: float = 0.0) -> None:
        """Stop after the op being waited on; queued outcomes are dropped."""
        self._queue.put((self._STOP, None, None))
        thread = self._thread
        if join_timeout and thread is not None and thread is not threading.current_thread():
            thread.join(join_timeout)

    def _run(self) -> None:
        get, get_nowait, finish = self._queue.get, self._queue.get_nowait, self._finish
        backlog: collections.deque[Any] = collections.deque()
        ready: dict[Any, list[Work]] = {}
        count = 0
        while True:
            if backlog:
                torch_work, work, fixup = backlog.popleft()
            else:
                if ready:
                    _hand_over(ready)
                    count = 0
                torch_work, work, fixup = get()
            if torch_work is self._STOP:
                return
            if ready and not torch_work.is_completed():
                _hand_over(ready)  # about to block: deliver what is done first
                count = 0
            error: BaseException | None = None
            try:
                torch_work.wait()
            except Exception as exc:
                error = exc
            # Drop the torch Work now: its destructor releases and retakes the GIL,
            # which aborts the process if it happens on a daemon thread during
            # interpreter shutdown (so never leave it to the next get()).
            del torch_work
            waker = finish(work, error, fixup)
            if waker is not None:
                ready.setdefault(waker, []).append(work)
                count += 1
                if count >= self._BATCH:
                    _hand_over(ready)
                    count = 0
            del work, fixup, error
            while True:  # take what was queued meanwhile, without blocking
                try:
                    backlog.append(get_nowait())
                except queue.Empty:
                    break


def _hand_over(ready: dict[Any, list[Work]]) -> None:
    """Post each loop's finished Works to it in one call (settled there), then clear."""
    for waker, works in ready.items():
        if not waker.post(_settle_all, works):
            _settle_all(works)  # the loop is closed: settle here
    ready.clear()


def _settle_all(works: list[Work]) -> None:
    for work in works:
        work._set_result()


class TorchGroupBackend(Backend):
    """Runs OpSpecs on a torch ProcessGroup (Gloo built by asynccoll, or a wrapped one)."""

    def __init__(
        self,
        pg: Any,
        *,
        name: str,
        device_type: str | None,
        world_size: int,
        timeout: float,
    ) -> None:
        self.name = name
        self.device_type = device_type
        self._pg = pg
        self._world_size = world_size
        self._timeout = timeout
        # Collectives complete in issue order; p2p ops may not, so they get their
        # own waiter and a slow recv does not hold back collective completions.
        self._waiter = _Waiter(f"asynccoll-{name}-waiter", self._finish)
        self._p2p_waiter = _Waiter(f"asynccoll-{name}-p2p-waiter", self._finish)
        self._aborted = False
        #: Set by the communicator: names the ranks that failed (heartbeat census).
        self.census: Callable[[], tuple[int, ...]] | None = None
        self._opts_cache: dict[tuple[Any, ...], Any] = {}
        self._sum_opts = c10d.AllreduceOptions()  # the hot path: all_reduce SUM
        self._sum_opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]

    # -- helpers ---------------------------------------------------------
    def _opts(self, cls: Any, spec: OpSpec, **fields: Any) -> Any:
        """An options object; cached, since ops with the same fields reuse one."""
        key = (cls, spec.timeout if spec.timeout > self._timeout else None, *fields.items())
        opts = self._opts_cache.get(key)
        if opts is None:
            opts = cls()
            for k, v in fields.items():
                setattr(opts, k, v)
            if spec.timeout > self._timeout:
                opts.timeout = timedelta(seconds=spec.timeout + 5.0)
            if len(self._opts_cache) < 256:
                self._opts_cache[key] = opts
        return opts

    def _reduce(
        self, spec: OpSpec, tensor: torch.Tensor, result: torch.Tensor | None = None
    ) -> tuple[Any, Callable[[], object] | None]:
        """The torch reduce op for ``spec``, and a fix-up to run on ``result`` (default:
        ``tensor``) on success: AVG of non-float dtypes is a SUM, then a division."""
        op = spec.reduce_op
        if op is not ReduceOp.AVG or tensor.is_floating_point():
            return _TORCH_OPS[op], None
        out = tensor if result is None else result
        ws = self._world_size
        if out.is_complex():
            return dist.ReduceOp.SUM, lambda: out.div_(ws)
        return dist.ReduceOp.SUM, lambda: out.copy_(torch.div(out, ws, rounding_mode="floor"))

    def _complete(self, work: Work, torch_work: Any, fixup: Callable[[], object] | None, p2p: bool) -> None:
        waiter = self._p2p_waiter if p2p else self._waiter
        waiter.watch(torch_work, work, fixup)

    def _finish(self, work: Work, exc: BaseException | None, fixup: Callable[[], object] | None) -> Any:
        """Outcome of ``work`` (waiter thread). Returns its loop's waker when the
        success is to be settled there, else None."""
        if self._aborted:
            # Gloo may report force-completed works as successes after an abort.
            return None
        if exc is not None:
            err = translate(exc, work)
            census = self.census
            if isinstance(err, PeerFailure) and not err.ranks and census is not None:
                err.ranks = census()  # Gloo does not say which peer it lost
                if err.ranks:
                    err.args = (f"{err.args[0]} [failed rank(s): {list(err.ranks)}]",)
            work._set_exception(err)
            return None
        if fixup is not None:
            try:
                fixup()
            except Exception as err:
                work._set_exception(translate(err, work))
                return None
        # A success is settled on the Work's own event loop, in batches (see
        # _Waiter). Failures settle here: naming a dead peer may block.
        waker = work._waker
        if waker is None:
            work._set_result()
        return waker

    # -- Backend -----------------------------------------------------------
    def submit(self, spec: OpSpec, work: Work) -> None:
        pg, kind, t = self._pg, spec.kind, spec.tensor
        if kind is OpKind.ALL_REDUCE and spec.reduce_op is ReduceOp.SUM and spec.timeout <= self._timeout:
            try:  # the most common op, without the general dispatch below
                tw = pg.allreduce([t], self._sum_opts)
            except (RuntimeError, TypeError, ValueError) as exc:
                raise InvalidArgument(f"all_reduce: {self.name} rejected the arguments: {exc}") from exc
            self._waiter.watch(tw, work, None)
            return
        fixup = None
        try:
            if kind is OpKind.ALL_REDUCE:
                op, fixup = self._reduce(spec, t)
                tw = pg.allreduce([t], self._opts(c10d.AllreduceOptions, spec, reduceOp=op))
            elif kind is OpKind.BROADCAST:
                tw = pg.broadcast([t], self._opts(c10d.BroadcastOptions, spec, rootRank=spec.peer))
            elif kind is OpKind.REDUCE:
                op, fixup = self._reduce(spec, t)
                if spec.peer != pg.rank():
                    fixup = None
                tw = pg.reduce([t], self._opts(c10d.ReduceOptions, spec, reduceOp=op, rootRank=spec.peer))
            elif kind is OpKind.ALL_GATHER:
                tw = pg._allgather_base(spec.output, t, self._opts(c10d.AllgatherOptions, spec))
            elif kind is OpKind.REDUCE_SCATTER:
                op, fixup = self._reduce(spec, t, spec.output)
                tw = pg._reduce_scatter_base(spec.output, t, self._opts(c10d.ReduceScatterOptions, spec, reduceOp=op))
            elif kind is OpKind.ALL_TO_ALL:
                tw = pg.alltoall_base(spec.output, t, [], [], self._opts(c10d.AllToAllOptions, spec))
            elif kind is OpKind.GATHER:
                outs = [list(spec.output.chunk(self._world_size))] if spec.output is not None else []
                tw = pg.gather(outs, [t], self._opts(c10d.GatherOptions, spec, rootRank=spec.peer))
            elif kind is OpKind.SCATTER:
                ins = [list(t.chunk(self._world_size))] if t is not None else []
                tw = pg.scatter([spec.output], ins, self._opts(c10d.ScatterOptions, spec, rootRank=spec.peer))
            elif kind is OpKind.SEND:
                tw = pg.send([t], spec.peer, 0)
            elif kind is OpKind.RECV:
                tw = pg.recv([t], spec.peer, 0)
            elif kind is OpKind.BARRIER:
                tw = pg.barrier(self._opts(c10d.BarrierOptions, spec))
            else:  # pragma: no cover - OpKind is closed
                raise InvalidArgument(f"unsupported op {kind}")
        except (RuntimeError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"{kind.value}: {self.name} rejected the arguments: {exc}") from exc
        self._complete(work, tw, fixup, kind is OpKind.SEND or kind is OpKind.RECV)

    def submit_batch(self, specs: Sequence[OpSpec], works: Sequence[Work]) -> None:
        """A coalesced batch: one flattened collective per (kind, dtype, op), see ``flatten``."""
        from . import flatten

        flatten.submit_batch(self, specs, works, self._pg.rank(), self._world_size)

    def abort(self) -> None:
        self._aborted = True
        self._waiter.stop()
        self._p2p_waiter.stop()
        try:
            self._pg.abort()
        except Exception:
            pass

    def close(self) -> None:
        # After an abort the waiters may sit in an op Gloo never finishes: no join.
        join = 0.0 if self._aborted else 2.0
        self._waiter.stop(join_timeout=join)
        self._p2p_waiter.stop(join_timeout=join)
        pg, self._pg = self._pg, None
        if pg is None:
            return
        if self._aborted:
            # Gloo's destructor joins its worker threads, which may be stuck in an
            # op until Gloo's own timeout: let the last reference go on a thread of
            # its own, never here.
            threading.Thread(target=_release, args=([pg],), daemon=True, name="asynccoll-reaper").start()
            del pg
        # Otherwise the last reference goes here, on the executor thread. No
        # pg.shutdown(): measured here, it makes ~1 in 3 processes abort at exit
        # ("terminate called without an active exception").


def _release(box: list[Any]) -> None:
    box.clear()  # drops the only reference, on this thread
