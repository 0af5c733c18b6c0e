"""Communicator: the public async API, ordering, and the ok/aborted/closed state machine."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import weakref
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping

import torch

from . import validate
from .backend import Backend
from .deadlines import DeadlineTimer
from .diagnostics import Diagnostics
from .diagnostics import now as _now
from .errors import (
    AsyncCollError,
    CollectiveTimeout,
    CommAborted,
    CommClosed,
    InvalidArgument,
    PeerFailure,
)
from .faults import Liveness
from .objects import ObjectChannel, dumps
from .ops import OpKind, OpSpec, ReduceOp
from .work import _FAILED, Waker, Work

if TYPE_CHECKING:
    from .coalescing import Batch, CoalescingGroup

_OK, _ABORTED, _CLOSED = "ok", "aborted", "closed"
_OP_NAMES = {kind: kind.value for kind in OpKind}  # enum .value is slow on the hot path


def _fresh_abort_error(error: BaseException) -> CommAborted:
    """A new exception for one Work, like the communicator's abort error."""
    exc: CommAborted
    if isinstance(error, PeerFailure):
        exc = PeerFailure(str(error), error.ranks)
        exc.__cause__ = error.__cause__
    elif isinstance(error, CommAborted):
        exc = CommAborted(str(error))
        exc.__cause__ = error.__cause__
    else:
        exc = CommAborted(f"communicator aborted: {error}")
        exc.__cause__ = error
    return exc


def _weak(method: Callable[[Any], None]) -> Callable[[Any], None]:
    """``method`` called through a weak reference to its object (for background threads)."""
    ref = weakref.WeakMethod(method)

    def call(arg: Any) -> None:
        fn = ref()
        if fn is not None:
            fn(arg)

    return call


class Communicator:
    """A group of ranks running collectives; every collective returns an awaitable Work.

    Create one with ``await asynccoll.init(...)`` or ``asynccoll.wrap(group)``.
    Collectives are plain methods: they validate, issue at once in call order, and
    return a :class:`Work`. Calling order must match on every rank.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        backends: Mapping[str | None, Backend],
        backend_name: str,
        device: torch.device,
        store: Any = None,
        timeout: float = 60.0,
        waker_factory: Callable[[asyncio.AbstractEventLoop], Waker] | None = None,
        heartbeat: float | None = None,
        detect_failures: bool = False,
        rebuild: Callable[[int, int, str], Awaitable[Communicator]] | None = None,
        diagnostics: Diagnostics | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend_name
        self.device = device
        self.timeout = timeout
        self._backends = dict(backends)
        self._cpu_backend = self._backends.get("cpu") or self._backends.get(None)
        self._cuda_backend = self._backends.get("cuda") or self._backends.get(None)
        self._store = store
        self._objects = ObjectChannel(store, rank, world_size) if store is not None else None
        self._waker_factory = waker_factory
        self._wakers: dict[asyncio.AbstractEventLoop, Waker] = {}
        self._rebuild = rebuild
        self._shrunk = False
        # _lock orders issue against abort/close: an op is either in _pending
        # before abort takes its snapshot, or sees the new state and raises.
        self._lock = threading.Lock()
        self._state = _OK
        self._closing = False
        self._error: BaseException | None = None
        self._seq = 0
        self._pending: dict[int, Work] = {}
        pending = self._pending
        self._deadlines = DeadlineTimer(
            _weak(self._expired),  # the timer thread must not keep us alive
            is_live=pending.__contains__,
            name=f"asynccoll-deadlines-r{rank}",
        )
        self._liveness: Liveness | None = None
        if heartbeat and store is not None and world_size > 1:
            self._liveness = Liveness(
                store, rank, world_size, interval=heartbeat, detect=detect_failures,
                on_failure=_weak(self._abort),
            )
            for backend in self._backends.values():
                if hasattr(backend, "census"):
                    backend.census = self._liveness.census
            self._liveness.start()
        self._batch_var: contextvars.ContextVar[Batch | None] = contextvars.ContextVar(
            "asynccoll_batch", default=None
        )
        # DIAG hook: flight recorder (always), fingerprint check and trace files.
        self._diag = diagnostics or Diagnostics(rank=rank, world_size=world_size, backend=backend_name)
        self._recorder = self._diag.recorder

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> str:
        """``"ok"``, ``"aborted"`` or ``"closed"``."""
        return self._state

    @property
    def error(self) -> BaseException | None:
        """The exception that aborted the communicator, or None."""
        return self._error

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        """Ranks known to have failed (from errors and heartbeats); ``shrink()``'s default."""
        ranks = set(self._liveness.dead) if self._liveness is not None else set()
        if isinstance(self._error, PeerFailure):
            ranks.update(self._error.ranks)
        return tuple(sorted(ranks))

    @property
    def pending(self) -> int:
        """Number of issued operations not yet settled."""
        return len(self._pending)

    def _unusable(self) -> AsyncCollError:
        if self._state == _ABORTED:
            exc = CommAborted(f"communicator is aborted: {self._error}")
            exc.__cause__ = self._error
            return exc
        return CommClosed("communicator is closed")

    def __repr__(self) -> str:
        return (
            f"<asynccoll.Communicator rank={self.rank}/{self.world_size} "
            f"backend={self.backend} state={self._state}>"
        )

    # ------------------------------------------------------------------ issue
    def _backend_for(self, tensor: torch.Tensor) -> Backend:
        if tensor.is_cpu:
            backend = self._cpu_backend
        elif tensor.is_cuda:
            backend = self._cuda_backend
        else:
            backend = self._backends.get(tensor.device.type) or self._backends.get(None)
        if backend is None:
            raise InvalidArgument(
                f"tensor on {tensor.device} cannot be used with backend {self.backend!r} "
                f"(it serves: {', '.join(str(k) for k in self._backends)})"
            )
        return backend

    def _waker(self, loop: asyncio.AbstractEventLoop | None) -> Waker | None:
        if loop is None or self._waker_factory is None:
            return None
        waker = self._wakers.get(loop)
        if waker is None:
            for old in [lp for lp in self._wakers if lp.is_closed()]:
                del self._wakers[old]
            waker = self._wakers[loop] = self._waker_factory(loop)
        return waker

    def _new_work(self, op: str, value: Any, keep: Any) -> Work:
        """Allocate the next seq and a pending Work. Caller holds ``_lock``."""
        if self._state != _OK or self._closing:
            raise self._unusable()
        loop = asyncio._get_running_loop()
        seq = self._seq = self._seq + 1
        work = Work(op, seq, value, keep, loop, self._waker(loop), self._settled)
        self._pending[seq] = work
        return work

    def _issue(
        self, backend: Backend, spec: OpSpec, value: Any, keep: Any, timeout: float | None
    ) -> Work:
        spec.timeout = self.timeout if timeout is None else validate.timeout(timeout, self.timeout)
        with self._lock:
            work = self._new_work(_OP_NAMES[spec.kind], value, keep)
            batch = self._batch_var.get()
            if batch is not None and batch.add(backend, spec, work):
                self._recorder.issued(work.seq, work.op, spec, _now(), batch.works[0].seq)  # DIAG hook
                return work  # issued, with its deadline, when the batch exits
            self._recorder.issued(work.seq, work.op, spec, _now())  # DIAG hook
            try:
                backend.submit(spec, work)
            except BaseException:
                self._unissue(work)
                raise
            # After submit: a refused op gives its seq back, and a stale entry must
            # not apply to the next op that takes it.
            self._deadlines.add(work.seq, spec.timeout)
        return work

    def _unissue(self, work: Work) -> None:
        """Undo ``_new_work`` for an op the backend refused synchronously."""
        work._on_settle = None
        self._pending.pop(work.seq, None)
        self._recorder.discard(work.seq)  # DIAG hook
        if self._seq == work.seq:
            self._seq -= 1

    def _settled(self, work: Work) -> None:
        self._pending.pop(work.seq, None)  # its deadline entry goes stale (lazy deletion)
        self._diag.ended(work)  # DIAG hook
        if work._state == _FAILED and self._state == _OK:  # failed: the transport is suspect
            self._abort(work._value)

    def _expired(self, seq: int) -> None:
        work = self._pending.get(seq)
        if work is not None:
            work._set_exception(
                CollectiveTimeout(
                    f"{work.op} (seq {seq}) on rank {self.rank} did not complete within its deadline",
                    seq=seq, op=work.op,
                )
            )

    # ------------------------------------------------------------ collectives
    def all_reduce(
        self, tensor: Any, op: ReduceOp = ReduceOp.SUM, *, timeout: float | None = None
    ) -> Work:
        """Reduce ``tensor`` across ranks, in place. Work result: ``tensor``."""
        t = validate.tensor(tensor, "tensor")
        spec = OpSpec(OpKind.ALL_REDUCE, t, reduce_op=validate.reduce_op(op, t.dtype))
        return self._issue(self._backend_for(t), spec, t, t, timeout)

    def broadcast(self, tensor: Any, src: int, *, timeout: float | None = None) -> Work:
        """Copy ``tensor`` from ``src`` to every rank, in place."""
        t = validate.tensor(tensor, "tensor")
        spec = OpSpec(OpKind.BROADCAST, t, peer=validate.rank(src, self.world_size, "src"))
        return self._issue(self._backend_for(t), spec, t, t, timeout)

    def reduce(
        self, tensor: Any, dst: int, op: ReduceOp = ReduceOp.SUM, *, timeout: float | None = None
    ) -> Work:
        """Reduce ``tensor`` into rank ``dst`` (in place there; other ranks' buffers are scratch)."""
        t = validate.tensor(tensor, "tensor")
        spec = OpSpec(
            OpKind.REDUCE, t, reduce_op=validate.reduce_op(op, t.dtype),
            peer=validate.rank(dst, self.world_size, "dst"),
        )
        return self._issue(self._backend_for(t), spec, t, t, timeout)

    def all_gather(self, output: Any, input: Any, *, timeout: float | None = None) -> Work:
        """Concatenate every rank's ``input`` on dim 0 into ``output``."""
        out, inp = validate.tensor(output, "output"), validate.tensor(input, "input")
        validate.stacked(out, inp, self.world_size, "all_gather output")
        spec = OpSpec(OpKind.ALL_GATHER, inp, out)
        return self._issue(self._backend_for(inp), spec, out, (out, inp), timeout)

    def reduce_scatter(
        self, output: Any, input: Any, op: ReduceOp = ReduceOp.SUM, *, timeout: float | None = None
    ) -> Work:
        """Reduce ``input`` (world_size chunks on dim 0) and keep this rank's chunk in ``output``."""
        out, inp = validate.tensor(output, "output"), validate.tensor(input, "input")
        validate.stacked(inp, out, self.world_size, "reduce_scatter input")
        spec = OpSpec(OpKind.REDUCE_SCATTER, inp, out, reduce_op=validate.reduce_op(op, inp.dtype))
        return self._issue(self._backend_for(inp), spec, out, (out, inp), timeout)

    def all_to_all(self, output: Any, input: Any, *, timeout: float | None = None) -> Work:
        """Send chunk ``i`` of ``input`` (dim 0) to rank ``i``; receive into ``output``."""
        out, inp = validate.tensor(output, "output"), validate.tensor(input, "input")
        validate.splittable(out, inp, self.world_size, "all_to_all")
        spec = OpSpec(OpKind.ALL_TO_ALL, inp, out)
        return self._issue(self._backend_for(inp), spec, out, (out, inp), timeout)

    def gather(
        self, input: Any, dst: int, output: Any = None, *, timeout: float | None = None
    ) -> Work:
        """Concatenate every rank's ``input`` on dim 0 into ``output`` on ``dst`` (result elsewhere: None)."""
        inp = validate.tensor(input, "input")
        dst = validate.rank(dst, self.world_size, "dst")
        out = None
        if self.rank == dst:
            if output is None:
                raise InvalidArgument("gather: output is required on the dst rank")
            out = validate.tensor(output, "output")
            validate.stacked(out, inp, self.world_size, "gather output")
        spec = OpSpec(OpKind.GATHER, inp, out, peer=dst)
        return self._issue(self._backend_for(inp), spec, out, (out, inp), timeout)

    def scatter(
        self, output: Any, src: int, input: Any = None, *, timeout: float | None = None
    ) -> Work:
        """Split ``input`` on ``src`` (dim 0) and deliver chunk ``i`` to rank ``i``'s ``output``."""
        out = validate.tensor(output, "output")
        src = validate.rank(src, self.world_size, "src")
        inp = None
        if self.rank == src:
            if input is None:
                raise InvalidArgument("scatter: input is required on the src rank")
            inp = validate.tensor(input, "input")
            validate.stacked(inp, out, self.world_size, "scatter input")
        spec = OpSpec(OpKind.SCATTER, inp, out, peer=src)
        return self._issue(self._backend_for(out), spec, out, (out, inp), timeout)

    def send(self, tensor: Any, dst: int, *, timeout: float | None = None) -> Work:
        """Send ``tensor`` to ``dst`` (matched in order with ``dst``'s ``recv``)."""
        t = validate.tensor(tensor, "tensor")
        spec = OpSpec(OpKind.SEND, t, peer=validate.peer(dst, self.world_size, self.rank, "dst"))
        return self._issue(self._backend_for(t), spec, t, t, timeout)

    def recv(self, tensor: Any, src: int, *, timeout: float | None = None) -> Work:
        """Receive into ``tensor`` from ``src``."""
        t = validate.tensor(tensor, "tensor")
        spec = OpSpec(OpKind.RECV, t, peer=validate.peer(src, self.world_size, self.rank, "src"))
        return self._issue(self._backend_for(t), spec, t, t, timeout)

    def barrier(self, *, timeout: float | None = None) -> Work:
        """Complete once every rank has reached the barrier. Work result: None."""
        backend = self._backends.get("cpu") or next(iter(self._backends.values()))
        return self._issue(backend, OpSpec(OpKind.BARRIER), None, None, timeout)

    # -------------------------------------------------------- object collectives
    def all_gather_object(self, obj: Any, *, timeout: float | None = None) -> Work:
        """Gather a picklable object from every rank. Work result: list, by rank."""
        payload = dumps(obj)
        return self._object_op(
            "all_gather_object", timeout, lambda ch, seq, t: ch.all_gather(seq, payload, t)
        )

    def broadcast_object(self, obj: Any, src: int, *, timeout: float | None = None) -> Work:
        """Send a picklable object from ``src`` to every rank. Work result: the object."""
        src = validate.rank(src, self.world_size, "src")
        payload = dumps(obj) if self.rank == src else None
        return self._object_op(
            "broadcast_object", timeout, lambda ch, seq, t: ch.broadcast(seq, payload, src, t), src
        )

    def _object_op(
        self, op: str, timeout: float | None, fn: Callable[[ObjectChannel, int, float], Any],
        root: int = -1,
    ) -> Work:
        channel = self._objects
        if channel is None:
            raise InvalidArgument(
                f"{op} needs a store; pass store= to asynccoll.wrap() to enable object collectives"
            )
        limit = validate.timeout(timeout, self.timeout)
        with self._lock:
            work = self._new_work(op, None, None)
            self._recorder.issued(work.seq, op, None, _now(), root=root)  # DIAG hook
            self._deadlines.add(work.seq, limit)
            seq = work.seq

            def done(value: Any, exc: BaseException | None) -> None:
                if exc is None:
                    work._set_result(value)
                else:
                    err = CommAborted(f"{op} (seq {seq}) failed: {exc}")
                    err.__cause__ = exc
                    work._set_exception(err)

            def run() -> None:
                channel.run(lambda: fn(channel, seq, limit), done)

            checker = self._diag.checker
            if checker is None:
                run()
            else:  # DIAG hook: held until every rank's fingerprint agrees
                checker.gate_object(op, root, work, run)
        return work

    # ------------------------------------------------------------------ faults
    def abort(self, reason: str | None = None) -> None:
        """Abort now: every pending Work raises ``CommAborted``; later calls too.

        Synchronous, callable from any thread, idempotent, bounded: it never waits
        for the network or for peers.
        """
        self._abort(CommAborted(reason or "aborted by the user"))

    def _abort(self, cause: BaseException) -> None:
        with self._lock:
            if self._state != _OK:
                return
            if isinstance(cause, CommAborted):
                error = cause
            else:
                error = CommAborted(f"communicator aborted: {cause}")
                error.__cause__ = cause
            self._state = _ABORTED
            self._error = error
            pending = list(self._pending.values())
            self._pending.clear()
        for work in pending:
            work._set_exception(_fresh_abort_error(error))
        self._diag.aborted(error)  # DIAG hook: flight record to trace_dir
        self._deadlines.stop(join_timeout=0)
        if self._liveness is not None:
            # Tell the peers (a no-op when the news came from a peer: that thread is done).
            self._liveness.publish_abort(error)
        if self._objects is not None:
            self._objects.shutdown()
        for backend in self._backends.values():
            try:
                backend.abort()
            except Exception:  # abort must finish for every backend
                pass

    async def close(self) -> None:
        """Finish pending work, then release the backends. Idempotent.

        Pending Works are awaited (each bounded by its own deadline); afterwards every
        call raises ``CommClosed``. On an aborted communicator this only releases
        resources.
        """
        with self._lock:
            if self._state == _CLOSED or self._closing:
                return
            self._closing = True
        pending = list(self._pending.values())
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        with self._lock:
            self._state = _CLOSED
        self._deadlines.stop()
        if self._liveness is not None:
            self._liveness.stop()
        if self._objects is not None:
            self._objects.shutdown()
        loop = asyncio.get_running_loop()
        for backend in self._backends.values():
            await loop.run_in_executor(None, backend.close)
        await loop.run_in_executor(None, self._diag.closed)  # DIAG hook: timeline to trace_dir

    def __del__(self) -> None:
        # No close(): stop the timer thread so it does not outlive the object.
        deadlines = getattr(self, "_deadlines", None)
        if deadlines is not None:
            deadlines.stop(join_timeout=0)

    # ---------------------------------------------------------- diagnostics
    def flight_record(self) -> list[dict[str, Any]]:
        """The last operations (API.md §6), oldest first, as dicts: ``seq``, ``op``,
        ``dtype``, ``shape``, ``numel``, ``root`` or ``peer``, ``reduce_op``, ``batch``
        (first seq of its coalesced batch), ``state`` (``"issued"``, ``"done"``,
        ``"failed"``, ``"timed out"``, ``"aborted"``, ``"mismatch"``), ``issued_at`` and
        ``ended_at`` (``time.time()`` seconds), and ``error`` for failures. Bounded: the
        last 4096 ops."""
        return self._diag.flight_record()  # DIAG hook

    # ----------------------------------------------------------- coalescing
    def coalescing(self, wait: bool = True) -> CoalescingGroup:
        """Batch the ops this task issues inside ``async with`` into one group (API.md §4).

        ``async with comm.coalescing() as group:`` records this task's ops; on exit
        they are issued together (NCCL: one group; Gloo: flattened into one
        collective per kind, dtype and reduce op) and, with ``wait=True``, awaited.
        With ``wait=False`` use ``await group`` later; ``group.works`` lists the
        member Works. If the body raises, nothing is issued and the members fail
        with its exception. Nesting in one task, entering a group twice, or
        awaiting it before the body exited raise ``InvalidArgument``.
        """
        from .coalescing import CoalescingGroup

        return CoalescingGroup(self, wait)

    # ----------------------------------------------------------- recovery
    async def shrink(self, exclude: Any = None) -> Communicator:
        """A new communicator of the survivors; this one stays aborted (API.md §5).

        ``exclude``: ranks to leave out (default: ``failed_ranks``). Every survivor
        must call it; they agree through the store on the excluded set (the union of
        what each proposes, plus ranks that never answer), then build a fresh
        communicator under a new prefix with ranks renumbered in order. A healthy
        communicator is aborted first. Each communicator can be shrunk once.
        """
        from .shrink import shrink

        return await shrink(self, exclude)

    async def __aenter__(self) -> Communicator:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
