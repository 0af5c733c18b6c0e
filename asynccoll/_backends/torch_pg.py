"""Backend over a torch ``ProcessGroup`` object: Gloo, or any group given to ``wrap()``.

Completion follows the common discipline (``common.Completer``): collectives are
queued in issue order and settled by whoever asks first, or by a thread that waits
on them in order (Gloo starts them in issue order, but runs them on several
threads at once). Point-to-point ops get a queue
of their own whose thread waits on each at once (started with the first send or
recv): Gloo's send and recv works complete only inside ``wait()``
(``is_completed()`` never turns true by itself, and they have no future), so a
pending recv must not stand in front of collectives whose completion a peer may
be waiting for.

Memory order: every call passes a :class:`~.gate.MemoryGate` first, which holds an op
whose memory an op in flight touches until that op has finished (its fix-up and
copy-back included), and every op called after it, so calling order is execution
order for each byte, as on NCCL's one stream; independent ops still overlap.
"""

from __future__ import annotations

import operator
import threading
from datetime import timedelta
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from .._base import shutdown
from .._base.errors import InvalidArgument, PeerFailure
from .._base.foreign import Kind, kind_of, op_error
from .._base.ops import ANY_SOURCE, OpKind, OpSpec, ReduceOp
from .._core.backend import ANY, Backend, Capabilities, Sink
from .._core.work import Bundle, Work
from . import flatten
from .common import Completer, avg_fixup
from .gate import MemoryGate, spans

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PROD: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.AVG: dist.ReduceOp.AVG,
}


# C-level callers (no Python frame per op): ``work.wait()``, ``work.is_completed()``.
_wait = operator.methodcaller("wait")
_is_done = operator.methodcaller("is_completed")


class _Lost:
    """An op whose issue already failed because the transport lost a peer (Gloo raises
    "Connection closed by peer" from ``send``/``recv`` when the pair is gone). It is not
    the caller's arguments: the op finishes, failed, the way any failed op does (the
    completion thread translates the error and the communicator aborts)."""

    def __init__(self, exc: BaseException) -> None:
        self._exc = exc

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        raise self._exc


def _rejected(what: str, name: str, exc: Exception) -> _Lost:
    """``exc``, raised by torch at issue: a lost peer or timeout as a failed op, else bad arguments."""
    if kind_of(exc) in (Kind.PEER, Kind.TIMEOUT):
        return _Lost(exc)
    raise InvalidArgument(f"{what}: {name} rejected the arguments: {exc}") from exc


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
        caps: Capabilities = ANY,
    ) -> None:
        self.name = name
        self.device_type = device_type
        self.caps = caps  # Gloo's table (``gloo.CAPS``), or torch's own checks
        self._pg = pg
        self._world_size = world_size
        self._timeout = timeout
        self._waiter = self._completer(f"asynccoll-{name}-waiter")
        # Gloo's send and recv finish only inside wait(): that thread waits on each at once.
        self._p2p_waiter = self._completer(f"asynccoll-{name}-p2p-waiter", eager=True)
        self._gate = MemoryGate(self._refused)
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

    def _completer(self, name: str, eager: bool = False) -> Completer:
        return Completer(name, lambda: self._settled, _wait, _is_done, self._error, eager=eager)

    def _reduce(
        self, spec: OpSpec, tensor: torch.Tensor, result: torch.Tensor | None = None
    ) -> tuple[Any, Callable[[], object] | None]:
        """The torch reduce op for ``spec``, and a fix-up to run on ``result`` (default:
        ``tensor``) on success (see ``common.avg_fixup``)."""
        op, fixup = avg_fixup(
            spec.reduce_op, tensor if result is None else result, self._world_size
        )
        return _TORCH_OPS[op], fixup

    def _error(self, exc: BaseException, target: Work | Bundle) -> BaseException:
        """The contract's error for a failed op (completion thread)."""
        err = op_error(exc, kind_of(exc), backend=self.name, seq=target.seq, op=target.op)
        census = self.census
        if isinstance(err, PeerFailure) and not err.ranks and census is not None:
            err.ranks = census()  # Gloo does not say which peer it lost
            if err.ranks:
                err.args = (f"{err.args[0]} [failed rank(s): {list(err.ranks)}]",)
        return err

    # -- Backend -----------------------------------------------------------
    def bind(self, sink: Sink) -> None:
        super().bind(sink)
        self._settled = _Settled(sink, self._gate, self._waiter.hurry)

    def submit(self, spec: OpSpec, work: Work | Bundle) -> None:
        works: Sequence[Work] = (work,) if isinstance(work, Work) else work.works
        if not self._gate.run(spans((spec,)), works, self._issue, spec, work):
            self._waiter.hurry()  # held: the ops it waits for must be seen to finish

    def submit_batch(self, specs: Sequence[OpSpec], works: Sequence[Work]) -> None:
        """A coalesced batch: one flattened collective per (kind, dtype, op), see ``flatten``."""
        issue = flatten.submit_batch
        if not self._gate.run(
            spans(specs), works, issue, self._issue, specs, works, self._pg.rank(), self._world_size
        ):
            self._waiter.hurry()

    def _refused(self, works: Sequence[Work], exc: BaseException) -> None:
        """A held op the group refused when its turn came: the peers may have started
        it, so it fails (and the communicator aborts), as a lost one does."""
        self._waiter.refuse(Bundle(works, works[0].op), exc)

    def _issue(self, spec: OpSpec, work: Work | Bundle) -> None:
        """Start ``spec`` on the group now (the gate let it through)."""
        pg, kind, t = self._pg, spec.kind, spec.tensor
        if (
            kind is OpKind.ALL_REDUCE
            and spec.reduce_op is ReduceOp.SUM
            and spec.timeout <= self._timeout
        ):
            try:  # the most common op, without the general dispatch below
                tw = pg.allreduce([t], self._sum_opts)
            except (RuntimeError, TypeError, ValueError) as exc:
                tw = _rejected("all_reduce", self.name, exc)
            self._waiter.watch(tw, work, None)
            return
        fixup = result = None
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
                tw = pg.reduce(
                    [t], self._opts(c10d.ReduceOptions, spec, reduceOp=op, rootRank=spec.peer)
                )
            elif kind is OpKind.ALL_GATHER:
                tw = pg._allgather_base(spec.output, t, self._opts(c10d.AllgatherOptions, spec))
            elif kind is OpKind.REDUCE_SCATTER:
                op, fixup = self._reduce(spec, t, spec.output)
                tw = pg._reduce_scatter_base(
                    spec.output, t, self._opts(c10d.ReduceScatterOptions, spec, reduceOp=op)
                )
            elif kind is OpKind.ALL_TO_ALL:
                tw = pg.alltoall_base(
                    spec.output, t, [], [], self._opts(c10d.AllToAllOptions, spec)
                )
            elif kind is OpKind.GATHER:
                outs = (
                    [list(spec.output.chunk(self._world_size))] if spec.output is not None else []
                )
                tw = pg.gather(outs, [t], self._opts(c10d.GatherOptions, spec, rootRank=spec.peer))
            elif kind is OpKind.SCATTER:
                ins = [list(t.chunk(self._world_size))] if t is not None else []
                tw = pg.scatter(
                    [spec.output], ins, self._opts(c10d.ScatterOptions, spec, rootRank=spec.peer)
                )
            elif kind is OpKind.SEND:
                tw = pg.send([t], spec.peer, 0)
            elif kind is OpKind.RECV and spec.peer == ANY_SOURCE:
                tw = pg.recv_anysource([t], 0)
                result = tw._source_rank  # the sender, once the receive has finished
            elif kind is OpKind.RECV:
                tw = pg.recv([t], spec.peer, 0)
            elif kind is OpKind.BARRIER:
                tw = pg.barrier(self._opts(c10d.BarrierOptions, spec))
            else:  # pragma: no cover - OpKind is closed
                raise InvalidArgument(f"unsupported op {kind}")
        except (RuntimeError, TypeError, ValueError) as exc:
            tw, fixup, result = _rejected(kind.value, self.name, exc), None, None
        waiter = self._p2p_waiter if kind is OpKind.SEND or kind is OpKind.RECV else self._waiter
        waiter.watch(tw, work, fixup, result)

    def abort(self) -> None:
        self._aborted = True
        self._gate.close()
        self._waiter.stop()
        self._p2p_waiter.stop()
        pg = self._pg
        if pg is not None:
            try:
                pg.abort()
            except RuntimeError:  # a wrapped group whose backend has no abort: stopping is enough
                pass

    def release(self) -> None:
        self.abort()
        self.close()  # after an abort: never blocks (the group goes to a reaper thread)

    def close(self) -> None:
        # After an abort the waiters may sit in an op Gloo never finishes: no join.
        join = 0.0 if self._aborted else 2.0
        self._waiter.stop(join_timeout=join)
        self._p2p_waiter.stop(join_timeout=join)
        pg_holder, self._pg = [self._pg], None
        if pg_holder[0] is None:
            return
        if self._aborted:  # Gloo cannot interrupt an op in flight: they may stay in it
            for thread in (self._waiter.thread, self._p2p_waiter.thread):
                shutdown.register_native_thread(thread)
        if self._aborted and not threading.main_thread().is_alive():
            # The interpreter is exiting (a communicator released by its finalizer):
            # the group is never destroyed. A destructor still running on a reaper
            # when the process exits aborts it ("terminate called without an active
            # exception", measured 7 in 8 exits after a peer's death).
            _AT_EXIT.append(pg_holder.pop())
            return
        if self._aborted:
            # Gloo's destructor joins its worker threads, which may be stuck in an
            # op until Gloo's own timeout: the last reference goes on a thread of
            # its own, never here (``pg_holder`` holds the only reference: no local may
            # outlive the hand-over, or the destructor could run on this thread).
            reaper = threading.Thread(
                target=_release, args=(pg_holder,), daemon=True, name="asynccoll-reaper"
            )
            reaper.start()
            shutdown.register_native_thread(reaper)
        del pg_holder
        # Otherwise the last reference goes here, on the executor thread. No
        # pg.shutdown(): measured here, it makes ~1 in 3 processes abort at exit
        # ("terminate called without an active exception").


class _Settled:
    """The sink the completion queues report to: the communicator's, then the gate,
    which lets the held ops that waited for these go (a failure aborts: nothing more
    goes). While the gate still holds ops, ``hurry`` keeps the completion thread
    waiting on what is in flight: a held op has no completion attached, so nobody
    awaiting it (or an op behind it) could otherwise bring its turn."""

    __slots__ = ("_sink", "_gate", "_hurry")

    def __init__(self, sink: Sink, gate: MemoryGate, hurry: Callable[[], None]) -> None:
        self._sink = sink
        self._gate = gate
        self._hurry = hurry

    def succeed(self, target: Work | Bundle, value: Any = None) -> None:
        self._sink.succeed(target, value)
        self._release((target,))

    def succeed_all(self, targets: Iterable[Work | Bundle]) -> None:
        targets = targets if isinstance(targets, (list, tuple)) else list(targets)
        self._sink.succeed_all(targets)
        self._release(targets)

    def fail(self, target: Work | Bundle, exc: BaseException) -> None:
        self._sink.fail(target, exc)

    def _release(self, targets: Sequence[Work | Bundle]) -> None:
        self._gate.finished(targets)
        if self._gate.holding:
            self._hurry()


#: Aborted groups released while the interpreter exits: kept, never destroyed.
_AT_EXIT: list[Any] = []


def _release(pg_holder: list[Any]) -> None:
    pg_holder.clear()  # drops the only reference, on this thread
