"""What a communicator keeps for diagnosis, behind a few narrow hooks.

:class:`Diagnostics` bundles the flight recorder (always on), the optional
fingerprint checker (``check="fingerprint"``) and the optional ``trace_dir``. It
extends the op path's :class:`~asynccoll._core.interfaces.DiagnosticHooks`, so the
communicator reaches it at these points only:

* issue, refusal and settle: the ledger writes the recorder
  (``issued``/``discard``/``ended``/``failed``) with the outcome it settles;
* object collectives: ``gate_object(...)`` holds them for the checker;
* abort: ``aborted(error)`` after the pending Works were failed: writes
  ``<comm>.rank<R>.flight.json`` when ``trace_dir`` is set;
* close: ``closed()`` (off the loop): writes ``<comm>.rank<R>.trace.json``.

``<comm>`` names the communicator (``trace.CommName``, agreed by its ranks at creation):
files of communicators that share a ``trace_dir`` never collide.

The checker needs no call site for tensor ops: it wraps the backends
(:meth:`FingerprintChecker.wrap`).
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Callable

from .._base.recorder import DEFAULT_CAPACITY, FlightRecorder
from .._core.interfaces import DiagnosticHooks
from .._core.work import Work
from . import trace

if TYPE_CHECKING:
    from .fingerprint import FingerprintChecker


class Diagnostics(DiagnosticHooks):
    """Flight recorder, fingerprint checker and trace files of one communicator."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        backend: str,
        trace_dir: str | os.PathLike[str] | None = None,
        checker: FingerprintChecker | None = None,
        capacity: int = DEFAULT_CAPACITY,
        name: trace.CommName | None = None,
    ) -> None:
        """``name``: the communicator's name in ``trace_dir`` (a new one if None)."""
        super().__init__(FlightRecorder(capacity))
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.trace_dir = trace_dir
        self.checker = checker
        self.name = name if name is not None else trace.CommName(trace.new_comm_id(), time.time())
        self._dumped = False

    def gate_object(self, op: str, root: int, work: Work, run: Callable[[], None]) -> None:
        """Start an object collective, with the checker once every rank's fingerprint agrees."""
        if self.checker is None:
            run()
        else:
            self.checker.gate_object(op, root, work, run)

    def settle(self, cause: BaseException | None = None) -> None:
        """Before a peer's news ``cause`` aborts the communicator: the checker decides what
        the news and the fingerprints already sent to this rank decide (a mismatch then
        raises ``CollectiveMismatch`` here too, not the news of the peer that found it
        first), and applies every verdict taken so far (``FingerprintChecker.settle``)."""
        if self.checker is not None:
            self.checker.settle(cause)

    def aborted(self, error: BaseException) -> None:
        """The communicator aborted: write this rank's flight record (``trace_dir``)."""
        if self.trace_dir is None or self._dumped:
            return
        self._dumped = True
        try:
            trace.write_flight_record(
                self.trace_dir,
                comm=self.name,
                rank=self.rank,
                world_size=self.world_size,
                backend=self.backend,
                records=self.recorder.snapshot(),
                reason=error,
                waiting=self.checker.waiting() if self.checker is not None else None,
            )
        except OSError as exc:  # a diagnostic must not turn an abort into a crash
            print(
                f"asynccoll: could not write the flight record to {self.trace_dir}: {exc}",
                file=sys.stderr,
            )

    def closed(self) -> None:
        """The communicator closed: write this rank's timeline (``trace_dir``). Blocking I/O."""
        if self.trace_dir is None:
            return
        try:
            trace.write_timeline(
                self.trace_dir,
                comm=self.name,
                rank=self.rank,
                world_size=self.world_size,
                backend=self.backend,
                records=self.recorder.snapshot(),
            )
        except OSError as exc:
            print(
                f"asynccoll: could not write the timeline to {self.trace_dir}: {exc}",
                file=sys.stderr,
            )
