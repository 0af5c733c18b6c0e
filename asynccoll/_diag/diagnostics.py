"""What a communicator keeps for diagnosis (API.md §6), behind a few narrow hooks.

:class:`Diagnostics` bundles the flight recorder (always on), the optional
fingerprint checker (``check="fingerprint"``) and the optional ``trace_dir``. The
communicator calls it at five points only:

* issue — ``recorder.issued(seq, op, spec_or_None, t, batch=..., root=...)`` with its lock held;
* a refused op gives its seq back — ``recorder.discard(seq)``;
* settle — ``ended(work)`` from whichever thread settles the Work;
* abort — ``aborted(error)`` after the pending Works were failed: writes
  ``rank<R>.flight.json`` when ``trace_dir`` is set;
* close — ``closed()`` (off the loop): writes ``rank<R>.trace.json``.

The checker needs no call site for tensor ops: it wraps the backends
(:meth:`FingerprintChecker.wrap`). Object collectives are gated explicitly.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

from .._base.recorder import DEFAULT_CAPACITY, FlightRecorder, outcome
from .._core.work import _FAILED
from . import trace

if TYPE_CHECKING:
    from .._core.work import Work
    from .fingerprint import FingerprintChecker

now = time.time  # wall clock: the ranks' records line up in one timeline


class Diagnostics:
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
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.trace_dir = trace_dir
        self.checker = checker
        self.recorder = FlightRecorder(capacity)
        self._dumped = False

    def ended(self, work: Work) -> None:
        """Record how ``work`` ended (called once, when it settles)."""
        if work._state == _FAILED:
            state, error = outcome(work._value)
            self.recorder.ended(work.seq, state, now(), error)
        else:
            self.recorder.ended(work.seq, "done", now())

    def aborted(self, error: BaseException) -> None:
        """The communicator aborted: write this rank's flight record (``trace_dir``)."""
        if self.trace_dir is None or self._dumped:
            return
        self._dumped = True
        try:
            trace.write_flight_record(
                self.trace_dir, rank=self.rank, world_size=self.world_size, backend=self.backend,
                records=self.recorder.snapshot(), reason=error,
                waiting=self.checker.waiting() if self.checker is not None else None,
            )
        except OSError as exc:  # a diagnostic must not turn an abort into a crash
            print(f"asynccoll: could not write the flight record to {self.trace_dir}: {exc}", file=sys.stderr)

    def closed(self) -> None:
        """The communicator closed: write this rank's timeline (``trace_dir``). Blocking I/O."""
        if self.trace_dir is None:
            return
        try:
            trace.write_timeline(
                self.trace_dir, rank=self.rank, world_size=self.world_size, backend=self.backend,
                records=self.recorder.snapshot(),
            )
        except OSError as exc:
            print(f"asynccoll: could not write the timeline to {self.trace_dir}: {exc}", file=sys.stderr)

    def flight_record(self) -> list[dict[str, Any]]:
        """``comm.flight_record()``: the recorded ops, oldest first."""
        return self.recorder.snapshot()
