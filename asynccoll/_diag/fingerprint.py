"""``check="fingerprint"``: every operation is compared across ranks before it reaches the backend.

Why before: Gloo does not survive most mismatches. An all_reduce of different sizes
SIGABRTs the process, a dtype, reduce-op or broadcast-size mismatch returns garbage,
and ops issued in a different order hang. So each op is *held* until the peers'
fingerprints for it have arrived and agree; only then is it submitted.

Fingerprints travel on a side channel of their own (``mesh.py``): a full mesh of
small TCP connections set up at ``init`` (addresses and a per-rank token exchanged
through the communicator's store), one reader thread per communicator. The issuing
thread writes its fingerprint to the peers at once (a non-blocking send; a full
socket buffer spills into an outbox drained by the reader thread). In the common case a
rank that issues an op *last* already holds every peer's fingerprint and submits
in the issuing call; the others submit from the reader thread as soon as the last
fingerprint arrives. The cost is one one-way message plus a thread wake-up on the
critical path of the rank that issued first (see ``bench/check.py``).

What is compared (``mismatch.FIELDS``), per matching unit:

* collectives, object collectives and coalesced batches share one counter: the
  k-th of them on every rank must have the same op, dtype, shape, root and reduce
  op (a batch: the same list of members, compared as a whole);
* point-to-point ops are matched per direction and peer, as Gloo matches them: the
  k-th send from a to b against b's k-th recv from a (dtype and element count).

A difference fails the op with :class:`CollectiveMismatch` on every rank (each rank
sees every fingerprint of the units it takes part in, so each reaches the same
verdict), which aborts the communicator; later ops raise ``CommAborted`` caused by
it. A rank whose own verdict is late (a peer's fingerprint still on its way, or its
verdict taken and not yet applied) may hear the news of the peer that decided first:
the news carries the mismatch whole, and :meth:`FingerprintChecker.settle` raises it
as this rank's own. A peer whose channel closes before sending a fingerprint that an
op waits for fails that op with ``PeerFailure`` naming it. The op's deadline still bounds the
wait for a peer that is alive but never issues the op.

Scope: backends that submit from any thread (Gloo, wrapped torch groups) and object
collectives. The NCCL backend is not wrapped yet: its ``submit`` records the
caller's current CUDA stream, which only the issuing thread knows; checking it needs
that capture split from the launch (capture at issue, launch after the check).
"""

from __future__ import annotations

import collections
import socket
import threading
from typing import Any, Callable, Literal, Sequence

from .._base.errors import CollectiveMismatch, CommAborted, InvalidArgument, PeerFailure
from .._base.ops import ANY_SOURCE, OpKind, OpSpec
from .._core.backend import Backend, Sink
from .._core.work import Bundle, Work
from . import mesh
from .mismatch import MEMBERS as _MEM
from .mismatch import P2P as _P2P
from .mismatch import fingerprint, for_rank, mismatch, object_fingerprint

#: How long ``settle`` waits for verdicts another thread is applying (they take
#: milliseconds; the bound only keeps a bug from hanging the liveness service).
_APPLY_WAIT = 10.0


# ---------------------------------------------------------------- the checker
class _Entry:
    """One held unit: its requirements (tag, index, peers, fingerprint), how to submit it."""

    __slots__ = ("reqs", "submit", "works", "seq", "what")

    def __init__(
        self,
        reqs: list[tuple[str, int, tuple[int, ...], str]],
        submit: Callable[[], None],
        works: Sequence[Work],
        seq: int,
        what: str | None,
    ) -> None:
        self.reqs = reqs
        self.submit = submit
        self.works = works
        self.seq = seq
        self.what = what


# What a peer sends for each of my requirement tags: my collective k needs their
# collective k; my send k to q needs q's recv k from me; my recv needs q's send.
_NEEDS = {"C": "C", "S": "R", "R": "S"}


class FingerprintChecker:
    """The held ops of one communicator and their verdicts (module docstring); the side
    channel is a :class:`mesh.Mesh`."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        outgoing: dict[int, socket.socket],
        incoming: dict[int, socket.socket],
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self._coll = 0
        self._sends: dict[int, int] = collections.defaultdict(int)
        self._recvs: dict[int, int] = collections.defaultdict(int)
        self._queues: dict[Any, collections.deque[_Entry]] = {}
        self._closed = False
        self._held_at_close: list[dict[str, Any]] = []  # what ``waiting()`` says once closed
        self._broken = False  # a verdict failed: submit nothing more (the abort follows)
        # Verdicts reached in an issuing thread (which holds the communicator's
        # lock): failed by the reader thread, since failing aborts the communicator.
        self._fail_later: list[tuple[Sequence[Work], BaseException]] = []
        # The side channel; its lock guards this checker's state too, its inbox holds
        # the peers' fingerprints, and its reader thread calls frames_arrived().
        self._mesh = channel = mesh.Mesh(rank, outgoing, incoming, self)
        self._peers = channel.peers
        self._lock = channel.lock
        self._inbox = channel.inbox
        self._gone = channel.gone
        # Verdicts taken under the lock and being applied outside it (``_fail``), and
        # the threads applying them: ``settle`` waits until they are out.
        self._applied = threading.Condition(self._lock)
        self._applying: collections.Counter[int] = collections.Counter()
        channel.start()

    # ------------------------------------------------------------ setup
    @classmethod
    def connect(
        cls, store: Any, rank: int, world_size: int, timeout: float, host: str | None = None
    ) -> FingerprintChecker:
        """Build the side channel through ``store`` (blocking, bounded by ``timeout``; run off the loop)."""
        return cls(rank, world_size, *mesh.connect(store, rank, world_size, timeout, host))

    def wrap(self, backend: Backend) -> Backend:
        """``backend`` with every submission held until its fingerprints agree."""
        return CheckedBackend(backend, self)

    #: Where failures go: the communicator's ledger (set when the wrapped backend is bound).
    sink: Sink | None = None

    def _taking(self, failures: list[tuple[Sequence[Work], BaseException]]) -> None:
        """``failures`` were taken (lock held): this thread applies them with ``_fail``."""
        if failures:
            self._applying[threading.get_ident()] += 1

    def _fail(self, failures: list[tuple[Sequence[Work], BaseException]]) -> None:
        """Fail each unit's Works (outside every lock: failing aborts the communicator);
        then they are applied (see ``settle``)."""
        if not failures:
            return
        try:
            sink = self.sink
            if sink is not None:
                for works, exc in failures:
                    sink.fail(
                        works[0] if len(works) == 1 else Bundle(list(works), works[0].op), exc
                    )
        finally:
            with self._applied:
                self._applying -= collections.Counter({threading.get_ident(): 1})
                self._applied.notify_all()

    # ------------------------------------------------------------ issue side
    def gate_op(self, spec: OpSpec, work: Work, submit: Callable[[], None]) -> None:
        kind = spec.kind
        if kind is OpKind.SEND or kind is OpKind.RECV:
            self._gate_p2p(
                kind is OpKind.SEND, spec.peer, fingerprint(spec), submit, [work], work.seq
            )
        else:
            self._gate(fingerprint(spec), (), submit, [work], work.seq, None)

    def gate_batch(
        self, specs: Sequence[OpSpec], works: Sequence[Work], submit: Callable[[], None]
    ) -> None:
        coll = [fingerprint(s) for s in specs if s.kind not in _P2P]
        p2p = [
            (s.kind is OpKind.SEND, s.peer, fingerprint(s), w.seq)
            for s, w in zip(specs, works)
            if s.kind in _P2P
        ]
        self._gate(_MEM.join(coll) if coll else None, p2p, submit, works, works[0].seq, None)

    def gate_object(self, op: str, root: int, work: Work, submit: Callable[[], None]) -> None:
        self._gate(object_fingerprint(op, root), (), submit, [work], work.seq, None)

    def _gate_p2p(
        self,
        is_send: bool,
        peer: int,
        fp: str,
        submit: Callable[[], None],
        works: Sequence[Work],
        seq: int,
    ) -> None:
        with self._lock:
            req = self._p2p_req(is_send, peer, fp, seq)
            self._enqueue(("S" if is_send else "R", peer), _Entry([req], submit, works, seq, None))

    def _p2p_req(
        self, is_send: bool, peer: int, fp: str, seq: int
    ) -> tuple[str, int, tuple[int, ...], str]:
        counters, tag = (self._sends, "S") if is_send else (self._recvs, "R")
        k = counters[peer] = counters[peer] + 1
        self._mesh.send((peer,), tag, k, seq, fp)
        return (tag, k, (peer,), fp)

    def _gate(
        self,
        fp: str | None,
        p2p: Any,
        submit: Callable[[], None],
        works: Sequence[Work],
        seq: int,
        what: str | None,
    ) -> None:
        with self._lock:
            reqs = []
            if fp is not None:
                k = self._coll = self._coll + 1
                self._mesh.send(self._peers, "C", k, seq, fp)
                reqs.append(("C", k, self._peers, fp))
            for is_send, peer, pfp, pseq in p2p:
                reqs.append(self._p2p_req(is_send, peer, pfp, pseq))
            self._enqueue("C", _Entry(reqs, submit, works, seq, what))

    def _enqueue(self, key: Any, entry: _Entry) -> None:
        """Queue ``entry`` (lock held); submit it here when it is first and already agreed."""
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = collections.deque()
        queue.append(entry)
        if len(queue) == 1 and not self._broken:
            verdict = self._verify(entry)
            if verdict is None:
                # The peers' fingerprints may sit in the kernel, not yet read by the
                # reader thread: take them now rather than wait for its wake-up.
                for p in {p for _t, _k, peers, _f in entry.reqs for p in peers}:
                    if p not in self._gone:
                        self._mesh.pull(p)
                verdict = self._verify(entry)
            if verdict is True:
                queue.popleft()
                entry.submit()  # an error here propagates to the caller, as without the check
            elif verdict is not None:
                queue.popleft()
                self._broken = True
                self._fail_later.append((entry.works, verdict))
                self._mesh.wake()

    # ------------------------------------------------------------ verdicts
    def _verify(self, entry: _Entry) -> Literal[True] | BaseException | None:
        """True: agreed (inbox entries consumed); None: still waiting; else the error."""
        inbox = self._inbox
        for tag, k, peers, _fp in entry.reqs:
            need = _NEEDS[tag]
            for p in peers:
                if (p, need, k) not in inbox:
                    if p in self._gone:
                        return PeerFailure(
                            f"seq {entry.seq}: rank {p} closed its fingerprint channel before issuing "
                            f"the matching operation",
                            [p],
                        )
                    return None
        error: BaseException | None = None
        for tag, k, peers, fp in entry.reqs:
            need = _NEEDS[tag]
            theirs = {p: inbox[(p, need, k)] for p in peers}
            if error is None and any(f != fp for _s, f in theirs.values()):
                seqs = {self.rank: entry.seq, **{p: s for p, (s, _f) in theirs.items()}}
                fps = {self.rank: fp, **{p: f for p, (_s, f) in theirs.items()}}
                what = None
                if tag != "C":
                    (p,) = peers
                    src, dst = (self.rank, p) if tag == "S" else (p, self.rank)
                    what = f"send/recv from rank {src} to rank {dst}"
                error = mismatch(seqs, fps, me=self.rank, what=entry.what or what)
            for p in peers:
                del inbox[(p, need, k)]
        return True if error is None else error

    def _drain(self) -> list[tuple[Sequence[Work], BaseException]]:
        """Submit or fail every queue head that can be decided (lock held)."""
        failures, self._fail_later = self._fail_later, []
        for queue in list(self._queues.values()):
            while queue and not self._broken and not self._closed:
                entry = queue[0]
                verdict = self._verify(entry)
                if verdict is None:
                    break
                queue.popleft()
                if verdict is True:
                    try:
                        entry.submit()
                    except Exception as exc:  # noqa: BLE001 - reported on the Work: its caller is gone
                        failures.append((entry.works, exc))
                        self._broken = True
                else:
                    failures.append((entry.works, verdict))
                    self._broken = True
        return failures

    def waiting(self) -> list[dict[str, Any]]:
        """Held ops and the ranks whose fingerprints they wait for (for trace files);
        after ``close()``, those it held when it closed: an abort's flight record may
        be written after the woken caller closed the communicator."""
        with self._lock:
            return list(self._held_at_close) if self._closed else self._waiting()

    def _waiting(self) -> list[dict[str, Any]]:
        out = []
        for queue in self._queues.values():
            for entry in queue:
                missing = sorted(
                    {
                        p
                        for tag, k, peers, _ in entry.reqs
                        for p in peers
                        if (p, _NEEDS[tag], k) not in self._inbox
                    }
                )
                out.append(
                    {"seq": entry.seq, "ops": [w.op for w in entry.works], "waiting_for": missing}
                )
        return out

    # ------------------------------------------------------------ the mesh's calls
    def frames_arrived(self) -> None:
        """Reader thread: submit or fail what the peers' new fingerprints decide."""
        if self._closed:
            return
        with self._lock:
            failures = self._drain()
            self._taking(failures)
        self._fail(failures)

    def settle(self, cause: BaseException | None = None) -> None:
        """A peer's failure or abort news ``cause`` is about to abort the communicator (any
        thread; see ``Diagnostics.settle``): decide now what it and the fingerprints decide,
        and return once every verdict taken so far has failed its Works.

        * A peer's :class:`CollectiveMismatch` (its news carries it whole) fails the unit it
          names on this rank with the same mismatch, this rank's seq: this rank's own
          verdict may never come (the peer's fingerprint still sat in its outbox when it
          aborted, or its channel closed first).
        * Otherwise, what the kernel already holds is read and decided: a peer that reached
          a verdict sent its fingerprint before it aborted.
        * A verdict another thread took and is still applying (the reader thread, between
          ``_drain`` and ``_fail``) is waited for: the news must not fail its Works first.
        """
        with self._lock:
            if self._closed:
                return
            failures: list[tuple[Sequence[Work], BaseException]] = []
            if isinstance(cause, CollectiveMismatch) and not self._broken:
                entry = self._named(cause)
                if entry is not None:
                    self._broken = True
                    failures.append((entry.works, for_rank(cause, self.rank)))
            if not self._broken:
                for p in self._peers:
                    if p not in self._gone:
                        self._mesh.pull(p, everything=True)
            failures += self._drain()
            self._taking(failures)
        self._fail(failures)
        me = threading.get_ident()
        with self._applied:
            self._applied.wait_for(
                lambda: not +self._applying or self._applying[me] > 0, _APPLY_WAIT
            )

    def _named(self, peer: CollectiveMismatch) -> _Entry | None:
        """The held unit of this rank that a peer's mismatch names, taken off its queue
        (lock held). It names this rank's seq of the unit: a batch's first seq, or the seq
        of the batch's member that its p2p fingerprint carried."""
        detail = peer.details.get(self.rank)
        if not isinstance(detail, dict) or "seq" not in detail:
            return None
        seq = detail["seq"]
        for queue in self._queues.values():
            for entry in queue:
                if entry.seq == seq or any(w.seq == seq for w in entry.works):
                    queue.remove(entry)
                    return entry
        return None

    def crashed(self, exc: Exception) -> None:
        """The reader thread failed: held ops must not hang silently."""
        with self._lock:
            self._broken = True
            held = [e for q in self._queues.values() for e in q]
            self._queues.clear()
            err = CommAborted(f"fingerprint channel failed: {exc!r}")
            err.__cause__ = exc
            failures: list[tuple[Sequence[Work], BaseException]] = [(e.works, err) for e in held]
            self._taking(failures)
        self._fail(failures)

    def close(self) -> None:
        """Stop the side channel and drop held ops (their Works were failed by the
        communicator). Idempotent, never blocks."""
        with self._lock:
            if self._closed:
                return
            self._held_at_close = self._waiting()
            self._closed = True
            self._queues.clear()
        self._mesh.close()


class CheckedBackend(Backend):
    """A backend whose submissions wait for the fingerprint check (see ``FingerprintChecker``).

    Every declared attribute of :class:`Backend` is forwarded explicitly: what the
    inner backend can run and serves, its census, its native shrink, its release.
    """

    def __init__(self, inner: Backend, checker: FingerprintChecker) -> None:
        self._inner = inner
        self._checker = checker
        self.name = inner.name
        self.device_type = inner.device_type
        self.caps = inner.caps
        self.device = inner.device

    @property
    def census(self) -> Callable[[], tuple[int, ...]] | None:
        return self._inner.census

    @census.setter
    def census(self, fn: Callable[[], tuple[int, ...]] | None) -> None:
        self._inner.census = fn

    def bind(self, sink: Sink) -> None:
        self.sink = sink
        self._checker.sink = sink
        self._inner.bind(sink)

    def submit(self, spec: OpSpec, work: Work | Bundle) -> None:
        assert isinstance(work, Work)  # the communicator submits Works; Bundles exist below
        if spec.peer == ANY_SOURCE and spec.kind is OpKind.RECV:
            raise InvalidArgument(
                'recv_any: check="fingerprint" compares each receive with its named '
                "peer's send; name the source (recv(tensor, src))"
            )
        inner = self._inner
        self._checker.gate_op(spec, work, lambda: inner.submit(spec, work))

    def submit_batch(self, specs: Sequence[OpSpec], works: Sequence[Work]) -> None:
        inner = self._inner
        self._checker.gate_batch(specs, works, lambda: inner.submit_batch(specs, works))

    def abort(self) -> None:
        self._checker.close()
        self._inner.abort()

    def close(self) -> None:
        self._checker.close()
        self._inner.close()

    def release(self) -> None:
        self._checker.close()
        self._inner.release()

    def shrink_agreed(
        self,
        store: Any,
        new_rank: int,
        new_size: int,
        exclude: Sequence[int],
        abort_pending: bool | None,
        timeout: float,
    ) -> Backend | None:
        return self._inner.shrink_agreed(store, new_rank, new_size, exclude, abort_pending, timeout)

    def grow_agreed(self, store: Any, new_size: int, timeout: float) -> Backend | None:
        return self._inner.grow_agreed(store, new_size, timeout)
