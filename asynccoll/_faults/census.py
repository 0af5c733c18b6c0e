"""Who among a communicator's ranks is dead: what each published about its process, and proof.

:class:`Roster` reads the ``proc/<rank>`` entries the ranks published (see
``Liveness.start``) and proves deaths with ``procs``: a process gone from this
machine's process table, or a pulse socket that refuses a connection (or a
machine that does not answer for the bound). A live process is never named,
whether or not it gets the CPU or the GIL.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from .._base.storekeys import peek
from . import procs

#: Keys read per request (bounded replies).
_BATCH = 512
#: How many ranks each rank watches with heartbeat detection.
WATCH = 3


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
        self._rank = rank
        self._world_size = world_size
        self._usable = usable
        #: What each peer published, once read (it never changes).
        self.cache: dict[int, procs.Peer] = {}

    def others(self) -> list[int]:
        return [r for r in range(self._world_size) if r != self._rank]

    def peers(self, ranks: list[int] | None = None) -> dict[int, procs.Peer]:
        """What each peer (of ``ranks``, default all) published about its process."""
        want = self.others() if ranks is None else ranks
        missing = [r for r in want if r not in self.cache and r != self._rank]
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
