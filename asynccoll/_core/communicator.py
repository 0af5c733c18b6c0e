"""Communicator: the public async API, ordering, and the ok/aborted/closed state machine."""

from __future__ import annotations

import types
import weakref
from typing import Any, Awaitable, Callable, Mapping

import anyio
import torch

from .._base import aio, signals
from .._base.deadlines import service as deadline_service
from .._base.errors import CommAborted, InvalidArgument, PeerFailure, is_abort_error
from .._base.ops import OpKind, OpSpec, ReduceOp
from . import validate
from .backend import Backend
from .coalescing import Batch, CoalescingGroup
from .interfaces import (
    DiagnosticHooks,
    Elastic,
    Membership,
    ShrinkRequest,
    Splitting,
)
from .ledger import Ledger
from .objects import ObjectChannel, dumps
from .resources import Resources, weak_callback
from .specs import Specs
from .state import broadcast_state as _broadcast_state
from .work import Work

_OP_NAMES = {kind: kind.value for kind in OpKind}  # enum .value is slow on the hot path


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
        liveness: Membership | None = None,
        build_shrunk: Callable[..., Awaitable[Communicator]] | None = None,
        shrink: ShrinkFn | None = None,
        diagnostics: DiagnosticHooks | None = None,
        group: Elastic | None = None,
        forget: Callable[[], None] | None = None,
        splitter: Splitting | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend_name
        self.device = device
        self.timeout = timeout
        self._backends = dict(backends)
        self._specs = Specs(rank, world_size, self._backends, backend_name)
        self._cpu_backend = self._specs.cpu_backend
        self._store = store
        self._objects = ObjectChannel(store, rank, world_size) if store is not None else None
        self._build_shrunk = build_shrunk
        self._shrink_fn = shrink
        self._shrunk = False
        self._group = group  # elastic membership (bootstrap's Group): waiting() and grow()
        self._splitter = splitter  # subgroups (bootstrap's Splitter): split()
        self._diag = diagnostics if diagnostics is not None else DiagnosticHooks()
        self._ledger = ledger = Ledger(
            rank,
            deadlines=deadline_service(),
            on_abort=weak_callback(self._after_abort),
            recorder=self._diag.recorder,
        )
        # forget: close() then deletes the store keys, on the last rank to close (``_bootstrap``).
        self._resources = resources = Resources(
            ledger, self._backends, self._objects, self._diag, forget
        )
        self._liveness: Membership | None = None
        if liveness is not None:
            self._liveness = resources.start_liveness(liveness, weak_callback(self._abort))
        self._finalizer = weakref.finalize(self, resources.collected)

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
    def name(self) -> str | None:
        """The group's name (``ac.init(..., name=)``), or None for a private group."""
        return self._group.name if self._group is not None else None

    @property
    def pending(self) -> int:
        """Number of issued operations not yet settled."""
        return len(self._ledger.pending)

    @property
    def backends(self) -> Mapping[str | None, Backend]:
        """The backends by the device type each one serves (the key None serves any device), read-only."""
        return types.MappingProxyType(self._backends)

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
    def _issue(
        self, backend: Backend, spec: OpSpec, value: Any, keep: Any, timeout: float | None
    ) -> Work:
        spec.timeout = self.timeout if timeout is None else validate.timeout(timeout, self.timeout)
        ledger = self._ledger
        batch: Batch | None = ledger.batch.get()
        if batch is not None:  # recorded; issued, with its deadline, when the batch exits
            member = batch.add(_OP_NAMES[spec.kind], backend, spec, value, keep)
            if member is not None:
                return member
        with ledger.lock:
            work = ledger.reserve(_OP_NAMES[spec.kind], value, keep, spec)
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
        return self._issue(*self._specs.all_reduce(tensor, op), timeout)

    def broadcast(self, tensor: Any, src: int, *, timeout: float | None = None) -> Work:
        """Copy ``tensor`` from ``src`` to every rank, in place."""
        return self._issue(*self._specs.broadcast(tensor, src), timeout)

    def reduce(
        self, tensor: Any, dst: int, op: ReduceOp = ReduceOp.SUM, *, timeout: float | None = None
    ) -> Work:
        """Reduce ``tensor`` into rank ``dst`` (in place there; other ranks' buffers are scratch)."""
        return self._issue(*self._specs.reduce(tensor, dst, op), timeout)

    def all_gather(self, output: Any, input: Any, *, timeout: float | None = None) -> Work:
        """Concatenate every rank's ``input`` on dim 0 into ``output``.

        In place: ``input`` may be exactly this rank's chunk of ``output``."""
        return self._issue(*self._specs.all_gather(output, input), timeout)

    def reduce_scatter(
        self, output: Any, input: Any, op: ReduceOp = ReduceOp.SUM, *, timeout: float | None = None
    ) -> Work:
        """Reduce ``input`` (world_size chunks on dim 0) and keep this rank's chunk in ``output``.

        In place: ``output`` may be exactly this rank's chunk of ``input``."""
        return self._issue(*self._specs.reduce_scatter(output, input, op), timeout)

    def all_to_all(self, output: Any, input: Any, *, timeout: float | None = None) -> Work:
        """Send chunk ``i`` of ``input`` (dim 0) to rank ``i``; receive into ``output``."""
        return self._issue(*self._specs.all_to_all(output, input), timeout)

    def gather(
        self, input: Any, dst: int, output: Any = None, *, timeout: float | None = None
    ) -> Work:
        """Concatenate every rank's ``input`` on dim 0 into ``output`` on ``dst`` (result elsewhere: None)."""
        return self._issue(*self._specs.gather(input, dst, output), timeout)

    def scatter(
        self, output: Any, src: int, input: Any = None, *, timeout: float | None = None
    ) -> Work:
        """Split ``input`` on ``src`` (dim 0) and deliver chunk ``i`` to rank ``i``'s ``output``."""
        return self._issue(*self._specs.scatter(output, src, input), timeout)

    def send(self, tensor: Any, dst: int, *, timeout: float | None = None) -> Work:
        """Send ``tensor`` to ``dst`` (matched in order with ``dst``'s ``recv``)."""
        return self._issue(*self._specs.send(tensor, dst), timeout)

    def recv(self, tensor: Any, src: int, *, timeout: float | None = None) -> Work:
        """Receive into ``tensor`` from ``src``."""
        return self._issue(*self._specs.recv(tensor, src), timeout)

    def recv_any(self, tensor: Any, *, timeout: float | None = None) -> Work:
        """Receive into ``tensor`` from whichever peer's send reaches it first.
        Work result: the sender's rank.

        Issued in call order like any op (it takes the next ``seq``). Gloo (the one
        backend that has it) matches it to the sends: which of two pending receives a
        message fills, when one names its sender and one does not, is Gloo's choice.
        Not in a coalescing batch, nor under ``check="fingerprint"`` (whose check pairs
        each receive with its named peer's send)."""
        if self._ledger.batch.get() is not None:
            raise InvalidArgument(
                "recv_any cannot be coalescing: its sender is known only at the end"
            )
        return self._issue(*self._specs.recv_any(tensor), timeout)

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
        self,
        op: str,
        timeout: float | None,
        fn: Callable[[ObjectChannel, int, float], Any],
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
                elif is_abort_error(exc):  # typed already (a PeerFailure keeps its ranks)
                    ledger.fail(work, exc)
                else:
                    err = CommAborted(f"{op} (seq {seq}) failed: {exc}")
                    err.__cause__ = exc
                    ledger.fail(work, err)

            def run() -> None:
                channel.run(lambda: fn(channel, seq, limit), done)

            self._diag.gate_object(
                op, root, work, run
            )  # with a checker: once the fingerprints agree
        return work

    # ------------------------------------------------------------------ faults
    def abort(self, reason: str | None = None) -> None:
        """Abort now: every pending Work raises ``CommAborted``; later calls too. An op
        that finished before the abort, unseen (not awaited yet), keeps its result.

        Synchronous, callable from any thread, idempotent, bounded: it never waits
        for the network or for peers (nor, in a signal handler, for its own thread).
        """
        signals.call(self._ledger.abort, CommAborted(reason or "aborted by the user"))

    def _abort(self, cause: BaseException) -> None:  # a peer's failure or abort news (liveness)
        self._diag.settle(cause)  # a verdict in reach (the news's own too) is what held ops raise
        self._ledger.abort(cause)

    def _after_abort(self, error: BaseException) -> None:
        self._resources.aborted(error)  # the ledger aborted (any thread): peers, transport, records

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
            left = await aio.settle_within(pending, limit)
            if left:
                ledger.abort(CommAborted(f"close(): {left} op(s) still pending after {limit} s"))
        ledger.end_close()
        self._finalizer.detach()
        await self._resources.close()

    # ---------------------------------------------------------- diagnostics
    def flight_record(self) -> list[dict[str, Any]]:
        """The last operations, oldest first, as dicts: ``seq``, ``op``,
        ``dtype``, ``shape``, ``numel``, ``root`` or ``peer``, ``reduce_op``, ``batch``
        (first seq of its coalesced batch), ``state`` (``"issued"``, ``"done"``,
        ``"failed"``, ``"timed out"``, ``"aborted"``, ``"mismatch"``), ``issued_at`` and
        ``ended_at`` (``time.time()`` seconds), and ``error`` for failures. Bounded: the
        last 4096 ops."""
        return self._diag.flight_record()

    # ----------------------------------------------------------- coalescing
    def coalescing(self, wait: bool = True) -> CoalescingGroup:
        """Batch the ops this task issues inside ``async with`` into one group.

        ``async with comm.coalescing() as group:`` records this task's ops; on exit
        they are issued together (NCCL: one group; Gloo: flattened into one
        collective per kind, dtype and reduce op) and, with ``wait=True``, awaited.
        With ``wait=False`` use ``await group`` later; ``group.works`` lists the
        member Works. If the body raises, nothing is issued and the members fail
        with its exception. Nesting in one task, entering a group twice, or
        awaiting it before the body exited raise ``InvalidArgument``.
        """
        return CoalescingGroup(self._ledger, wait)

    # ----------------------------------------------------------- recovery
    async def shrink(self, exclude: Any = None) -> Communicator:
        """A new communicator of the survivors; this one stays aborted.

        ``exclude``: ranks to leave out (default: ``failed_ranks``). Every survivor
        must call it; they agree through the store on the excluded set (the union of
        what each proposes, plus ranks that never answer), then build a fresh
        communicator under a new prefix with ranks renumbered in order. A healthy
        communicator is aborted first. Each communicator can be shrunk once.
        """
        if self._shrunk:
            raise InvalidArgument("this communicator was already shrunk; shrink the new one")
        if self._shrink_fn is None:
            raise InvalidArgument(
                f"shrink needs a communicator made by asynccoll.init(), not {self.backend!r}"
            )
        request = ShrinkRequest(
            rank=self.rank,
            world_size=self.world_size,
            timeout=self.timeout,
            backend=self.backend,
            state=self.state,
            failed_ranks=self.failed_ranks,
            store=self._store,
            liveness=self._liveness,
            build_shrunk=self._build_shrunk,
            abort=self.abort,
            claim=self._claim_shrink,
            retire=self._resources.retire,
        )
        return await self._shrink_fn(request, exclude)

    def _claim_shrink(self) -> None:
        self._shrunk = True

    async def split(self, groups: Any, *, timeout: float | None = None) -> Communicator | None:
        """This rank's subgroup: ``await comm.split([[0, 1], [2, 3]])``.

        A collective: every rank calls it with the same disjoint lists of ranks. Returns
        the group that holds this rank as a communicator of its own (ranks renumbered in
        list order), or None if no list holds it. The subgroups keep this communicator's
        options (backend, timeout, check, trace_dir, heartbeat; not its name). NCCL builds
        them with one ``ncclCommSplit``, Gloo with a new group. Lists that differ across
        ranks, overlap, or name a rank outside raise ``InvalidArgument`` on every rank; a
        communicator aborted on any rank, ``CommAborted`` on every rank. This rank's
        pending operations finish first (``timeout``: how long to wait for them and for
        the others, default the communicator's timeout). A peer that dies during the
        split ends it with ``PeerFailure`` (naming it in this communicator's ranks), and
        this communicator aborted meanwhile with ``CommAborted``, at once.

        A subgroup is independent: closing, aborting or shrinking it leaves this
        communicator and its siblings alone, and the reverse; a peer's death is reported
        by every group that contains it (each by its own ranks).
        """
        if self._splitter is None:
            raise InvalidArgument(
                f"split needs a communicator made by asynccoll.init(), not {self.backend!r}"
            )
        watch = self._liveness.failure_among if self._liveness is not None else None
        new: Communicator | None = await self._splitter.split(self, groups, timeout, watch)
        return new

    # ---------------------------------------------------------------- elastic
    def _named(self, what: str) -> Elastic:
        if self._group is None:
            raise InvalidArgument(f"{what} needs a named group: ac.init(..., name=...)")
        return self._group

    async def waiting(self, *, timeout: float | None = None) -> int:
        """How many processes wait in ``ac.join`` for this group.

        A collective: every member calls it at the same point of its op order and
        gets the same count (rank 0 reads the waiting room and broadcasts it).
        """
        return await self._named("waiting()").waiting(self, timeout)

    async def grow(self, world_size: int, timeout: float | None = None) -> Communicator:
        """A communicator of ``world_size`` ranks: this group plus joiners.

        Every member calls it; it returns once ``world_size - self.world_size``
        processes waiting in ``ac.join`` are in (``timeout``: how long to wait for
        them, default the communicator's timeout, then ``CollectiveTimeout`` and this
        communicator is left as it was). Old ranks keep their numbers; newcomers get
        ``self.world_size .. world_size - 1``. This communicator is closed. If a
        participant dies meanwhile, every member gets ``PeerFailure`` (``.ranks``
        numbered as in the grown group); if members died, this communicator is
        aborted and ``shrink()`` recovers as after any failure.
        """
        new: Communicator = await self._named("grow()").grow(self, world_size, timeout)
        return new

    async def broadcast_state(
        self, state: Any, src: int = 0, *, timeout: float | None = None
    ) -> Any:
        """Send ``state`` (nested dicts/lists/tuples of tensors and picklable objects,
        such as a ``state_dict()``) from ``src`` to every rank.

        Receivers pass None (what they pass is ignored) and get the whole structure
        back, with tensors on CPU or this communicator's CUDA device as on ``src``;
        ``src`` gets its ``state`` back. Tensors travel as tensors in one coalesced
        batch, the rest as one object.
        """
        return await _broadcast_state(self, state, src, timeout)

    async def __aenter__(self) -> Communicator:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await exit_scope(self, exc)


#: ``_faults.shrink.shrink``: what ``Communicator.shrink`` runs (handed over by ``_bootstrap``).
ShrinkFn = Callable[[ShrinkRequest, Any], Awaitable[Communicator]]


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
