"""Liveness through the rendezvous store: heartbeats, naming failed ranks, abort news.

One process-wide service per store server (not one thread per communicator)
serves every communicator of the process with two threads:

* the **beater** bumps each communicator's counter ``hb/<rank>`` every
  ``interval`` seconds, runs heartbeat detection and publishes abort news;
* the **answerer** sits in a blocking ``queue_pop`` on the process's inbox, on a
  store connection of its own, and answers census requests the moment they
  arrive (it does nothing else, so an answer never waits for a beat, a user
  thread or a busy store client); pushed abort news is handed to the beater.

The service holds its communicators through weak references: a communicator
dropped without ``close()`` stops beating once it is collected, and the threads
end when no communicator uses them.

What it is for:

* **census** — when a backend reports that *a* peer failed (Gloo: a closed
  connection) without saying which, ``census()`` names it. A peer on this
  machine (same kernel and pid namespace, published under ``proc/<rank>``) whose
  process is gone from the process table is dead: exact, at once. Every peer
  also gets a census request in its inbox; live peers answer within
  milliseconds. When no process is known gone, every peer but one has answered,
  and that one runs on another machine with the request still unread in its
  inbox for ``ELIMINATE_AFTER`` (a live process's answerer takes it at once,
  inside one C++ store call that needs no GIL), that peer is the one that died:
  the transport error proved that someone did. Otherwise the census waits the
  full ``misses`` x ``interval`` bound, where any sign of life (an answer, a
  taken request, a moving heartbeat) keeps a rank alive. The first census result is
  recorded under ``failure`` (first writer wins), so every survivor names the
  same ranks and ``shrink()`` can build on them without another agreement round.
* **detection** (``detect=True``; the default for NCCL, which hangs on a dead
  peer instead of failing) — a rank whose counter has not moved for ``misses``
  intervals, and that then shows no sign of life to a census probe (at once
  for a gone or stopped process on this machine, else for as long again), is
  declared failed, and ``on_failure`` receives a ``PeerFailure``;
* **abort news** — ``publish_abort()`` writes the reason under ``aborted`` and
  pushes it into every peer's inbox; their services turn it into a local abort at
  once (the ``aborted`` key is also read at each beat, as a fallback).

A frozen (SIGSTOPped) peer looks dead to heartbeats and, once frozen longer than
the bound, to the census too; one that resumes within the bound is not named.
Without detection (Gloo's default) it is caught by the operation deadline, as
``CollectiveTimeout``.

Store calls made by user-facing threads never use a blocking ``wait``: a torch
store client serialises its requests, so one long wait would stall every other
thread using it. Only the answerer blocks, on its own connection.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import os
import socket
import threading
import time
import uuid
import weakref
from datetime import timedelta
from typing import Any, Callable, NamedTuple

from .._base.errors import CommAborted, PeerFailure

#: Peers on another machine (no process table to read): how long the one
#: silent peer's request must stay unread before elimination names it. A live
#: process's answerer is parked in ``queue_pop`` (a C++ store call that waits and
#: pops without the GIL) except for the few hundred microseconds it takes to
#: answer one message, so its inbox empties within a scheduler wake-up (answers
#: take 0.2-2 ms here). Measured on this 2-core machine at a load average of 17
#: (two CPU hogs and the test suite of six engineers), 0.3 % of back-to-back
#: probes still saw a live peer's request unread after 20 ms: this is the one
#: verdict that rests on timing, hence 50 ms, and only for remote peers.
ELIMINATE_AFTER = 0.05
_POLL = 0.002
_COUNT = itertools.count(1)


def encode_ranks(ranks: Any) -> str:
    """``"1,3"``; ``"none"`` for an empty set (a census that found everyone alive)."""
    text = ",".join(str(r) for r in sorted(set(ranks)))
    return text or "none"


def decode_ranks(raw: bytes | str) -> tuple[int, ...]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    if text in ("", "none"):
        return ()
    return tuple(sorted({int(x) for x in text.split(",")}))


def _root(store: Any) -> Any:
    """The store under every ``PrefixStore`` layer (the connection to the server)."""
    while True:
        under = getattr(store, "underlying_store", None)
        if under is None:
            return store
        store = under


def _root_key(root: Any) -> Any:
    host, port = getattr(root, "host", None), getattr(root, "port", None)
    return (host, port) if host is not None and port is not None else ("id", id(root))


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # no such file: not Linux, or the process is gone
        return None


def _start_time(pid: int) -> str | None:
    """The process's start time (``/proc/<pid>/stat`` field 22), None if unreadable."""
    stat = _read_text(f"/proc/{pid}/stat")
    if stat is None:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _machine() -> str:
    """Who can read this process's entry in the process table: kernel boot and pid namespace.

    Two ranks with the same value run on one kernel in one pid namespace, so each
    can tell whether the other's process still exists. Empty where unknown.
    """
    boot = _read_text("/proc/sys/kernel/random/boot_id")
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:  # no /proc: no process checks
        return ""
    return f"{boot.strip()}/{ns}" if boot else ""


_MACHINE = _machine()


class _Peer(NamedTuple):
    """What a rank published about its process under ``proc/<rank>``."""

    inbox: str
    mid: int
    machine: str
    pid: int
    start: str

    def state(self) -> str:
        """``"gone"`` (exited, killed, a zombie, or its pid reused), ``"stopped"``
        (SIGSTOP), or ``"running"``. Only meaningful for a peer on this machine
        (``machine == _MACHINE``)."""
        stat = _read_text(f"/proc/{self.pid}/stat")
        if stat is None:
            return "gone"
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X", "x") or fields[19] != self.start:
            return "gone"
        return "stopped" if fields[0] == "T" else "running"

    def gone(self) -> bool:
        return self.state() == "gone"


class _Service:
    """The liveness threads of this process for one store server (see the module docstring)."""

    _lock = threading.Lock()
    _services: dict[Any, _Service] = {}

    @classmethod
    def join(cls, member: Liveness) -> _Service:
        key = _root_key(member._root)
        with cls._lock:
            svc = cls._services.get(key)
            if svc is None or svc._closing:
                svc = cls._services[key] = _Service(key, member._root)
            svc._members[member._id] = weakref.ref(member)
            svc._wake.set()
            return svc

    @classmethod
    def threads(cls) -> int:
        """Live service threads of this process (for tests)."""
        with cls._lock:
            services = list(cls._services.values())
        return sum(t.is_alive() for s in services for t in (s._beater, s._answerer) if t is not None)

    def __init__(self, key: Any, root: Any) -> None:
        self._key = key
        self._root = root
        self._members: dict[int, weakref.ref[Liveness]] = {}
        #: Members with abort news not yet published: held strongly until it is out,
        #: so a communicator dropped right after its abort still tells its peers.
        self._publishing: set[Liveness] = set()
        self._holds = 0
        self._closing = False
        self._wake = threading.Event()
        self._news: collections.deque[tuple[int, str]] = collections.deque()
        self.uid = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.inbox: str | None = f"asynccoll/inbox/{self.uid}"
        self._answerer: threading.Thread | None = None
        try:
            conn = root.clone()
            conn.set_timeout(timedelta(days=1))
        except Exception:  # noqa: BLE001 - a store without clone/timeouts: census falls back to heartbeats
            self.inbox = None
        else:
            self._answerer = threading.Thread(
                target=self._answer, args=(conn,), name="asynccoll-liveness-answerer", daemon=True
            )
            self._answerer.start()
        self._beater = threading.Thread(target=self._beat_loop, name="asynccoll-liveness", daemon=True)
        self._beater.start()

    def hold(self) -> None:
        """Keep the service (and this process's census answers) up without a member."""
        with _Service._lock:
            self._holds += 1

    def release(self) -> None:
        with _Service._lock:
            self._holds -= 1
        self._wake.set()

    # ------------------------------------------------------------ answerer
    def _answer(self, conn: Any) -> None:
        inbox = self.inbox
        assert inbox is not None
        while True:
            try:
                text = conn.queue_pop(inbox).decode(errors="replace")
                kind, _, rest = text.partition("|")
                if kind == "c":  # census: say "alive" to the requester's reply queue
                    conn.queue_push(rest, inbox)
                elif kind == "a":  # abort news for one member: the beater delivers it
                    mid, _, raw = rest.partition("|")
                    self._news.append((int(mid), raw))
                    self._wake.set()
                elif kind == "s":
                    return
            except Exception:  # noqa: BLE001 - the store server is gone (its host died) or the inbox broke
                return

    # -------------------------------------------------------------- beater
    def _live_members(self) -> list[Liveness]:
        out = []
        for mid, ref in list(self._members.items()):
            m = ref()
            if m is None:
                self._members.pop(mid, None)
            else:
                out.append(m)
        return out

    def _beat_loop(self) -> None:
        while True:
            self._wake.wait(self._next_wait())
            self._wake.clear()
            if not self._round():
                self._shutdown()
                return

    def _round(self) -> bool:
        """Deliver news and beat for every member that is due. False: the service ends.

        A method of its own so that no member outlives it in a local variable of
        the loop (a dropped communicator's membership must end when it is collected).
        """
        with _Service._lock:
            members = self._live_members()
            if not members and self._holds <= 0 and not self._news:
                self._closing = True
                if _Service._services.get(self._key) is self:
                    del _Service._services[self._key]
                return False
        while self._news:
            mid, raw = self._news.popleft()
            ref = self._members.get(mid)
            member = ref() if ref is not None else None
            if member is not None:
                member._deliver(raw)
        now = time.monotonic()
        for m in members:
            if m._due <= now or m._urgent:
                m._due = now + m.interval
                if not m._tick():
                    self._members.pop(m._id, None)
        return True

    def _next_wait(self) -> float:
        dues = [m._due for m in self._live_members()]
        if not dues:
            return 0.05
        return max(0.0, min(dues) - time.monotonic())

    def _shutdown(self) -> None:
        if self._answerer is not None and self.inbox is not None:
            try:
                self._root.queue_push(self.inbox, "s")
            except Exception:  # noqa: BLE001 - the server is gone: the answerer has ended already
                return

    @classmethod
    def _stop_all(cls) -> None:
        """At exit: end the answerers while the interpreter can still run them."""
        with cls._lock:
            services = list(cls._services.values())
        for svc in services:
            svc._shutdown()
            if svc._answerer is not None:
                svc._answerer.join(0.5)


atexit.register(_Service._stop_all)


class Liveness:
    """One communicator's membership in the process's liveness service (see the module docstring)."""

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
        self._root = _root(store)
        self._rank = rank
        self._world_size = world_size
        self.interval = interval
        self.detect = detect
        self._misses = misses
        self._on_failure = on_failure
        self._id = next(_COUNT)
        self._closed = False  # close(): say goodbye, leave the service
        self._aborted = False  # no more news or detection; still beats and answers
        self._urgent = False
        self._due = 0.0
        self._abort_reason: str | None = None
        self._lock = threading.Lock()
        self._last: dict[int, tuple[int, float]] = {}
        self._dead: set[int] = set()
        self._census_lock = threading.Lock()
        self._census: tuple[int, ...] | None = None
        self._peers: dict[int, _Peer] | None = None
        self._service: _Service | None = None

    @property
    def bound(self) -> float:
        """Seconds of silence after which a rank counts as failed."""
        return self._misses * self.interval

    def start(self) -> None:
        """Beat once, join the process's service, and publish this rank's inbox."""
        now = time.monotonic()
        others = self._others()
        try:
            self._last = {r: (self._read(r), now) for r in others}
        except Exception:  # noqa: BLE001 - counted from the next beat on
            self._last = {r: (-1, now) for r in others}
        self._beat()
        self._due = now + self.interval
        svc = _Service.join(self)
        self._service = svc
        if svc.inbox is not None:
            pid = os.getpid()  # (not at import: a forked process inherits the module)
            started = _start_time(pid) or ""
            machine = _MACHINE if started else ""
            self._store.set(f"proc/{self._rank}", f"{svc.inbox}|{self._id}|{machine}|{pid}|{started}")

    def stop(self) -> None:
        """Stop beating (the service says goodbye for this rank). Never blocks."""
        self._closed = True
        self._wake()

    def publish_abort(self, error: BaseException) -> None:
        """Tell the other ranks this communicator aborted (done by the service, not the caller).

        A ``PeerFailure`` travels as one, with its ranks, so every survivor knows
        which ranks to leave out when it shrinks.
        """
        ranks = ",".join(map(str, error.ranks)) if isinstance(error, PeerFailure) else "-"
        self._abort_reason = f"{self._rank}|{ranks}|{error}"
        self._aborted = True
        svc = self._service
        if svc is not None:
            with _Service._lock:
                svc._publishing.add(self)
        self._wake()

    def hold(self) -> None:
        """Keep this process's service (its census answers) up, even once this member has
        stopped, until :meth:`release`: ``shrink`` holds it while the survivors rebuild."""
        svc = self._service
        if svc is not None:
            svc.hold()

    def release(self) -> None:
        """Undo one :meth:`hold`."""
        svc = self._service
        if svc is not None:
            svc.release()

    @property
    def dead(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(sorted(self._dead))

    def _wake(self) -> None:
        self._urgent = True
        svc = self._service
        if svc is not None:
            svc._wake.set()

    # ---------------------------------------------------------------- store
    def _beat(self) -> None:
        self._store.add(f"hb/{self._rank}", 1)

    def _read(self, rank: int) -> int:
        return int(self._store.add(f"hb/{rank}", 0))

    def _others(self) -> list[int]:
        return [r for r in range(self._world_size) if r != self._rank]

    def _left(self, rank: int) -> bool:
        """``rank`` closed or aborted on its own: alive, not failed (its sockets may close)."""
        store = self._store
        if store.check([f"bye/{rank}"]):
            return True
        return bool(store.check(["aborted"])) and store.get("aborted").split(b"|", 1)[0] == str(rank).encode()

    def peers(self) -> dict[int, _Peer]:
        """What each peer that published one said about its process (see ``start``)."""
        if self._peers is not None:
            return self._peers
        found: dict[int, _Peer] = {}
        for r in self._others():
            key = f"proc/{r}"
            if self._store.check([key]):
                inbox, mid, machine, pid, start = self._store.get(key).decode().split("|")
                found[r] = _Peer(inbox, int(mid), machine, int(pid), start)
        if len(found) == self._world_size - 1:
            self._peers = found
        return found

    # ---------------------------------------------------------------- census
    def record(self) -> tuple[int, ...] | None:
        """The failed set every survivor agreed on (first census result), or None."""
        if not self._store.check(["failure"]):
            return None
        return decode_ranks(self._store.get("failure"))

    def _agree(self, ranks: tuple[int, ...]) -> tuple[int, ...]:
        """Record ``ranks`` as the failure unless a census recorded one first; the record."""
        return decode_ranks(self._store.compare_set("failure", "", encode_ranks(ranks)))

    @property
    def census(self) -> Callable[[], tuple[int, ...]]:
        """``census()``: the ranks that failed, as every survivor names them.

        Called after a transport error proved that some peer failed (see the module
        docstring). Only the first call works; later ones (another thread, the same
        failure) reuse the answer. Store errors make it return what is known so far.

        The callable holds this object weakly: a backend keeps it, and must not keep
        a dropped communicator's membership (and its heartbeats) alive.
        """
        ref = weakref.ref(self)

        def census() -> tuple[int, ...]:
            me = ref()
            return me._census_once() if me is not None else ()

        return census

    def _census_once(self) -> tuple[int, ...]:
        with self._census_lock:
            if self._census is None:
                self._census = self._take_census()
            with self._lock:
                self._dead.update(self._census)
            return self._census

    def _take_census(self) -> tuple[int, ...]:
        known = self.dead
        try:
            recorded = self.record()
            if recorded is not None:
                return recorded
            if known:
                return self._agree(known)
            owner = self._store.compare_set("census/owner", "", str(self._rank)).decode()
            if owner != str(self._rank):
                # Another survivor is counting: wait for its record (it may die too,
                # then count ourselves).
                end = time.monotonic() + self.bound + 1.0
                while time.monotonic() < end:
                    recorded = self.record()
                    if recorded is not None:
                        return recorded
                    time.sleep(_POLL)
            return self._agree(self.probe(self._others(), eliminate=True))
        except Exception:  # noqa: BLE001 - the store is unreachable: say what is known
            return known

    def probe(
        self, ranks: list[int], *, eliminate: bool, bound: float | None = None, stopped_failed: bool = False
    ) -> tuple[int, ...]:
        """Which of ``ranks`` failed (blocking; at most ``bound`` seconds).

        Proof of death: the rank's process is gone from this machine's process
        table (a peer on the same kernel and pid namespace; exact, at once). Signs
        of life: an answer to the census request, the request taken from the
        rank's inbox by its answerer, a moving heartbeat, a goodbye; a rank with
        none of them for ``bound`` seconds counts as failed. ``eliminate``: some
        peer is known to have failed (a transport error), so when no process is
        known gone, every rank but one answered, and that one is on another
        machine with its request unread for ``ELIMINATE_AFTER`` seconds, it is
        named at once; a rank that closed or aborted on its own (its sockets close
        too) is then not a failure either. Without it (shrink watching its
        survivors) only the process's own signs count. ``stopped_failed``: a peer
        on this machine that is stopped (SIGSTOP) counts as failed at once
        (heartbeat detection, which already saw it silent for a bound).
        """
        bound = self.bound if bound is None else bound
        left = self._left if eliminate else (lambda r: False)
        root, svc = self._root, self._service
        peers = self.peers() if svc is not None and svc.inbox is not None else {}
        reply = f"asynccoll/reply/{svc.uid if svc else os.getpid()}/{next(_COUNT)}"
        owner_of = {}
        for r in ranks:
            if r in peers:
                root.queue_push(peers[r].inbox, f"c|{reply}")
                owner_of[peers[r].inbox] = r
        local = {r: peers[r] for r in ranks if r in peers and peers[r].machine and peers[r].machine == _MACHINE}
        start = time.monotonic()
        hb = {r: self._read(r) for r in ranks}
        alive: set[int] = set()
        gone: set[int] = set()
        alone_since: float | None = None
        next_hb = start + self.interval / 2
        while True:
            while owner_of and root.queue_len(reply) > 0:
                who = owner_of.get(root.queue_pop(reply, False).decode())
                if who is not None:
                    alive.add(who)
            dead_states = ("gone", "stopped") if stopped_failed else ("gone",)
            gone.update(r for r, peer in local.items() if r not in alive and peer.state() in dead_states)
            silent = [r for r in ranks if r not in alive and r not in gone]
            if not silent:
                return tuple(sorted(gone))
            now = time.monotonic()
            if now >= next_hb:
                for r in silent:
                    if self._read(r) != hb[r] or left(r):
                        alive.add(r)
                next_hb = now + self.interval / 2
                continue
            x = silent[0]
            if eliminate and not gone and len(silent) == 1 and x in peers and x not in local:
                if root.queue_len(peers[x].inbox) > 0 and not left(x):
                    alone_since = alone_since if alone_since is not None else now
                    if now - alone_since >= ELIMINATE_AFTER:
                        return (x,)
                else:
                    alone_since = None
            if now - start >= bound:
                return tuple(sorted(gone.union(
                    r for r in silent
                    if not (r in peers and root.queue_len(peers[r].inbox) == 0)
                    and self._read(r) == hb[r] and not left(r)
                )))
            time.sleep(_POLL)

    # ------------------------------------------------------- service side
    def _tick(self) -> bool:
        """One beat (service thread). False when this member leaves the service.

        An aborted communicator keeps beating (its process is alive, and its
        peers' census must not take it for dead) until it is closed or collected.
        """
        self._urgent = False
        try:
            reason, self._abort_reason = self._abort_reason, None
            if reason is not None:
                try:
                    self._publish(reason)
                finally:
                    svc = self._service
                    if svc is not None:
                        with _Service._lock:
                            svc._publishing.discard(self)
            if self._closed:
                self._store.set(f"bye/{self._rank}", "1")
                return False
            self._beat()
            if not self._aborted:
                if self._store.check(["aborted"]):
                    self._deliver(self._store.get("aborted").decode(errors="replace"))
                elif self.detect:
                    self._check_peers()
        except Exception as exc:  # noqa: BLE001 - the store is gone: its host rank died
            if self.detect and not self._aborted:
                failure = PeerFailure(f"rendezvous store unreachable: {exc}")
                failure.__cause__ = exc
                self._aborted = True
                self._on_failure(failure)
            return not self._closed
        return True

    def _publish(self, reason: str) -> None:
        if self._store.compare_set("aborted", "", reason).decode(errors="replace") != reason:
            return  # a peer's abort came first: every rank has that news already
        for peer in self.peers().values():
            self._root.queue_push(peer.inbox, f"a|{peer.mid}|{reason}")

    def _deliver(self, raw: str) -> None:
        """A peer's abort news (service thread)."""
        if self._aborted:
            return
        self._aborted = True
        news = _abort_news(raw)
        if isinstance(news, PeerFailure):
            with self._lock:
                self._dead.update(news.ranks)
        self._on_failure(news)

    def _check_peers(self) -> bool:
        now = time.monotonic()
        stale = []
        for r in self._others():
            value = self._read(r)
            old, since = self._last[r]
            if value != old:
                self._last[r] = (value, now)
            elif now - since > self.bound and not self._left(r):
                stale.append(r)
        if not stale:
            return False
        # Confirm through the census before declaring: a live process whose beats
        # were late (CPU starvation, the GIL held by user code) still takes the
        # request at once in its answerer's C++ store call. A dead or stopped
        # process on this machine is failed at once; elsewhere it stays silent
        # for another bound.
        suspects = stale
        stale = list(self.probe(suspects, eliminate=False, stopped_failed=True))
        if not stale:
            for r in suspects:  # alive: count its silence afresh
                self._last[r] = (self._last[r][0], time.monotonic())
            return False
        ranks = self._agree(tuple(stale)) or tuple(stale)
        with self._lock:
            self._dead.update(ranks)
        self._aborted = True
        self._on_failure(
            PeerFailure(f"no heartbeat from rank(s) {stale} for {self._misses} x {self.interval:g} s", ranks)
        )
        return True


def _abort_news(raw: str) -> CommAborted:
    """The local error for a peer's published abort (see ``publish_abort``)."""
    origin, ranks, message = raw.split("|", 2)
    if ranks != "-":
        failed = [int(r) for r in ranks.split(",") if r]
        return PeerFailure(f"peer failure reported by rank {origin}: {message}", failed)
    return CommAborted(f"aborted by rank {origin}: {message}")
