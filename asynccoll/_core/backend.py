"""The small interface every backend implements (Gloo, NCCL, a wrapped torch group).

A backend executes validated :class:`OpSpec` s for one kind of device. It must
never block the caller of :meth:`submit`, and it reports each outcome exactly once,
from any thread, to the :class:`Sink` it was bound to (the communicator's ledger):
``sink.succeed(target)`` or ``sink.fail(target, exc)``, with ``exc`` already in the
contract's family (``errors.py``) and the backend's original error as ``__cause__``.
A failure makes the communicator abort, so a backend does not abort itself on
errors. Backends never touch Work internals. *When* an outcome is collected is the
completion protocol (:class:`Completion`, ``completion.py``): each backend queue
attaches one to the Works it submits, so that whoever asks about or waits on a Work
has the queue settle what finished, or watch for what has not.

What a backend can do is declared on it, with the defaults below, never discovered
with ``hasattr``: :attr:`Backend.caps` (:class:`Capabilities`: the dtypes it moves
and reduces, which ``validate.py`` asks), :attr:`Backend.device`, :attr:`Backend.census` (used by a
backend whose transport errors do not name the failed peer) and
:meth:`Backend.shrink_agreed` (a native shrink) and :meth:`Backend.grow_agreed` (a
native grow). A wrapper forwards each of them explicitly.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import torch

from .._base.ops import OpSpec, ReduceOp
from .completion import Completion as Completion
from .work import Bundle, Work

#: What a backend settles through its :class:`Sink`: one Work, or a Bundle of them.
Target = Work | Bundle


def dtypes(*names: str) -> frozenset[torch.dtype]:
    """The torch dtypes of these names that this torch build has."""
    return frozenset(
        getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype)
    )


def dtype_names(dts: frozenset[torch.dtype]) -> str:
    """``dts`` for a message: sorted names without ``torch.``."""
    return ", ".join(sorted(str(d).replace("torch.", "") for d in dts))


class Capabilities(Protocol):
    """What ``validate.py`` asks of a backend's :attr:`Backend.caps` (see :class:`Caps`).

    :class:`Caps` is the plain table; a backend may declare a richer object of the same
    shape (NCCL's depends on the device's compute capability).
    """

    @property
    def name(self) -> str: ...

    @property
    def move(self) -> frozenset[torch.dtype] | None: ...

    @property
    def as_bytes(self) -> bool: ...

    @property
    def reduce(self) -> Mapping[ReduceOp, frozenset[torch.dtype]] | None: ...

    @property
    def sum(self) -> frozenset[torch.dtype] | None: ...

    @property
    def any_source(self) -> bool: ...

    @property
    def text(self) -> Mapping[ReduceOp, str]: ...


class Caps:
    """What one backend can run (its capability table; ``validate.py`` asks it).

    ``move``: dtypes that data-movement ops (broadcast, all_gather, all_to_all,
    gather, scatter, send, recv) carry natively; ``None`` means any. Other dtypes
    travel as their bytes (a flat ``uint8`` view) when ``as_bytes`` is set.
    ``reduce``: per reduce op, the dtypes that reductions accept; ``None`` means
    any (a wrapped group of unknown kind: torch checks at the call).
    ``name`` is the backend's, for messages. ``any_source``: it can receive from
    whichever peer sends first (``Communicator.recv_any``).
    """

    __slots__ = ("any_source", "as_bytes", "move", "name", "reduce", "sum", "text")

    def __init__(
        self,
        name: str,
        move: frozenset[torch.dtype] | None,
        as_bytes: bool,
        reduce: Mapping[ReduceOp, frozenset[torch.dtype]] | None,
        *,
        any_source: bool = False,
    ) -> None:
        self.name = name
        self.any_source = any_source
        self.move = move
        self.as_bytes = as_bytes
        self.reduce = dict(reduce) if reduce is not None else None
        #: ``reduce[SUM]``, looked up without hashing the enum (the hot path).
        self.sum = self.reduce[ReduceOp.SUM] if self.reduce is not None else None
        self.text = {op: dtype_names(dts) for op, dts in (reduce or {}).items()}


#: A backend that declares no table: anything goes here, the library it calls checks.
ANY = Caps("torch", move=None, as_bytes=False, reduce=None)


class Sink(Protocol):
    """Where a backend reports outcomes (implemented by ``ledger.Ledger``)."""

    def succeed(self, target: Target, value: Any = None) -> None: ...

    def succeed_all(self, targets: Iterable[Target]) -> None: ...

    def fail(self, target: Target, exc: BaseException) -> None: ...


class Backend(abc.ABC):
    """Runs operations for one device type (``"cpu"`` or ``"cuda"``)."""

    #: Short name shown in ``comm.backend`` and errors ("gloo", "nccl", "torch").
    name: str = ""
    #: The tensor device type this backend serves; ``None`` serves any device.
    device_type: str | None = None
    #: What it can run: dtypes per reduce op and the dtypes it moves (``validate.py``).
    caps: Capabilities = ANY
    #: The one device its tensors live on (NCCL: its CUDA device); None: not tied to one.
    device: torch.device | None = None
    #: Names the failed ranks after a transport error that does not say which (Gloo's
    #: closed connection); set by the communicator when liveness runs, else None.
    census: Callable[[], tuple[int, ...]] | None = None
    #: Where outcomes go; set once by the communicator through :meth:`bind`.
    sink: Sink

    def bind(self, sink: Sink) -> None:
        """Report outcomes to ``sink`` from now on (called once, before any submit)."""
        self.sink = sink

    @abc.abstractmethod
    def submit(self, spec: OpSpec, work: Work | Bundle) -> None:
        """Start ``spec`` now, in call order; report its outcome to the sink.

        May raise ``InvalidArgument`` synchronously for input the backend cannot
        run; nothing must have been started in that case.
        """

    def submit_batch(self, specs: Sequence[OpSpec], works: Sequence[Work]) -> None:
        """Start a coalesced batch. Default: each op in order."""
        for spec, work in zip(specs, works):
            self.submit(spec, work)

    @abc.abstractmethod
    def abort(self) -> None:
        """Stop using the transport at once: bounded, non-blocking, idempotent.

        Pending Works have already been failed by the ledger, which ignores any
        success reported afterwards.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources after all Works settled. May block briefly; runs off the loop."""

    def release(self) -> None:
        """The communicator was garbage-collected: stop threads, never block. Default: abort."""
        self.abort()

    def shrink_agreed(
        self,
        store: Any,
        new_rank: int,
        new_size: int,
        exclude: Sequence[int],
        abort_pending: bool | None,
        timeout: float,
    ) -> Backend | None:
        """The survivors' backend made from this one by a native shrink (NCCL's
        ``ncclCommShrink``) when every survivor can, else None: the bootstrap builds a
        fresh one. Blocking; runs off the loop. Default: None (no native shrink)."""
        return None

    def split(self, color: int | None, rank: int, size: int, timeout: float) -> Backend | None:
        """Every rank of a split calls it once the ranks agreed on the lists: the backend
        of this rank's group (``color``: the group's index, None for a rank in none; this
        rank is ``rank`` of ``size`` there) made from this one by a native split (NCCL's
        ``ncclCommSplit``, a collective of every rank), else None: the bootstrap builds a
        fresh one. Blocking; runs off the loop. Default: None (no native split)."""
        return None

    def grow_agreed(self, store: Any, new_size: int, timeout: float) -> Backend | None:
        """Every member of a grow calls it: the grown group's backend of ``new_size`` ranks
        made from this one by a native grow (NCCL's ``ncclCommGrow``; this rank keeps its
        number) when every member can, else None: everyone builds a fresh one. The new
        ranks meet it through ``Factories.nccl_join`` on the same ``store``. Blocking;
        runs off the loop. Default: None (no native grow)."""
        return None
