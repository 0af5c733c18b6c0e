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
The gate issues under its lock, so no op called later can overtake a held one. The
completion thread reports finished ops without the lock while nothing is held (the
caller's next call absorbs them), so it never queues behind a caller issuing.
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

    #: Reports of finished ops left for the caller beyond which the completion thread
    #: absorbs them itself (they keep their Works alive until absorbed).
    absorb_after = 64

    def __init__(self, refused: Callable[[Sequence[Work], BaseException], None]) -> None:
        """``refused(works, exc)``: a held call whose issue raised when its turn came
        (called on whichever thread issued it, outside the lock). Its Works must fail:
        the peers may have issued it."""
        # Re-entrant: issuing a held op can settle ops on this thread (a Work someone
        # already awaits is checked when its backend attaches its queue), which comes
        # back to :meth:`finished`.
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
        # What finished and has not left the gate yet, appended without the lock (see
        # :meth:`finished`): the caller's next :meth:`run` absorbs it under the lock.
        self._done: collections.deque[Sequence[Work | Bundle]] = collections.deque()
        self._closed = False
        self._refused = refused

    def run(
        self, ranges: list[Span], works: Sequence[Work], issue: Callable[..., None], *args: Any
    ) -> bool:
        """Call ``issue(*args)`` now and return True, or hold it and return False.

        ``works``: the Works ``issue`` starts; their ranges leave the gate when all
        of them finished (:meth:`finished`). An exception of ``issue`` propagates,
        and the call leaves nothing behind."""
        with self._lock:
            self._absorb()
            if not self._held and not self._overlaps(ranges):
                unit = self._enter(ranges, works)
                try:
                    issue(*args)
                except BaseException:
                    self._leave(unit, works)
                    raise
                return True
            self._held.append((ranges, works, issue, args))
            # What finished since the absorb above may have been reported by a thread
            # that saw nothing held yet and so left it here: let it go now.
            self._absorb()
            refused = self._issue_held()
        self._refuse(refused)
        return False

    def finished(self, targets: Sequence[Work | Bundle]) -> None:
        """These settled: their ranges leave the gate, and the held calls that can go
        now are issued, in order.

        Takes the lock only when calls are held (or much is left to absorb): the
        completion thread then never queues behind a caller issuing under the lock.
        Otherwise the caller's next :meth:`run` absorbs what finished. A call held
        after the check below absorbs it itself (:meth:`run`), so nothing is missed."""
        if not self._units:
            return
        done = self._done
        done.append(targets)
        if not self._held and len(done) < self.absorb_after:
            return
        with self._lock:
            self._absorb()
            refused = self._issue_held()
        self._refuse(refused)

    def _refuse(self, refused: list[tuple[Sequence[Work], BaseException]]) -> None:
        for works, exc in refused:
            self._refused(works, exc)

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
            self._done.clear()
            self._los.clear()
            self._his.clear()

    # -- under the lock ------------------------------------------------------
    def _absorb(self) -> None:
        """The ranges of the calls whose Works all finished leave the gate."""
        done, units = self._done, self._units
        while done:
            for target in done.popleft():
                for work in (target,) if type(target) is not Bundle else target.works:
                    unit = units.pop(id(work), None)
                    if unit is not None:
                        unit.left -= 1
                        if not unit.left:
                            self._remove(unit.spans)

    def _issue_held(self) -> list[tuple[Sequence[Work], BaseException]]:
        """Issue the held calls that can go now, in order; those whose issue raised."""
        failed: list[tuple[Sequence[Work], BaseException]] = []
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
