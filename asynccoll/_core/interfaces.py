"""Where the rooms above the op path plug into it: diagnostics, liveness and shrink.

``_core`` imports neither ``_diag`` nor ``_faults``. It says here what it needs of them,
and ``_bootstrap`` hands the implementations to the :class:`Communicator`:

* :class:`DiagnosticHooks`: the flight recorder, the gate of object collectives and the
  hooks at abort and close. The base class is what a communicator without
  diagnostics does (``wrap()``): it records, gates nothing and writes nothing;
  ``_diag.diagnostics.Diagnostics`` adds the fingerprint checker and the trace files.
* :class:`Membership`: a communicator's liveness (``_faults.liveness.Liveness``):
  heartbeats, the census that names failed peers, abort news. The creation publishes
  it (its store keys); the communicator starts it, giving it where failures go.
* :class:`ShrinkRequest`: what ``shrink`` (``_faults.shrink``) needs of a communicator.
* :class:`Elastic`: a named group's membership changes (``_bootstrap.elastic.Group``):
  ``waiting()`` and ``grow()``.
* :class:`Splitting`: how a communicator makes subgroups (``_bootstrap.split.Splitter``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Awaitable, Callable, Protocol

from .._base.recorder import FlightRecorder
from .work import Work


class DiagnosticHooks:
    """What a communicator tells diagnostics; this base records and does nothing more."""

    def __init__(self, recorder: FlightRecorder | None = None) -> None:
        #: Every op's issue and outcome, written by the ledger.
        self.recorder = recorder if recorder is not None else FlightRecorder()

    def gate_object(self, op: str, root: int, work: Work, run: Callable[[], None]) -> None:
        """Start an object collective: ``run()`` now (a checker holds it until the peers agree)."""
        run()

    def settle(self, cause: BaseException | None = None) -> None:
        """A peer's failure or abort news ``cause`` is about to abort the communicator (any
        thread): decide now whatever it and what arrived already decide, so that an op a
        verdict was about raises that verdict rather than the news."""

    def aborted(self, error: BaseException) -> None:
        """The communicator aborted (its Works have failed); any thread, must not raise."""

    def closed(self) -> None:
        """The communicator closed; runs off the loop and may block briefly."""

    def flight_record(self) -> list[dict[str, Any]]:
        """``comm.flight_record()``: the recorded ops, oldest first."""
        return self.recorder.snapshot()


class Membership(Protocol):
    """A communicator's liveness (implemented by ``_faults.liveness.Liveness``)."""

    #: Whether the communicator has an op pending (set by its ``Resources``; read by the
    #: liveness service's thread).
    busy: Callable[[], bool]

    @property
    def census(self) -> Callable[[], tuple[int, ...]]:
        """Names the failed ranks after a transport error that does not say which."""

    @property
    def dead(self) -> tuple[int, ...]:
        """Ranks known to have failed."""

    def start(self, on_failure: Callable[[BaseException], None]) -> None:
        """Begin beating (never blocks: the creation published the keys); failures go
        to ``on_failure``."""

    def stop(self) -> None:
        """Leave (never blocks): the goodbye is written by the service."""

    def goodbye(self) -> None:
        """``close()``: say goodbye now (blocking, bounded), then leave."""

    def publish_abort(self, error: BaseException, *, wake: bool = True) -> None:
        """Tell the other ranks this communicator aborted (never blocks). ``wake=False``:
        recorded now, sent by :meth:`wake` or at the next beat (within the beat interval)."""

    def wake(self) -> None:
        """Send the news that ``publish_abort(..., wake=False)`` recorded now (never blocks)."""

    def record(self) -> tuple[int, ...] | None:
        """The failed set every survivor agreed on, or None (blocking: store reads)."""

    def probe(self, ranks: list[int]) -> tuple[int, ...]:
        """Which of ``ranks`` failed, on proof (blocking, bounded)."""

    def gone_silently(self) -> tuple[int, ...]:
        """The other ranks proven dead that never said goodbye (blocking, bounded)."""

    def failure(self) -> BaseException | None:
        """The error for an operation that needs the store when the store is gone, else None."""

    def failure_among(self, ranks: list[int]) -> BaseException | None:
        """For an operation waiting on ``ranks`` through the store: the error to fail it with
        once one of them is proven dead or the store is gone; None while they may still come."""

    def hold(self) -> None:
        """Keep answering the peers' census while the communicator is rebuilt."""

    def release(self) -> None:
        """Undo one :meth:`hold`."""


@dataclasses.dataclass(frozen=True)
class ShrinkRequest:
    """What ``shrink`` needs of a communicator (``Communicator.shrink`` hands it over)."""

    rank: int
    world_size: int
    timeout: float
    backend: str
    state: str
    failed_ranks: tuple[int, ...]
    store: Any
    liveness: Membership | None
    #: ``build_shrunk(new_rank, new_size, suffix, failed=, excluded=)``: the new communicator
    #: (made by ``_bootstrap``); None for a communicator that ``wrap()`` made.
    build_shrunk: Callable[..., Awaitable[Any]] | None
    abort: Callable[[str], None]
    #: Marks the communicator shrunk (once valid arguments are known).
    claim: Callable[[], None]
    #: ``retire(dead, keys)``, blocking: the survivors' communicator is up; the old one
    #: leaves the store and its keys are forgotten (``Resources.retire``).
    retire: Callable[[tuple[int, ...], tuple[str, ...]], None]


class Elastic(Protocol):
    """A named group (implemented by ``_bootstrap.elastic.Group``): ``waiting()`` and ``grow()``."""

    @property
    def name(self) -> str:
        """The group's name (``ac.init(..., name=)``)."""

    async def waiting(self, comm: Any, timeout: float | None) -> int:
        """``comm.waiting()`` (``comm``: the Communicator): how many processes wait in
        ``ac.join``, agreed by the members."""

    async def grow(self, comm: Any, world_size: Any, timeout: float | None) -> Any:
        """``comm.grow(world_size)``: the Communicator of the members and the admitted joiners."""


class Splitting(Protocol):
    """How a communicator made by ``init`` makes subgroups (``_bootstrap.split.Splitter``)."""

    async def split(
        self,
        comm: Any,
        groups: Any,
        timeout: float | None,
        watch: Callable[[list[int]], BaseException | None] | None,
    ) -> Any:
        """``comm.split(groups)`` (``comm``: the Communicator): this rank's subgroup, or None.
        ``watch``: the communicator's ``Membership.failure_among`` (None without liveness)."""
