"""Liveness through the rendezvous store: heartbeats, naming failed ranks, abort news.

One thread per communicator bumps the counter ``hb/<rank>`` every ``interval``
seconds. It serves three purposes:

* **census** — when a backend reports that *a* peer failed (Gloo: a closed
  connection) without saying which, ``census()`` names the ranks whose counters
  stop moving, so ``PeerFailure.ranks`` is filled in;
* **detection** (``detect=True``; the default for NCCL, which hangs on a dead
  peer instead of failing) — a rank whose counter has not moved for ``misses``
  intervals is declared failed, and ``on_failure`` receives a ``PeerFailure``;
* **abort news** — ``publish_abort()`` writes the reason under ``aborted``, and
  every other rank's thread turns it into a local abort within one interval, so a
  timeout on one rank does not leave the others waiting for their own deadlines.

A frozen (SIGSTOPped) peer looks dead to heartbeats. Without detection (Gloo's
default) it is caught by the operation deadline instead, as ``CollectiveTimeout``.
The store calls never use blocking ``wait``: a torch store client serialises its
requests, so one long wait would stall every other thread using it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from .errors import CommAborted, PeerFailure


class Liveness:
    """Heartbeat thread of one communicator (see the module docstring)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        *,
        interval: float,
        detect: bool,
        on_failure: Callable[[BaseException], None],
        misses: int = 3,
    ) -> None:
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self.interval = interval
        self.detect = detect
        self._misses = misses
        self._on_failure = on_failure
        self._stop = threading.Event()
        self._abort_reason: str | None = None
        self._lock = threading.Lock()
        self._last: dict[int, tuple[int, float]] = {}
        self._dead: set[int] = set()
        self._census_lock = threading.Lock()
        self._census: tuple[int, ...] | None = None
        self._thread = threading.Thread(target=self._run, name=f"asynccoll-liveness-r{rank}", daemon=True)

    def start(self) -> None:
        self._beat()
        self._thread.start()

    def stop(self) -> None:
        """Stop beating (peers will see this rank as gone). Never blocks."""
        self._stop.set()

    def publish_abort(self, error: BaseException) -> None:
        """Tell the other ranks this communicator aborted (done by the thread, not the caller).

        A ``PeerFailure`` travels as one, with its ranks, so every survivor knows
        which ranks to leave out when it shrinks.
        """
        ranks = ",".join(map(str, error.ranks)) if isinstance(error, PeerFailure) else "-"
        self._abort_reason = f"{self._rank}|{ranks}|{error}"
        self._stop.set()

    @property
    def dead(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(sorted(self._dead))

    # ---------------------------------------------------------------- store
    def _beat(self) -> None:
        self._store.add(f"hb/{self._rank}", 1)

    def _read(self, rank: int) -> int:
        return int(self._store.add(f"hb/{rank}", 0))

    def _others(self) -> list[int]:
        return [r for r in range(self._world_size) if r != self._rank]

    # ---------------------------------------------------------------- census
    def census(self) -> tuple[int, ...]:
        """Ranks that show no sign of life within ``misses`` intervals.

        A rank counts as alive once its heartbeat counter moves or it answers the
        census itself (a survivor that saw the same failure answers at once). Only
        the first call waits; later ones (another thread, the same failure) reuse
        the answer. Store errors make it return what is known so far.
        """
        with self._census_lock:
            if self._census is None:
                self._census = self._take_census()
            return self._census

    def _take_census(self) -> tuple[int, ...]:
        known = self.dead
        if known:
            return known
        store = self._store
        try:
            store.set(f"census/{self._rank}", "1")
            before = {r: self._read(r) for r in self._others()}
            alive: set[int] = set()
            deadline = time.monotonic() + self._misses * self.interval
            while True:
                for r in before:
                    if r not in alive and (store.check([f"census/{r}"]) or self._read(r) != before[r]):
                        alive.add(r)
                if len(alive) == len(before) or time.monotonic() >= deadline:
                    break
                time.sleep(min(0.02, self.interval / 4))
        except Exception:
            return known
        dead = set(before) - alive
        with self._lock:
            self._dead.update(dead)
        return tuple(sorted(dead))

    # ---------------------------------------------------------------- thread
    def _run(self) -> None:
        now = time.monotonic()
        others = self._others()
        try:
            self._last = {r: (self._read(r), now) for r in others}
        except Exception:
            self._last = {r: (-1, now) for r in others}
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                if self._store.check(["aborted"]):
                    self._on_failure(_abort_news(self._store.get("aborted")))
                    return
                if self.detect and self._check_peers():
                    return
            except Exception as exc:  # the store is gone: its host rank died
                if self.detect:
                    failure = PeerFailure(f"rendezvous store unreachable: {exc}")
                    failure.__cause__ = exc
                    self._on_failure(failure)
                    return
        reason = self._abort_reason
        if reason is not None:
            try:
                self._store.compare_set("aborted", "", reason)
            except Exception:
                pass

    def _check_peers(self) -> bool:
        now = time.monotonic()
        stale = []
        for r in self._others():
            value = self._read(r)
            old, since = self._last[r]
            if value != old:
                self._last[r] = (value, now)
            elif now - since > self._misses * self.interval:
                stale.append(r)
        if not stale:
            return False
        with self._lock:
            self._dead.update(stale)
        self._on_failure(
            PeerFailure(
                f"no heartbeat from rank(s) {stale} for {self._misses} x {self.interval:g} s",
                stale,
            )
        )
        return True


def _abort_news(raw: bytes) -> CommAborted:
    """The local error for a peer's published abort (see ``publish_abort``)."""
    origin, ranks, message = raw.decode(errors="replace").split("|", 2)
    if ranks != "-":
        failed = [int(r) for r in ranks.split(",") if r]
        return PeerFailure(f"peer failure reported by rank {origin}: {message}", failed)
    return CommAborted(f"aborted by rank {origin}: {message}")
