"""Communicator: the public async API, ordering, and the ok/aborted/closed state machine."""

from __future__ import annotations

import threading
import weakref
from typing import Any, Awaitable, Callable, Mapping

import anyio
import torch

from .._base.aio import run_in_thread, settle_within
from .._base.deadlines import service as deadline_service
from .._base.errors import CommAborted, InvalidArgument, PeerFailure
from .._base.ops import OpKind, OpSpec, ReduceOp
from .._diag.diagnostics import Diagnostics
from .._faults.liveness import Liveness
from .._faults.shrink import Recovery
from .._faults.shrink import shrink as _shrink
from . import validate
from .backend import Backend
from .coalescing import CoalescingGroup
from .ledger import Ledger
from .objects import ObjectChannel, dumps
from .work import Work

_OP_NAMES = {kind: kind.value for kind in OpKind}  # enum .value is slow on the hot path


def _weak(method: Callable[[Any], None]) -> Callable[[Any], None]:
    """``method`` called through a weak reference to its object (for background threads)."""
    ref = weakref.WeakMethod(method)

    def call(arg: Any) -> None:
        fn = ref()
        if fn is not None:
            fn(arg)

    return call


def _release(ledger: Ledger, backends: list[Backend], liveness: Liveness | None, objects: ObjectChannel | None) -> None:
    """A communicator dropped without ``close()``: stop everything it started.

    Runs from ``weakref.finalize`` (garbage collection or interpreter exit); it
    holds no reference to the communicator. Pending Works fail with ``CommAborted``.
    """
    ledger.abort(CommAborted("the communicator was garbage-collected without close()"))
    ledger.release()
    if liveness is not None:
        liveness.stop()
    if objects is not None:
        objects.shutdown()
    for backend in backends:
        backend.release()


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
        heartbeat: float | None = None,
        detect_failures: bool = False,
        rebuild: Callable[[int, int, str], Awaitable[Communicator]] | None = None,
        diagnostics: Diagnostics | None = None,
        forget: Callable[[], None] | None = None,
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
        self._rebuild = rebuild
        self._forget = forget  # close(): the last rank to close deletes the store keys
        self._shrunk = False
        self._ledger = ledger = Ledger(
            rank,
            deadlines=deadline_service(),
            on_abort=_weak(self._after_abort),
            diag=diagnostics or Diagnostics(rank=rank, world_size=world_size, backend=backend_name),
        )
        self._diag = ledger.diag
        for backend in self._backends.values():
            backend.bind(ledger)
        self._liveness: Liveness | None = None
        if heartbeat and store is not None and world_size > 1:
            self._liveness = Liveness(
                store, rank, world_size, interval=heartbeat, detect=detect_failures,
                on_failure=_weak(self._abort),
            )
            for backend in self._backends.values():
                if hasattr(backend, "census"):
                    backend.census = self._liveness.census
            if self._objects is not None:  # a peer that dies meanwhile fails an object collective at once
                self._objects.watch = self._liveness.failure_among
            self._liveness.start()
        self._finalizer = weakref.finalize(
            self, _release, ledger, list(self._backends.values()), self._liveness, self._objects
        )

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> str:
        """``"ok"``, ``"aborted"`` or ``"closed"``."""
        return self._ledger.state.value

    @property
    def error(self) -> BaseException | None:
        """The exception that aborted the communicator, or None."""
        return self._ledger.error

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        """Ranks known to have failed (from errors and heartbeats); ``shrink()``'s default."""
        ranks = set(self._liveness.dead) if self._liveness is not None else set()
        error = self._ledger.error
        if isinstance(error, PeerFailure):
            ranks.update(error.ranks)
        return tuple(sorted(ranks))

    @property
    def pending(self) -> int:
        """Number of issued operations not yet settled."""
        return len(self._ledger.pending)

    @property
    def ledger(self) -> Ledger:
        """The owner of this communicator's issued operations (for coalescing, shrink, diagnostics)."""
        return self._ledger

    def __repr__(self) -> str:
        return (
            f"<asynccoll.Communicator rank={self.rank}/{self.world_size} "
            f"backend={self.backend} state={self.state}>"
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

    def _issue(
        self, backend: Backend, spec: OpSpec, value: Any, keep: Any, timeout: float | None
    ) -> Work:
        spec.timeout = self.timeout if timeout is None else validate.timeout(timeout, self.timeout)
        ledger = self._ledger
        with ledger.lock:
            work = ledger.reserve(_OP_NAMES[spec.kind], value, keep)
            batch = ledger.batch.get()
            if batch is not None and batch.add(backend, spec, work):
                ledger.issued(work, spec, batch.works[0].seq)
                return work  # issued, with its deadline, when the batch exits
            ledger.issued(work, spec)
            try:
                backend.submit(spec, work)
            except BaseException:
                ledger.discard((work,))
                raise
            ledger.commit(work, spec.timeout)
        return work

    # ------------------------------------------------------------ collectives
    def all_reduce(
        self, tensor: Any, op: ReduceOp = ReduceOp.SUM, *, timeout: float | None = None
    ) -> Work:
        """Reduce ``tensor`` across ranks, in place. Work result: ``tensor``."""
        t = validate.tensor(tensor, "tensor")
        backend = self._backend_for(t)
        spec = OpSpec(OpKind.ALL_REDUCE, t, reduce_op=validate.reduce_op(op, t.dtype, backend.name))
        return self._issue(backend, spec, t, t, timeout)

    def broadcast(self, tensor: Any, src: int, *, timeout: float | None = None) -> Work:
        """Copy ``tensor`` from ``src`` to every rank, in place."""
        t = validate.tensor(tensor, "tensor")
        backend = self._backend_for(t)
        spec = OpSpec(
            OpKind.BROADCAST, validate.movable(t, backend.name, "broadcast"),
            peer=validate.rank(src, self.world_size, "src"),
        )
        return self._issue(backend, spec, t, t, timeout)

    def reduce(
        self, tensor: Any, dst: int, op: ReduceOp = ReduceOp.SUM, *, timeout: float | None = None
    ) -> Work:
        """Reduce ``tensor`` into rank ``dst`` (in place there; other ranks' buffers are scratch)."""
        t = validate.tensor(tensor, "tensor")
        backend = self._backend_for(t)
        spec = OpSpec(
            OpKind.REDUCE, t, reduce_op=validate.reduce_op(op, t.dtype, backend.name),
            peer=validate.rank(dst, self.world_size, "dst"),
        )
        return self._issue(backend, spec, t, t, timeout)

    def all_gather(self, output: Any, input: Any, *, timeout: float | None = None) -> Work:
        """Concatenate every rank's ``input`` on dim 0 into ``output``.

        In place: ``input`` may be exactly this rank's chunk of ``output``."""
        out, inp = validate.tensor(output, "output"), validate.tensor(input, "input")
        validate.stacked(out, inp, self.world_size, "all_gather output")
        validate.no_overlap(out, inp, "all_gather", own_slot=self.rank)
        backend = self._backend_for(inp)
        name = backend.name
        spec = OpSpec(
            OpKind.ALL_GATHER, validate.movable(validate.chunk(inp), name, "all_gather"),
            validate.movable(out, name, "all_gather"),
        )
        return self._issue(backend, spec, out, (out, inp), timeout)

    def reduce_scatter(
        self, output: Any, input: Any, op: ReduceOp = ReduceOp.SUM, *, timeout: float | None = None
    ) -> Work:
        """Reduce ``input`` (world_size chunks on dim 0) and keep this rank's chunk in ``output``.

        In place: ``output`` may be exactly this rank's chunk of ``input``."""
        out, inp = validate.tensor(output, "output"), validate.tensor(input, "input")
        validate.stacked(inp, out, self.world_size, "reduce_scatter input")
        validate.no_overlap(out, inp, "reduce_scatter", own_slot=self.rank)
        backend = self._backend_for(inp)
        rop = validate.reduce_op(op, inp.dtype, backend.name)
        # chunk(): a 0-d output is a (1,) view; Gloo SIGSEGVs the process on a 0-d one.
        spec = OpSpec(OpKind.REDUCE_SCATTER, inp, validate.chunk(out), reduce_op=rop)
        return self._issue(backend, spec, out, (out, inp), timeout)

    def all_to_all(self, output: Any, input: Any, *, timeout: float | None = None) -> Work:
        """Send chunk ``i`` of ``input`` (dim 0) to rank ``i``; receive into ``output``."""
        out, inp = validate.tensor(output, "output"), validate.tensor(input, "input")
        validate.splittable(out, inp, self.world_size, "all_to_all")
        validate.no_overlap(out, inp, "all_to_all")
        backend = self._backend_for(inp)
        name = backend.name
        spec = OpSpec(
            OpKind.ALL_TO_ALL, validate.movable(inp, name, "all_to_all"), validate.movable(out, name, "all_to_all")
        )
        return self._issue(backend, spec, out, (out, inp), timeout)

    def gather(
        self, input: Any, dst: int, output: Any = None, *, timeout: float | None = None
    ) -> Work:
        """Concatenate every rank's ``input`` on dim 0 into ``output`` on ``dst`` (result elsewhere: None)."""
        inp = validate.tensor(input, "input")
        dst = validate.rank(dst, self.world_size, "dst")
        backend = self._backend_for(inp)
        name = backend.name
        # Every rank, root or not, checks and converts its own input alike.
        sent = validate.movable(validate.chunk(inp), name, "gather")
        out = into = None
        if self.rank == dst:
            if output is None:
                raise InvalidArgument("gather: output is required on the dst rank")
            out = validate.tensor(output, "output")
            validate.stacked(out, inp, self.world_size, "gather output")
            validate.no_overlap(out, inp, "gather")
            into = validate.movable(out, name, "gather")
        spec = OpSpec(OpKind.GATHER, sent, into, peer=dst)
        return self._issue(backend, spec, out, (out, inp), timeout)

    def scatter(
        self, output: Any, src: int, input: Any = None, *, timeout: float | None = None
    ) -> Work:
        """Split ``input`` on ``src`` (dim 0) and deliver chunk ``i`` to rank ``i``'s ``output``."""
        out = validate.tensor(output, "output")
        src = validate.rank(src, self.world_size, "src")
        backend = self._backend_for(out)
        name = backend.name
        # Every rank, root or not, checks and converts its own output alike.
        into = validate.movable(validate.chunk(out), name, "scatter")
        inp = sent = None
        if self.rank == src:
            if input is None:
                raise InvalidArgument("scatter: input is required on the src rank")
            inp = validate.tensor(input, "input")
            validate.stacked(inp, out, self.world_size, "scatter input")
            validate.no_overlap(out, inp, "scatter")
            sent = validate.movable(inp, name, "scatter")
        spec = OpSpec(OpKind.SCATTER, sent, into, peer=src)
        return self._issue(backend, spec, out, (out, inp), timeout)

    def send(self, tensor: Any, dst: int, *, timeout: float | None = None) -> Work:
        """Send ``tensor`` to ``dst`` (matched in order with ``dst``'s ``recv``)."""
        t = validate.tensor(tensor, "tensor")
        backend = self._backend_for(t)
        spec = OpSpec(
            OpKind.SEND, validate.movable(t, backend.name, "send"),
            peer=validate.peer(dst, self.world_size, self.rank, "dst"),
        )
        return self._issue(backend, spec, t, t, timeout)

    def recv(self, tensor: Any, src: int, *, timeout: float | None = None) -> Work:
        """Receive into ``tensor`` from ``src``."""
        t = validate.tensor(tensor, "tensor")
        backend = self._backend_for(t)
        spec = OpSpec(
            OpKind.RECV, validate.movable(t, backend.name, "recv"),
            peer=validate.peer(src, self.world_size, self.rank, "src"),
        )
        return self._issue(backend, spec, t, t, timeout)

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
        ledger = self._ledger
        with ledger.lock:
            work = ledger.reserve(op, None, None)
            ledger.issued(work, None, root=root)
            ledger.commit(work, limit)
            seq = work.seq

            def done(value: Any, exc: BaseException | None) -> None:
                if exc is None:
                    ledger.succeed(work, value)
                elif isinstance(exc, CommAborted):  # typed already (a PeerFailure keeps its ranks)
                    ledger.fail(work, exc)
                else:
                    err = CommAborted(f"{op} (seq {seq}) failed: {exc}")
                    err.__cause__ = exc
                    ledger.fail(work, err)

            def run() -> None:
                channel.run(lambda: fn(channel, seq, limit), done)

            checker = self._diag.checker
            if checker is None:
                run()
            else:  # held until every rank's fingerprint agrees
                checker.gate_object(op, root, work, run)
        return work

    # ------------------------------------------------------------------ faults
    def abort(self, reason: str | None = None) -> None:
        """Abort now: every pending Work raises ``CommAborted``; later calls too.

        Synchronous, callable from any thread, idempotent, bounded: it never waits
        for the network or for peers.
        """
        self._ledger.abort(CommAborted(reason or "aborted by the user"))

    def _abort(self, cause: BaseException) -> None:
        self._ledger.abort(cause)

    def _after_abort(self, error: BaseException) -> None:
        """The ledger aborted (any thread): tell the peers, stop the transport, record it.

        The peers' news and the backends come first: a failure to write the
        diagnostics must never keep them waiting.
        """
        self._ledger.release()
        if self._liveness is not None:
            # Tell the peers (a no-op when the news came from a peer: that thread is done).
            self._liveness.publish_abort(error)
        try:
            self._diag.aborted(error)  # the flight record goes to trace_dir (before the checker closes)
        except Exception as exc:  # noqa: BLE001 - a diagnostic must never stop the abort
            threading.excepthook(threading.ExceptHookArgs((type(exc), exc, exc.__traceback__, None)))
        if self._objects is not None:
            self._objects.shutdown()
        for backend in self._backends.values():
            backend.abort()

    async def close(self, *, timeout: float | None = None) -> None:
        """Finish pending work, then release the backends. Idempotent.

        Pending Works are awaited for at most ``timeout`` seconds (default: the
        communicator's timeout; each is also bounded by its own deadline), after
        which the communicator aborts; afterwards every call raises ``CommClosed``.
        On an aborted communicator this only releases resources.
        """
        ledger = self._ledger
        if not ledger.begin_close():
            return
        pending = list(ledger.pending.values())
        if pending:
            limit = self.timeout if timeout is None else validate.timeout(timeout, self.timeout)
            left = await settle_within(pending, limit)
            if left:
                ledger.abort(CommAborted(f"close(): {left} op(s) still pending after {limit} s"))
        ledger.end_close()
        self._finalizer.detach()
        if self._liveness is not None:
            await run_in_thread(self._liveness.goodbye, None, name="asynccoll-close")
        if self._objects is not None:
            self._objects.shutdown()
        for backend in self._backends.values():
            await run_in_thread(backend.close, None, name="asynccoll-close")
        await run_in_thread(self._diag.closed, None, name="asynccoll-close")  # the timeline to trace_dir
        if self._forget is not None and (self._liveness is None or self._liveness.failure() is None):
            await run_in_thread(self._forget, None, name="asynccoll-close")

    # ---------------------------------------------------------- diagnostics
    def flight_record(self) -> list[dict[str, Any]]:
        """The last operations (API.md §6), oldest first, as dicts: ``seq``, ``op``,
        ``dtype``, ``shape``, ``numel``, ``root`` or ``peer``, ``reduce_op``, ``batch``
        (first seq of its coalesced batch), ``state`` (``"issued"``, ``"done"``,
        ``"failed"``, ``"timed out"``, ``"aborted"``, ``"mismatch"``), ``issued_at`` and
        ``ended_at`` (``time.time()`` seconds), and ``error`` for failures. Bounded: the
        last 4096 ops."""
        return self._diag.flight_record()

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
        if self._shrunk:
            raise InvalidArgument("this communicator was already shrunk; shrink the new one")
        recovery = Recovery(
            rank=self.rank, world_size=self.world_size, timeout=self.timeout, backend=self.backend,
            state=self.state, failed_ranks=self.failed_ranks, store=self._store, liveness=self._liveness,
            rebuild=self._rebuild, abort=self.abort, claim=self._claim_shrink,
        )
        return await _shrink(recovery, exclude)

    def _claim_shrink(self) -> None:
        self._shrunk = True

    async def __aenter__(self) -> Communicator:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await exit_scope(self, exc)


async def exit_scope(comm: Communicator, exc: BaseException | None) -> None:
    """Leaving ``async with``: close on a normal exit; abort on any exception
    (KeyboardInterrupt and cancellation included), never waiting for peers."""
    if exc is None:
        await comm.close()
        return
    comm.abort(f"left the communicator's scope by {type(exc).__name__}: {exc}")
    # Shielded: a cancelled scope (trio cancels every later await in it) must still
    # release every backend; close() of an aborted communicator is bounded.
    with anyio.CancelScope(shield=True):
        await comm.close()

