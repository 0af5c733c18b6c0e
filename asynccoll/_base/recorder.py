"""Flight recorder: a bounded ring of the last operations a communicator issued.

``issued`` is called at issue time with the communicator's lock held and stores a
compact record (no tensor: dtype, shape, peer/root, reduce op, batch); ``ended``
fills in the outcome from whichever thread settles the op. Both are O(1) and take
no lock of their own (list and dict operations are atomic under the GIL).
``snapshot`` turns the ring into plain dicts for ``comm.flight_record()``, the
trace files and ``python -m asynccoll.diagnose``.

Memory is bounded by ``capacity`` records: the ring is a ``deque(maxlen=...)``,
and the index of unsettled ops drops an op whose record leaves the ring.
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Any, Iterable, Sequence

from .errors import CollectiveMismatch, CollectiveTimeout, CommAborted, PeerFailure
from .ops import OpKind

#: Default ring size: enough for a training step of several thousand ops.
DEFAULT_CAPACITY = 4096

#: The recorder's clock: wall time, so that the ranks' records line up in one timeline.
now = time.time

# Record layout (a list, mutated once by ``ended``: _T1 and _ERROR, then _STATE, which a
# reader on another thread checks first: three index stores cost half a slice's).
_SEQ, _OP, _DTYPE, _SHAPE, _PEER, _REDUCE, _BATCH, _T0, _STATE, _T1, _ERROR, _CSEQ = range(12)
_P2P = ("send", "recv")
_SCATTER = OpKind.SCATTER
#: Batch members recorded one by one (``_record``): a p2p op moves the cseqs after it,
#: scatter's record reads its output; every other member's record is built in one pass.
_ONE_BY_ONE = frozenset(_P2P + ("scatter", "barrier"))


def outcome(error: BaseException | None) -> tuple[str, str | None]:
    """The recorded state for an op that ended with ``error`` (None: success)."""
    if error is None:
        return "done", None
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, CollectiveTimeout):
        return "timed out", text
    if isinstance(error, CollectiveMismatch):
        return "mismatch", text
    if isinstance(error, CommAborted) and not isinstance(error, PeerFailure):
        return "aborted", text
    return "failed", text


class FlightRecorder:
    """The last ``capacity`` ops of one communicator (see the module docstring)."""

    __slots__ = ("capacity", "_ring", "_open", "_append", "_p2p")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._ring: collections.deque[list[Any]] = collections.deque(maxlen=capacity)
        self._open: dict[int, list[Any]] = {}  # seq -> record of an unsettled op
        self._append = self._ring.append
        # Point-to-point ops issued so far: a collective's ``cseq`` (seq minus them) is
        # the same on every rank even when only some ranks exchanged p2p ops.
        self._p2p = 0

    def __len__(self) -> int:
        return len(self._ring)

    def issued(
        self, seq: int, op: str, spec: Any, t: float, batch: int | None = None, root: int = -1
    ) -> None:
        """Record op ``seq`` issued at wall time ``t``; ``spec`` is its OpSpec or None.

        ``batch``: the first member's seq when the op belongs to a coalesced batch;
        ``root``: the root of an op without a spec (``broadcast_object``).
        A seq at or below the newest recorded one was given back (a refused or
        discarded op) and is being reused: the stale records are dropped first.
        """
        ring = self._ring
        if ring and ring[-1][_SEQ] >= seq:
            self._rewind(seq)
        if len(ring) == self.capacity:
            old = ring[0]
            if old[_STATE] is None:
                self._open.pop(old[_SEQ], None)
        rec = self._record(seq, op, spec, t, batch, root)
        self._append(rec)
        self._open[seq] = rec

    def _record(
        self, seq: int, op: str, spec: Any, t: float, batch: int | None, root: int = -1
    ) -> list[Any]:
        """The open record of op ``seq`` (counting it among the point-to-point ops if it is one)."""
        if op in _P2P:
            self._p2p += 1
            cseq = None
        else:
            cseq = seq - self._p2p
        if spec is None:
            return [seq, op, None, None, root, None, batch, t, None, 0.0, None, cseq]
        # What every rank has (scatter: only the root has an input).
        tensor = spec.output if spec.kind is _SCATTER or spec.tensor is None else spec.tensor
        return [
            seq,
            op,
            None if tensor is None else tensor.dtype,
            None if tensor is None else tensor.shape,
            spec.peer,
            spec.reduce_op,
            batch,
            t,
            None,
            0.0,
            None,
            cseq,
        ]

    def issued_batch(
        self, works: Sequence[Any], specs: Sequence[Any], t: float, batch: int
    ) -> None:
        """Record a coalesced batch's members (``works``, running ``specs``), issued
        together at wall time ``t``; ``batch`` is the first member's seq.

        Members are recorded when their batch is issued, not at their calls: a batch
        whose body failed never reached the peers and leaves no record. Their seqs
        were taken at the calls, so an op another thread issued meanwhile may sit
        before them in the ring with a higher seq: no rewind here (a seq is reused
        only after ``discard``, which rewinds).
        """
        ring, append, opened, record = self._ring, self._append, self._open, self._record
        before = len(ring)
        evicted = before + len(works) - self.capacity  # the oldest records these push out
        if evicted > 0:
            for old in itertools.islice(ring, min(evicted, before)):
                if old[_STATE] is None:
                    opened.pop(old[_SEQ], None)
        if _ONE_BY_ONE.isdisjoint(
            [w.op for w in works]
        ):  # the common batch: _record's layout, inlined
            p2p = self._p2p
            records = [
                [
                    w.seq,
                    w.op,
                    s.tensor.dtype,
                    s.tensor.shape,
                    s.peer,
                    s.reduce_op,
                    batch,
                    t,
                    None,
                    0.0,
                    None,
                    w.seq - p2p,
                ]
                for w, s in zip(works, specs)
            ]
            ring.extend(records)
            for rec in records:
                opened[rec[_SEQ]] = rec
        else:
            for work, spec in zip(works, specs):
                rec = record(work.seq, work.op, spec, t, batch)
                append(rec)
                opened[work.seq] = rec
        if evicted > before:  # a batch longer than the ring: its first members are out already
            for work in works[: evicted - before]:
                opened.pop(work.seq, None)

    def _rewind(self, seq: int) -> None:
        ring = self._ring
        while ring and ring[-1][_SEQ] >= seq:
            rec = ring.pop()
            self._open.pop(rec[_SEQ], None)
            if rec[_CSEQ] is None:
                self._p2p -= 1

    def discard(self, seq: int) -> None:
        """Forget op ``seq`` (refused at the call; its seq is given back)."""
        if self._ring and self._ring[-1][_SEQ] >= seq:
            self._rewind(seq)

    def ended(self, seq: int, state: str, t: float, error: str | None = None) -> None:
        """Record the outcome of op ``seq`` (``"done"``, ``"failed"``, ``"timed out"``,
        ``"aborted"``, ``"mismatch"``, or ``"skipped"``: settled on this rank without
        reaching the peers, ``asynccoll.testing.skip_collective``) at wall time ``t``.
        The first outcome recorded stays."""
        self.ended_all((seq,), state, t, error)

    def ended_all(
        self, seqs: Iterable[int], state: str, t: float, error: str | None = None
    ) -> None:
        """:meth:`ended` for each of ``seqs`` (a coalesced batch's members, the Works an abort failed)."""
        for rec in map(self._open.pop, seqs, itertools.repeat(None)):
            if rec is not None:
                rec[_T1] = t
                rec[_ERROR] = error
                rec[_STATE] = state

    def failed(self, seq: int, error: BaseException, t: float) -> None:
        """Record that op ``seq`` failed with ``error`` (its state read from the error's type)."""
        state, text = outcome(error)
        self.ended(seq, state, t, text)

    def open_seqs(self) -> list[int]:
        """Seqs issued and not yet settled, oldest first."""
        return sorted(self._open)

    def snapshot(self) -> list[dict[str, Any]]:
        """The recorded ops, oldest first, as plain JSON-ready dicts."""
        while True:  # another thread may append meanwhile (the abort path reads it off the loop)
            try:
                records = list(self._ring)
                break
            except RuntimeError:  # "deque mutated during iteration": copy again
                continue
        return [_as_dict(rec) for rec in records]


def _as_dict(rec: list[Any]) -> dict[str, Any]:
    op = rec[_OP]
    shape = rec[_SHAPE]
    d: dict[str, Any] = {
        "seq": rec[_SEQ],
        "op": op,
        "dtype": None if rec[_DTYPE] is None else str(rec[_DTYPE]).replace("torch.", ""),
        "shape": None if shape is None else list(shape),
        "numel": None if shape is None else _numel(shape),
        "state": rec[_STATE] or "issued",
        "issued_at": rec[_T0],
        "ended_at": rec[_T1] if rec[_STATE] is not None else None,
    }
    peer = rec[_PEER]
    if peer is not None and peer >= 0:
        d["peer" if op in _P2P else "root"] = peer
    if rec[_REDUCE] is not None and op in ("all_reduce", "reduce", "reduce_scatter"):
        d["reduce_op"] = rec[_REDUCE].name
    if rec[_CSEQ] is not None:
        d["cseq"] = rec[_CSEQ]
    if rec[_BATCH] is not None:
        d["batch"] = rec[_BATCH]
    if rec[_ERROR] is not None:
        d["error"] = rec[_ERROR]
    return d


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
