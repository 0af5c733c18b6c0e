"""Calling order is execution order for memory: the gate in front of a torch group.

Gloo runs queued ops on several threads, so two in-flight ops on the same memory
race (torch's own ``async_op=True`` does the same). NCCL does not: one stream per
communicator runs everything in issue order. :class:`MemoryGate` gives a torch-group
backend NCCL's answer without serializing independent ops:

* an op whose memory (input or output, as byte ranges) overlaps the memory of an
  earlier op still in flight is *held* until that op has finished — its wait, its
  fix-up (integer AVG's division) and its copy-back (a flattened batch's) included;
* every op called after a held op is held too, and held ops are issued in call
  order, so every rank issues the same ops in the same order (Gloo pairs ops across
  ranks by the order they were issued in);
* everything else is issued at once.

Invariant: the byte ranges of the ops in flight are pairwise disjoint (an op that
overlaps one in flight is held), so one ``bisect`` tells whether a range overlaps.
The gate issues under its lock, so no op called later can overtake a held one.
"""

from __future__ import annotations

import bisect
import collections
import threading
from typing import Any, Callable, Iterable, Sequence

import torch

from .._base.ops import OpSpec
from .._core.work import Bundle, Work

Span = tuple[int, int]


def _span(t: torch.Tensor) -> Span | None:
    """The bytes ``t`` covers, [lo, hi), or None when empty. Contiguous tensors (what
    ``validate`` lets through) cover exactly their bytes; anything else is given its
    whole storage, which over-serializes but never under-serializes."""
    n = t.nbytes
    if not n:
        return None
    if t.is_contiguous():
        lo = t.data_ptr()
        return lo, lo + n
    storage = t.untyped_storage()
    lo = storage.data_ptr()
    return lo, lo + storage.nbytes()


def spans(specs: Iterable[OpSpec]) -> list[Span]:
    """The byte ranges the ops of ``specs`` read or write, merged into disjoint ranges."""
    found: list[Span] = []
    for spec in specs:
        for t in (spec.tensor, spec.output):
            if t is not None:
                span = _span(t)
                if span is not None:
                    found.append(span)
    if len(found) < 2:
        return found
    found.sort()
    merged = [found[0]]
    for lo, hi in found[1:]:
        last_lo, last_hi = merged[-1]
        if lo < last_hi:
            if hi > last_hi:
                merged[-1] = (last_lo, hi)
        else:
            merged.append((lo, hi))
    return merged


class _Unit:
    """One call's ops (a single op, or a coalesced batch): its ranges and how many of
    its Works have yet to finish."""

    __slots__ = ("spans", "left")

    def __init__(self, spans: list[Span], left: int) -> None:
        self.spans = spans
        self.left = left


class MemoryGate:
    """Holds ops whose memory an op in flight touches (module docstring)."""

    def __init__(self) -> None:
        # Re-entrant: issuing a held op can settle ops on this thread (a Work someone already
        # awaits is checked when its backend attaches its queue), which comes back to :meth:`finished`.
        self._lock = threading.RLock()
        # The in-flight ranges, sorted by start (disjoint: see the module docstring).
        self._los: list[int] = []
        self._his: list[int] = []
        # id(Work) -> its call's unit, for every Work in flight.
        self._units: dict[int, _Unit] = {}
        # Calls held back, in call order: (ranges, works, issue, args).
        self._held: collections.deque[
            tuple[list[Span], Sequence[Work], Callable[..., None], tuple[Any, ...]]
        ] = collections.deque()
        self._closed = False

    def run(
        self, ranges: list[Span], works: Sequence[Work], issue: Callable[..., None], *args: Any
    ) -> bool:
        """Call ``issue(*args)`` now and return True, or hold it and return False.

        ``works``: the Works ``issue`` starts; their ranges leave the gate when all
        of them finished (:meth:`finished`). An exception of ``issue`` propagates,
        and the call leaves nothing behind."""
        with self._lock:
            if self._held or self._overlaps(ranges):
                self._held.append((ranges, works, issue, args))
                return False
            unit = self._enter(ranges, works)
            try:
                issue(*args)
            except BaseException:
                self._leave(unit, works)
                raise
            return True

    def finished(
        self, targets: Iterable[Work | Bundle]
    ) -> list[tuple[Sequence[Work], BaseException]]:
        """These settled: their ranges leave the gate, and the held calls that can go
        now are issued, in order. Returns the held calls whose issue raised, with the
        exception (their Works must fail: the peers may have issued them)."""
        units = self._units
        if not units:
            return []
        failed: list[tuple[Sequence[Work], BaseException]] = []
        with self._lock:
            for target in targets:
                for work in (target,) if type(target) is not Bundle else target.works:
                    unit = units.pop(id(work), None)
                    if unit is not None:
                        unit.left -= 1
                        if not unit.left:
                            self._remove(unit.spans)
            held = self._held
            while held and not self._closed:
                ranges, works, issue, args = held[0]
                if self._overlaps(ranges):
                    break
                held.popleft()
                unit = self._enter(ranges, works)
                try:
                    issue(*args)
                except Exception as exc:  # noqa: BLE001 - handed back: the caller fails these Works
                    self._leave(unit, works)
                    failed.append((works, exc))
        return failed

    @property
    def holding(self) -> int:
        """Calls held back now."""
        return len(self._held)

    def close(self) -> None:
        """Drop every held call and range (the communicator aborted: its Works failed)."""
        with self._lock:
            self._closed = True
            self._held.clear()
            self._units.clear()
            self._los.clear()
            self._his.clear()

    # -- under the lock ------------------------------------------------------
    def _overlaps(self, ranges: list[Span]) -> bool:
        los, his = self._los, self._his
        if not los:
            return False
        for lo, hi in ranges:
            i = bisect.bisect_left(los, hi)
            if i and his[i - 1] > lo:
                return True
        return False

    def _enter(self, ranges: list[Span], works: Sequence[Work]) -> _Unit | None:
        if not ranges:
            return None
        unit = _Unit(ranges, len(works))
        for work in works:
            self._units[id(work)] = unit
        los, his = self._los, self._his
        for lo, hi in ranges:
            i = bisect.bisect_left(los, lo)
            los.insert(i, lo)
            his.insert(i, hi)
        return unit

    def _leave(self, unit: _Unit | None, works: Sequence[Work]) -> None:
        if unit is None:
            return
        for work in works:
            self._units.pop(id(work), None)
        self._remove(unit.spans)

    def _remove(self, ranges: list[Span]) -> None:
        los, his = self._los, self._his
        for lo, _ in ranges:
            i = bisect.bisect_left(los, lo)
            if i < len(los) and los[i] == lo:
                del los[i]
                del his[i]
