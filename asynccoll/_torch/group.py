"""A ``torch.distributed.ProcessGroup`` whose collectives run on a communicator.

Every c10d call becomes one call of the communicator's public API (two for the
list-of-lists forms, which run on one flat buffer), issued at once, so the group's
ops and the communicator's awaitable calls share one issue order, one sequence of
``seq`` numbers, the flight record, the fingerprint check, the deadlines and abort.
"""

from __future__ import annotations

import functools
import weakref
from concurrent.futures import Executor, ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .._base.errors import CommAborted, InvalidArgument
from .._base.ops import ReduceOp
from .._core.communicator import Communicator
from .._core.work import Work
from .backward import BackwardCheck
from .errors import as_c10d
from .works import C10dWork, RecvAnyWork

# torch's stubs lack the options classes and describe the Python conveniences of
# ProcessGroup's methods; c10d calls the overrides below as (tensors..., opts).
_c10d: Any = dist

_OPS: dict[Any, ReduceOp] = {  # keyed by c10d's RedOpType (``opts.reduceOp.op``)
    _c10d.ReduceOp.SUM: ReduceOp.SUM,
    _c10d.ReduceOp.PRODUCT: ReduceOp.PROD,
    _c10d.ReduceOp.MIN: ReduceOp.MIN,
    _c10d.ReduceOp.MAX: ReduceOp.MAX,
    _c10d.ReduceOp.AVG: ReduceOp.AVG,
}


def _op(opts: Any) -> ReduceOp:
    rop = opts.reduceOp.op
    try:
        return _OPS[rop]
    except KeyError:
        raise InvalidArgument(
            f"asynccoll does not reduce with {rop}: use SUM, PRODUCT, MIN, MAX or AVG"
        ) from None


def _timeout(opts: Any) -> float | None:
    """The op's deadline in seconds: c10d's ``opts.timeout`` when set, else the communicator's."""
    limit: timedelta = opts.timeout
    seconds = limit.total_seconds()
    return seconds if seconds > 0 else None


def _one(tensors: Sequence[Any], what: str) -> Any:
    if len(tensors) != 1:
        raise InvalidArgument(f"{what}: one tensor per call (got {len(tensors)})")
    return tensors[0]


def _copy_out(flat: torch.Tensor, outputs: Sequence[torch.Tensor]) -> Callable[[], None]:
    def finish() -> None:
        for out, chunk in zip(outputs, flat.unbind(0) if flat.dim() else (flat,)):
            out.copy_(chunk.view_as(out))

    return finish


def _stack(tensors: Sequence[torch.Tensor], like: torch.Tensor, what: str) -> torch.Tensor:
    shapes = {tuple(t.shape) for t in tensors}
    if shapes != {tuple(like.shape)}:
        raise InvalidArgument(f"{what}: every tensor must have the shape {tuple(like.shape)}")
    return torch.stack([t.to(like.dtype) for t in tensors])


def _even(splits: Sequence[int], t: torch.Tensor, n: int) -> bool:
    """Splits that the communicator's all_to_all (equal chunks of dim 0) serves."""
    if not splits:
        return True
    return (
        len(splits) == n and len(set(splits)) == 1 and t.dim() > 0 and splits[0] * n == t.shape[0]
    )


def _split(t: torch.Tensor, splits: Sequence[int], n: int, what: str) -> list[torch.Tensor]:
    """``t``'s chunks of dim 0 by ``splits`` (none: equal), one per rank."""
    rows = t.shape[0] if t.dim() else 0
    if not splits:
        if t.dim() == 0 or rows % n:
            raise InvalidArgument(f"all_to_all_single: {what} dim 0 ({rows}) must split evenly")
        splits = [rows // n] * n
    if len(splits) != n or min(splits) < 0 or sum(splits) != rows or t.dim() == 0:
        raise InvalidArgument(
            f"all_to_all_single: {what} splits {list(splits)} must be {n} sizes "
            f"summing to dim 0 ({rows})"
        )
    return list(t.split(list(splits)))


def _typed(method: Callable[..., C10dWork]) -> Callable[..., C10dWork]:
    """An op refused at the call because the communicator is aborted raises the
    contract's error as c10d users catch it (``InvalidArgument`` stays as it is)."""

    @functools.wraps(method)
    def issue(self: Any, *args: Any, **kwargs: Any) -> C10dWork:
        try:
            return method(self, *args, **kwargs)
        except CommAborted as exc:
            raise as_c10d(exc) from exc.__cause__

    return issue


class CommProcessGroup(dist.ProcessGroup):
    """``torch.distributed.ProcessGroup`` over an asynccoll :class:`~asynccoll.Communicator`.

    Made by :func:`asynccoll.process_group`. Ranks and size are the communicator's; a
    communicator that is shrunk or grown needs a new group (``process_group(new)``).
    ``abort()`` aborts the communicator; ``shutdown()`` (``dist.destroy_process_group``)
    closes it if the group owns it (the group ``dist.init_process_group("asynccoll")``
    made).
    """

    def __init__(
        self, comm: Communicator, *, close: Callable[[Communicator], None] | None = None
    ) -> None:
        super().__init__(comm.rank, comm.world_size)  # type: ignore[call-arg]
        self.comm = comm
        self._close = close
        self._relay: ThreadPoolExecutor | None = None
        self._backward = BackwardCheck()
        self._group_name = f"asynccoll:{id(comm):x}"
        self._group_desc = "asynccoll"

    def getBackendName(self) -> str:
        return "asynccoll"

    # torch names the groups it makes (``new_group``, ``init_process_group``); the base
    # class keeps the name on its C++ backends, which a Python group has none of.
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return f"<asynccoll ProcessGroup over {self.comm!r}>"

    # ------------------------------------------------------------------ issue
    def _relay_executor(self) -> Executor:
        """One thread, started on first use, that registers future callbacks for event-loop threads."""
        if self._relay is None:
            self._relay = ThreadPoolExecutor(1, thread_name_prefix="asynccoll-c10d-relay")
            weakref.finalize(self, self._relay.shutdown, wait=False)
        return self._relay

    def _work(
        self,
        works: Sequence[Work],
        result: list[Any],
        finish: Callable[[], None] | None = None,
        kind: type[C10dWork] = C10dWork,
    ) -> C10dWork:
        c10d = kind(works, result, finish, self._relay_executor)
        self._backward.issued(c10d)
        return c10d

    # ------------------------------------------------------------ collectives
    @_typed
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> C10dWork:
        opts = opts if opts is not None else _c10d.AllreduceOptions()
        t = _one(tensors, "allreduce")
        return self._work((self.comm.all_reduce(t, _op(opts), timeout=_timeout(opts)),), tensors)

    @_typed
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> C10dWork:
        opts = opts if opts is not None else _c10d.AllreduceCoalescedOptions()
        op, limit = _op(opts), _timeout(opts)
        works = [self.comm.all_reduce(t, op, timeout=limit) for t in tensors]
        return self._work(works, tensors)

    @_typed
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> C10dWork:
        opts = opts if opts is not None else _c10d.BroadcastOptions()
        t = _one(tensors, "broadcast")
        work = self.comm.broadcast(t, opts.rootRank, timeout=_timeout(opts))
        return self._work((work,), tensors)

    @_typed
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> C10dWork:
        opts = opts if opts is not None else _c10d.ReduceOptions()
        t = _one(tensors, "reduce")
        work = self.comm.reduce(t, opts.rootRank, _op(opts), timeout=_timeout(opts))
        return self._work((work,), tensors)

    @_typed
    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> C10dWork:
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        inp = _one(input_tensors, "allgather")
        outs = _one(output_tensors, "allgather")
        if len(outs) != self.comm.world_size:
            raise InvalidArgument(
                f"allgather: {len(outs)} outputs for {self.comm.world_size} ranks"
            )
        flat = inp.new_empty((self.comm.world_size, *inp.shape))
        work = self.comm.all_gather(flat, inp.unsqueeze(0), timeout=_timeout(opts))
        return self._work((work,), output_tensors, _copy_out(flat, outs))

    @_typed
    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> C10dWork:
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        return self._work((self.comm.all_gather(output, input, timeout=_timeout(opts)),), [output])

    all_gather_single = _allgather_base

    @_typed
    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_list: list[torch.Tensor],
        opts: Any = None,
    ) -> C10dWork:
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        # c10d's layout: output_lists[rank][i] receives input i of that rank.
        n, limit = self.comm.world_size, _timeout(opts)
        if len(output_lists) != n:
            raise InvalidArgument(
                f"allgather_coalesced: {len(output_lists)} output lists for {n} ranks"
            )
        works, finishes = [], []
        for i, inp in enumerate(input_list):
            flat = inp.new_empty((n, *inp.shape))
            works.append(self.comm.all_gather(flat, inp.unsqueeze(0), timeout=limit))
            finishes.append(_copy_out(flat, [output_lists[r][i] for r in range(n)]))

        def finish() -> None:
            for each in finishes:
                each()

        return self._work(works, output_lists, finish)

    @_typed
    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> C10dWork:
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        limit = _timeout(opts)
        works = [
            self.comm.all_gather(out, inp, timeout=limit)
            for out, inp in zip(outputs, inputs, strict=True)
        ]
        return self._work(works, outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    @_typed
    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> C10dWork:
        opts = opts if opts is not None else _c10d.ReduceScatterOptions()
        op, limit = _op(opts), _timeout(opts)
        works = [
            self.comm.reduce_scatter(out, inp, op, timeout=limit)
            for out, inp in zip(outputs, inputs, strict=True)
        ]
        return self._work(works, outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    @_typed
    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> C10dWork:
        opts = opts if opts is not None else _c10d.ReduceScatterOptions()
        out = _one(output_tensors, "reduce_scatter")
        ins = _one(input_tensors, "reduce_scatter")
        if len(ins) != self.comm.world_size:
            raise InvalidArgument(
                f"reduce_scatter: {len(ins)} inputs for {self.comm.world_size} ranks"
            )
        flat = _stack(ins, out, "reduce_scatter")
        work = self.comm.reduce_scatter(out.unsqueeze(0), flat, _op(opts), timeout=_timeout(opts))
        return self._work((work,), output_tensors)

    @_typed
    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> C10dWork:
        opts = opts if opts is not None else _c10d.ReduceScatterOptions()
        work = self.comm.reduce_scatter(output, input, _op(opts), timeout=_timeout(opts))
        return self._work((work,), [output])

    reduce_scatter_single = _reduce_scatter_base

    @_typed
    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> C10dWork:
        opts = opts if opts is not None else _c10d.AllToAllOptions()
        n, me, limit = self.comm.world_size, self.comm.rank, _timeout(opts)
        if _even(output_split_sizes, output, n) and _even(input_split_sizes, input, n):
            return self._work((self.comm.all_to_all(output, input, timeout=limit),), [output])
        # Unequal splits: one send and one receive per peer, issued by every rank in the
        # same order (peer by peer, empty chunks too, so the ranks' seqs stay in step)
        # and matched pairwise as any send and recv; this rank's own chunk is copied
        # once they have finished. Everything is checked before anything is issued.
        if output.dtype != input.dtype or not output.is_contiguous():
            raise InvalidArgument(
                "all_to_all_single: output must be contiguous, of the input's dtype"
            )
        ins = _split(input, input_split_sizes, n, "input")
        outs = _split(output, output_split_sizes, n, "output")
        own_in, own_out = ins[me], outs[me]
        if own_in.shape != own_out.shape:
            raise InvalidArgument(
                f"all_to_all_single: this rank sends itself {own_in.shape[0]} rows "
                f"and expects {own_out.shape[0]} from itself"
            )
        works = []
        for peer in range(n):
            if peer != me:
                works.append(self.comm.send(ins[peer], peer, timeout=limit))
                works.append(self.comm.recv(outs[peer], peer, timeout=limit))
        if not works:  # a group of one
            works.append(self.comm.barrier(timeout=limit))

        def finish() -> None:
            own_out.copy_(own_in)

        return self._work(works, [output], finish)

    all_to_all_single = alltoall_base

    @_typed
    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> C10dWork:
        opts = opts if opts is not None else _c10d.AllToAllOptions()
        n = self.comm.world_size
        if len(output_tensors) != n or len(input_tensors) != n:
            raise InvalidArgument(f"all_to_all: {n} input and {n} output tensors are needed")
        flat_in = _stack(input_tensors, input_tensors[0], "all_to_all input")
        flat_out = torch.empty_like(flat_in)
        work = self.comm.all_to_all(flat_out, flat_in, timeout=_timeout(opts))
        return self._work((work,), output_tensors, _copy_out(flat_out, output_tensors))

    @_typed
    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> C10dWork:
        opts = opts if opts is not None else _c10d.GatherOptions()
        inp = _one(input_tensors, "gather")
        root = opts.rootRank
        if self.comm.rank != root:
            work = self.comm.gather(inp.unsqueeze(0), root, timeout=_timeout(opts))
            return self._work((work,), output_tensors)
        outs = _one(output_tensors, "gather")
        flat = inp.new_empty((self.comm.world_size, *inp.shape))
        work = self.comm.gather(inp.unsqueeze(0), root, flat, timeout=_timeout(opts))
        return self._work((work,), output_tensors, _copy_out(flat, outs))

    @_typed
    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> C10dWork:
        opts = opts if opts is not None else _c10d.ScatterOptions()
        out = _one(output_tensors, "scatter")
        root = opts.rootRank
        flat = None
        if self.comm.rank == root:
            flat = _stack(_one(input_tensors, "scatter"), out, "scatter input")
        work = self.comm.scatter(out.unsqueeze(0), root, flat, timeout=_timeout(opts))
        return self._work((work,), output_tensors)

    @_typed
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> C10dWork:
        t = _one(tensors, "send")
        return self._work((self.comm.send(t, dst),), tensors)

    @_typed
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> C10dWork:
        t = _one(tensors, "recv")
        return self._work((self.comm.recv(t, src),), tensors)

    @_typed
    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> C10dWork:
        """``dist.recv(t)`` without a source: ``work._source_rank()`` names the sender."""
        t = _one(tensors, "recv")
        return self._work((self.comm.recv_any(t),), tensors, kind=RecvAnyWork)

    @_typed
    def barrier(self, opts: Any = None) -> C10dWork:
        opts = opts if opts is not None else _c10d.BarrierOptions()
        return self._work((self.comm.barrier(timeout=_timeout(opts)),), [])

    # ------------------------------------------------------------------ faults
    def abort(self) -> None:
        """Abort the communicator (bounded, from any thread): pending ops fail."""
        self.comm.abort("aborted through its torch process group")

    def shutdown(self) -> None:
        """Close the communicator if this group owns it (``dist.destroy_process_group``)."""
        close, self._close = self._close, None
        if close is not None:
            close(self.comm)
        if self._relay is not None:
            self._relay.shutdown(wait=False)
