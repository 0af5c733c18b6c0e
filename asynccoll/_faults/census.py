"""Who among a communicator's ranks is dead: what each published about its process,
proof, and the one answer every survivor gives.

:class:`Roster` reads the ``proc/<rank>`` entries the ranks published (see
``Liveness.publish``) and proves deaths with ``procs``: a process gone from this
machine's process table, or a pulse socket that refuses a connection (or a
machine that does not answer for the bound). A live process is never named,
whether or not it gets the CPU or the GIL.

:class:`Census` owns the ranks known dead here and the census: the first set of
failed ranks recorded under ``failure`` (first writer wins), so that every survivor
names the same ranks and ``shrink()`` needs no second agreement.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Protocol

from .._base.errors import PeerFailure
from .._base.storekeys import peek
from . import procs

#: Keys read per request (bounded replies).
_BATCH = 512
#: How many ranks each rank watches with heartbeat detection.
WATCH = 3
#: How often a blocked object collective knocks on silent peers elsewhere.
_KNOCK_EVERY = 0.25
#: Store errors: torch raises DistError subclasses (or RuntimeError) for a broken store.
_STORE_ERRORS = (RuntimeError, ValueError)


def encode_ranks(ranks: Any) -> str:
    """A set of ranks as store text: ``"1,3"``; ``"none"`` for the empty set.

    The one codec of rank sets in the store (census record, shrink proposals, grow
    outcomes). The empty set is ``"none"``, never ``""``: ``compare_set(key, "", value)``
    reads ``""`` as "no value yet", so an empty census written as ``""`` would not hold.
    """
    text = ",".join(str(r) for r in sorted(set(ranks)))
    return text or "none"


def decode_ranks(raw: bytes | str) -> tuple[int, ...]:
    """The sorted ranks :func:`encode_ranks` wrote."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    if text == "none":
        return ()
    return tuple(sorted({int(x) for x in text.split(",")}))


def watched(rank: int, world_size: int) -> list[int]:
    """The ranks ``rank`` watches: its successor and two more a third of the ring apart
    (a block of consecutive ranks that dies together, one node, is still watched)."""
    out: list[int] = []
    for offset in (1, 1 + world_size // 3, 1 + (2 * world_size) // 3):
        r = (rank + offset) % world_size
        if r != rank and r not in out:
            out.append(r)
    return out[:WATCH]


class Roster:
    """The peers of one rank of a communicator (``store``: the communicator's prefix store).

    ``usable()`` says whether the store may still be used (its host is alive).
    """

    def __init__(self, store: Any, rank: int, world_size: int, usable: Callable[[], bool]) -> None:
        self._store = store
        self.rank = rank
        self._world_size = world_size
        self._usable = usable
        #: What each peer published, once read (it never changes).
        self.cache: dict[int, procs.Peer] = {}

    def others(self) -> list[int]:
        return [r for r in range(self._world_size) if r != self.rank]

    def peers(self, ranks: list[int] | None = None) -> dict[int, procs.Peer]:
        """What each peer (of ``ranks``, default all) published about its process."""
        want = self.others() if ranks is None else ranks
        missing = [r for r in want if r not in self.cache and r != self.rank]
        if missing and self._usable():
            for i in range(0, len(missing), _BATCH):
                part = missing[i : i + _BATCH]
                keys = [f"proc/{r}" for r in part]
                if self._store.check(keys):
                    values = self._store.multi_get(keys)
                else:
                    values = [(peek(self._store, k) or "").encode() for k in keys]
                for r, raw in zip(part, values):
                    if raw:
                        self.cache[r] = procs.Peer.decode(raw)
        return {r: self.cache[r] for r in want if r in self.cache}

    def left(self, rank: int) -> bool:
        """``rank`` closed or aborted on its own: alive, not failed (its sockets may close)."""
        if not self._usable():
            return False
        store = self._store
        if store.check([f"bye/{rank}"]):
            return True
        aborted = peek(store, "aborted")
        return aborted is not None and aborted.split("|", 1)[0] == str(rank)

    def probe(
        self,
        ranks: list[int],
        *,
        bound: float,
        stopped_failed: bool = False,
        eliminate: bool = False,
    ) -> tuple[int, ...]:
        """Which of ``ranks`` failed (blocking; at most about ``bound`` seconds).

        Proof of death only (see ``procs``): on this machine, the process is gone
        (or stopped, with ``stopped_failed``: heartbeat detection, which already
        saw it silent for a bound); elsewhere, its pulse refuses a connection, or
        its machine does not answer for ``bound`` seconds. A rank that never
        published its process within ``bound`` counts as failed. ``eliminate``:
        a rank whose process is gone after it closed or aborted on its own (its
        sockets closed too) is not a failure.
        """
        end = time.monotonic() + bound
        peers = self.peers(ranks)
        while len(peers) < len(ranks) and time.monotonic() < end and self._usable():
            time.sleep(0.02)  # a rank that has not published its process yet
            peers = self.peers(ranks)
        dead = {r for r in ranks if r not in peers}
        while True:
            dead |= self._proven_dead(peers, end, stopped_failed)
            if eliminate:
                dead = {r for r in dead if not self.left(r)}
            # After a transport error some peer is dying: a process that is exiting
            # closes its sockets (the transport's, then its pulse) before it leaves the
            # process table, so look again for a moment.
            if dead or not eliminate or time.monotonic() >= end:
                return tuple(sorted(dead))
            time.sleep(0.005)

    def _proven_dead(
        self, peers: dict[int, procs.Peer], end: float, stopped_failed: bool
    ) -> set[int]:
        dead: set[int] = set()
        knock: dict[int, tuple[str, int]] = {}
        for r, p in peers.items():
            if p.local:
                state = p.state()
                if state == "gone" or (stopped_failed and state == "stopped"):
                    dead.add(r)
                    continue
            if p.address is not None:
                knock[r] = p.address  # (a local one too: an exiting process has closed it)
        if knock:
            answers = procs.knock(knock, max(0.001, end - time.monotonic()))
            dead.update(
                r for r, ok in answers.items() if ok is False or (ok is None and not peers[r].local)
            )
        return dead


class StoreView(Protocol):
    """What a :class:`Census` needs to know of its communicator's store and membership
    (their owner is the liveness member)."""

    @property
    def bound(self) -> float:
        """Seconds of silence after which a rank counts as failed."""

    @property
    def closed(self) -> bool:
        """The communicator closed: nobody needs a census any more."""

    @property
    def store_gone(self) -> str | None:
        """Why the store can no longer be used, or None."""

    def store_usable(self) -> bool:
        """The store may still be used (its host is alive)."""

    def lost_store_host(self) -> int | None:
        """The rank that hosted the store, where the store is lost with it."""

    def failure(self) -> BaseException | None:
        """The error for an operation that needs the store when it is gone, else None."""


class Census:
    """The ranks of one communicator known dead here, and the census every survivor
    agrees on (see the module docstring). ``store``: the communicator's prefix store."""

    def __init__(self, store: Any, roster: Roster, view: StoreView) -> None:
        self._store = store
        self._roster = roster
        self._view = view
        self._lock = threading.Lock()
        self._dead: set[int] = set()
        self._taking = threading.Lock()  # one census at a time; the first answer stays
        self._answer: tuple[int, ...] | None = None
        self._knocked = 0.0

    @property
    def dead(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(sorted(self._dead))

    def mark(self, ranks: Any) -> None:
        """``ranks`` are proven dead (here: not yet the census's answer)."""
        with self._lock:
            self._dead.update(ranks)

    def record(self) -> tuple[int, ...] | None:
        """The failed set every survivor agreed on (first census result), or None."""
        if self._view.store_gone is not None or not self._store.check(["failure"]):
            return None
        return decode_ranks(self._store.get("failure"))

    def _agree(self, ranks: tuple[int, ...]) -> tuple[int, ...]:
        """Record ``ranks`` as the failure unless a census recorded one first; the record."""
        if self._view.store_gone is not None:
            return ranks
        return decode_ranks(self._store.compare_set("failure", "", encode_ranks(ranks)))

    def take(self, proven: tuple[int, ...] = ()) -> tuple[int, ...]:
        """The ranks that failed, as every survivor names them (``proven``: ranks this
        rank just proved dead, offered to it).

        Called after a transport error, a heartbeat or a process table proved that some
        peer failed. Only the first call counts; later ones (another thread, the same
        failure) reuse the answer, which joins ``dead``. Store errors make it answer
        what is known so far."""
        with self._taking:
            if self._answer is None:
                self._answer = self._take(proven)
            self.mark(self._answer)
            return self._answer

    def _take(self, proven: tuple[int, ...]) -> tuple[int, ...]:
        known = tuple(sorted({*self.dead, *proven}))
        view = self._view
        if view.closed:
            # A transport error after close() (an aborted op that Gloo ended only now):
            # nobody needs the answer, and the keys may be gone (``forget``), so that a
            # read would wait for them and block the process's store client.
            return known
        if not view.store_usable():
            # The store's loss owns the verdict: its host, if a rank. A peer whose process
            # is gone by now is no proof: every survivor aborts and may exit when it learns
            # the host died, with no store left to say goodbye on.
            host = view.lost_store_host()
            return tuple(sorted(set(known) | ({host} if host is not None else set())))
        try:
            recorded = self.record()
            if recorded is not None:
                return recorded
            if known:
                return self._agree(known)
            me = str(self._roster.rank)
            if self._store.compare_set("census/owner", "", me).decode() != me:
                # Another survivor is counting: wait for its record (it may die too,
                # then count ourselves).
                end = time.monotonic() + view.bound + 1.0
                delay = 0.002
                while time.monotonic() < end:
                    recorded = self.record()
                    if recorded is not None:
                        return recorded
                    time.sleep(delay)
                    delay = min(delay * 2, 0.05)
            return self._agree(
                self._roster.probe(self._roster.others(), bound=view.bound, eliminate=True)
            )
        except _STORE_ERRORS:  # the store is unreachable: say what is known
            return known

    def failure_among(self, ranks: list[int]) -> BaseException | None:
        """For an operation waiting on ``ranks`` through the store (an object
        collective, a split): the error to fail it with once one of them is proven dead
        or the store is gone; None while they may still come. Cheap: reads the process
        table of peers on this machine, and knocks on the others a few times a second."""
        error = self._view.failure()
        if error is not None:
            return error
        peers = self._roster.peers(ranks)
        dead = procs.gone_among((r, peers[r]) for r in ranks if r in peers)
        now = time.monotonic()
        remote = {r: p.address for r, p in peers.items() if not p.local and p.address is not None}
        if not dead and remote and now - self._knocked >= _KNOCK_EVERY:
            self._knocked = now
            answers = procs.knock(remote, min(self._view.bound, 1.0))
            dead = [r for r, ok in answers.items() if ok is False]
        if not dead:
            return None
        self.mark(dead)
        named = self.take() or tuple(dead)
        return PeerFailure(f"rank(s) {list(named)} failed", named)
