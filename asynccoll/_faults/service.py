"""The process-wide liveness service: one per store server, shared by every communicator on it.

It owns two threads and one socket:

* the **beater** runs each member's beat (``Liveness.tick``) every ``interval``:
  its heartbeat, a read of its watched neighbours' counters and of the abort
  key, and publishing abort news and goodbyes;
* the **pulse** (:class:`~.procs.Pulse`): a listening socket whose kernel
  answers the census's knocks even while this process cannot run Python, and a
  thread that takes the messages peers send to it (abort news; the store host
  leaving).

Nothing in this process blocks on the store server: when the server goes away,
no request is in flight. Before each round the beater checks that the process
hosting the server is alive (when it runs on this machine); a host that died
fails every member whose rank it was, and the service stops using the store.
A host that closes normally first tells every service registered on its store
(``asynccoll/services``) and waits for their acknowledgement, so no request
of theirs can meet a closed server (see :meth:`Service.announce_leaving`).

Members are held through weak references (a dropped communicator stops
beating once collected); a member with abort news or a goodbye still to write
is held strongly until it is out. The threads end with the last member.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Iterable, Protocol

from .._base import shutdown
from .._base.storekeys import peek
from . import news, procs


class Member(Protocol):
    """What the service needs of a member (``liveness.Liveness``)."""

    id: int
    #: The communicator's namespace token (``news``): news for another one is dropped.
    namespace: str
    root: Any
    interval: float
    due: float
    urgent: bool
    #: Why this member's store can no longer be used, or None.
    store_gone: str | None

    def tick(self, store_gone: bool) -> bool:
        """One beat (the beater's thread); a member that leaves calls ``Service.leave``."""

    def deliver(self, raw: str) -> None:
        """A peer's abort news."""

    def store_lost(self, why: str, died: bool, host: StoreHost) -> None:
        """The store can no longer be used."""


#: Root-store key of the process hosting the store server (``host_info``).
HOST_KEY = "asynccoll/host"
#: Services registered on a store: a counter, ``<prefix>/<i>`` = pulse address, and
#: ``<prefix>/of/<process>`` = ``i`` (``listing_of``: a dead process's listing is found
#: from what its ranks published, and retired by the survivors, ``unlist_dead``).
SERVICES_KEY = "asynccoll/services"
#: How long a closing store host waits for the services' acknowledgements.
LEAVE_WAIT = 2.0


def root_of(store: Any) -> Any:
    """The store under every ``PrefixStore`` layer (the connection to the server)."""
    while True:
        under = getattr(store, "underlying_store", None)
        if under is None:
            return store
        store = under


def root_key(root: Any) -> Any:
    host, port = getattr(root, "host", None), getattr(root, "port", None)
    return (host, port) if host is not None and port is not None else ("id", id(root))


def listing_of(machine: str, pid: int, start: str, pulse_port: int) -> str:
    """The root-store key naming the listing slot of the service whose pulse listens on
    ``pulse_port`` in process ``(machine, pid, start)`` (what ``procs.Peer`` records)."""
    return f"{SERVICES_KEY}/of/{machine}|{pid}|{start}|{pulse_port}"


def unlist_dead(root: Any, peers: Iterable[procs.Peer]) -> None:
    """Delete the service listings of ``peers``, processes proven dead: a killed process
    never unlists itself (``Service._shutdown``), and its listing would stay on the store
    for good. Blocking; store errors propagate (the caller's cleanup handles them)."""
    for peer in peers:
        if not peer.port or not peer.machine:
            continue  # no pulse, or a process we cannot name: it listed nothing
        key = listing_of(peer.machine, peer.pid, peer.start, peer.port)
        slot = peek(root, key)
        if slot is not None:
            root.delete_key(f"{SERVICES_KEY}/{slot}")
            root.delete_key(key)


def unlist_ranks(store: Any, ranks: Iterable[int]) -> None:
    """:func:`unlist_dead` for the processes of ``ranks`` (proven dead) of the communicator
    whose keys are under ``store``, as their ``proc/<rank>`` records name them."""
    peers = []
    for r in ranks:
        raw = peek(store, f"proc/{r}")
        if raw is None:
            continue
        try:
            peers.append(procs.Peer.decode(raw))
        except ValueError:  # not a record of Liveness.start: it names no listing of ours
            continue
    unlist_dead(root_of(store), peers)


def mark_host(store: Any) -> None:
    """Record, on a store server just created by this process, that this process hosts it."""
    machine, pid, start = procs.this_process()
    store.set(HOST_KEY, f"{machine}|{pid}|{start}")


class StoreHost:
    """The process that hosts a store server, when asynccoll created it (``mark_host``)."""

    def __init__(self, root: Any, *, read: bool = True) -> None:
        """``read=False``: the store is gone, the host unknown (no request is made)."""
        self.machine, self.pid, self.start = "", 0, ""
        try:
            if read and root.check([HOST_KEY]):
                self.machine, pid, self.start = root.get(HOST_KEY).decode().split("|")
                self.pid = int(pid)
        except (RuntimeError, ValueError):  # a store without the key's format: host unknown
            self.pid = 0
        me = procs.this_process()
        self.here = self.pid != 0 and (self.machine, self.pid, self.start) == me
        self.local = self.pid != 0 and bool(self.machine) and self.machine == procs.MACHINE

    def gone(self) -> bool:
        """True once the host process is gone (known only when it ran on this machine)."""
        return self.local and not self.here and procs.process_state(self.pid, self.start) == "gone"


class Service:
    """The liveness threads of this process for one store server (see the module docstring)."""

    _lock = threading.Lock()
    #: The service each new member of a store server joins, by ``root_key``.
    _services: dict[Any, Service] = {}
    #: Every service whose threads run: those above, and those replaced there (their
    #: store failed) that still serve their members (``threads``, ``stop_all``).
    _running: set[Service] = set()

    @classmethod
    def join(cls, member: Member) -> Service:
        """The service ``member`` joins (made if none fits).

        A service whose store failed or whose store host died serves no new member on a
        usable store: a server restarted at the same address is another store, and gets
        a fresh service (the old one keeps its members until they leave). A member whose
        own store is gone (a goodbye or abort news still to send) joins only a service
        that lost its store too, or one of its own: never one whose beats it would fail.
        """
        key = root_key(member.root)
        gone = member.store_gone
        with cls._lock:
            svc = cls._services.get(key)
            fits = svc is not None and not svc._closing and (gone is None) == svc.usable()
            if svc is None or not fits:
                svc = Service(key, member.root, gone=gone)
                if gone is None:
                    cls._services[key] = svc
                cls._running.add(svc)
            svc._members[member.id] = weakref.ref(member)
            svc._wake.set()
            return svc

    @classmethod
    def lost(cls, root: Any) -> bool:
        """Whether this process's service on ``root`` (this very connection) knows its store
        is gone: the store failed, or its host died. No request is made."""
        with cls._lock:
            svc = cls._services.get(root_key(root))
        return svc is not None and svc.root is root and not svc.usable()

    @classmethod
    def forsake(cls, root: Any, why: str) -> None:
        """The connection ``root`` failed (its server is gone): every service on it stops
        using the store and tells its members, and none takes a new member."""
        with cls._lock:
            services = [svc for svc in cls._running if svc.root is root]
        for svc in services:
            svc.lose_store(why, died=True)

    def usable(self) -> bool:
        """False once the store failed or its host died (no request is made)."""
        return self.store_gone is None and not self.host.gone()

    @classmethod
    def threads(cls) -> int:
        """Live service threads of this process (for tests)."""
        with cls._lock:
            services = list(cls._running)
        threads = [
            t
            for s in services
            for t in (s._beater, s.pulse.thread if s.pulse else None)
            if t is not None
        ]
        return sum(t.is_alive() for t in threads)

    def __init__(self, key: Any, root: Any, gone: str | None = None) -> None:
        """``gone``: the store can no longer be used already (a member that lost it joins):
        no request is made on it."""
        self._key = key
        self.root = root
        self._members: dict[int, weakref.ref[Member]] = {}
        #: Members with news or a goodbye not yet written: held until it is out.
        self._keep: set[Member] = set()
        self._holds = 0
        self._closing = False
        self._wake = threading.Event()
        self._news: collections.deque[tuple[int, str, str]] = collections.deque()
        #: Why the store can no longer be used (its host died or left), or None.
        self.store_gone: str | None = gone
        self.host_left = False
        #: Held by the beater while its store requests are in flight (see ``_message``).
        self._round_lock = threading.Lock()
        self._slot: int | None = None
        self._listing: str | None = None
        self.host = StoreHost(root, read=gone is None)
        #: The store server's identity in pulse messages (``news.store_identity``).
        self.identity = ""
        if gone is None:
            try:
                self.identity = news.store_identity(root)
            except RuntimeError:  # the store failed already: the first round notices
                pass
        try:
            self.pulse: procs.Pulse | None = procs.Pulse(
                self._message, getattr(root, "host", None), "asynccoll-liveness-pulse"
            )
        except OSError:  # no socket to listen on: the census falls back to heartbeats
            self.pulse = None
        self._register()
        self._stopping = False
        self._beater = threading.Thread(
            target=self._beat_loop, name="asynccoll-liveness", daemon=True
        )
        self._beater.start()
        shutdown.register_native_thread(
            self._beater
        )  # store calls: stopped and joined when the interpreter exits

    def _register(self) -> None:
        """List this service on its store, for a store host that closes (``announce_leaving``)."""
        if self.pulse is None or self.host.here or self.store_gone is not None:
            return
        try:
            self._slot = int(self.root.add(SERVICES_KEY, 1))
            host, port = self.pulse.address
            machine, pid, start = procs.this_process()
            self._listing = listing_of(machine, pid, start, port) if machine else None
            if self._listing is not None:  # first: a listing is always found from its process
                self.root.set(self._listing, str(self._slot))
            self.root.set(f"{SERVICES_KEY}/{self._slot}", f"{host}|{port}")
        except RuntimeError:  # the store failed already: the first round notices
            self._slot = None

    # -------------------------------------------------------------- members
    def hold(self) -> None:
        """Keep the service (and this process's pulse) up without a member."""
        with Service._lock:
            self._holds += 1

    def release(self) -> None:
        with Service._lock:
            self._holds -= 1
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def keep(self, member: Member, wake: bool = True) -> None:
        """Hold ``member`` until its news or goodbye is out (see ``Liveness.tick``);
        ``wake=False``: its next beat, or a later :meth:`wake`, sends it."""
        with Service._lock:
            self._keep.add(member)
        if wake:
            self._wake.set()

    def quiesce(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until no round of the beater is in flight; False
        if one still is. A member that said goodbye first is then done with the store."""
        if threading.current_thread() is self._beater:
            return True  # called from a tick: that round is this one
        if not self._round_lock.acquire(timeout=timeout):
            return False
        self._round_lock.release()
        return True

    def leave(self, member: Member) -> None:
        """``member`` said goodbye (its tick, holding its own lock)."""
        with Service._lock:
            ref = self._members.get(member.id)
            if ref is not None and ref() is member:
                del self._members[member.id]
            self._keep.discard(member)

    def _live_members(self) -> list[Member]:
        out = []
        for mid, ref in list(self._members.items()):
            m = ref()
            if m is None:
                self._members.pop(mid, None)
            else:
                out.append(m)
        return out

    def member(self, mid: int) -> Member | None:
        ref = self._members.get(mid)
        return ref() if ref is not None else None

    # ------------------------------------------------------------- messages
    def _message(self, text: str) -> bool:
        """A message on the pulse (pulse thread); True: acknowledge it. A message for
        another store (a reused port: ``news``) is dropped."""
        message = news.parse(text)
        if message is None or not news.same_store(message.store, self.identity):
            return False
        if message.kind == "a":  # abort news for members of this process: the beater delivers it
            self._news.extend((mid, message.namespace, message.news) for mid in message.mids)
            self._wake.set()
            return False
        # "h": the store host is closing its server
        self.host_left = True
        self.lose_store("the rendezvous store's host closed it", died=False)
        with self._round_lock:  # no request of ours is in flight after this
            pass
        self._wake.set()
        return True

    # --------------------------------------------------------------- beater
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
        if self._stopping:
            return False
        with Service._lock:
            members = self._live_members()
            if not members and self._holds <= 0 and not self._news:
                self._closing = True
                if Service._services.get(self._key) is self:
                    del Service._services[self._key]
                Service._running.discard(self)
                return False
        while self._news:
            mid, namespace, raw = self._news.popleft()
            target = self.member(mid)
            if target is not None and target.namespace == namespace:
                target.deliver(raw)
        self.check_host()
        now = time.monotonic()
        with self._round_lock:
            for m in members:
                if m.due <= now or m.urgent:
                    m.due = now + m.interval
                    m.tick(self.store_gone is not None)  # a member that leaves calls leave()
        return True

    def check_host(self) -> bool:
        """False (and every member told) once the store can no longer be used:
        before a request, where the host runs on this machine, this looks at its process."""
        if self.store_gone is None and self.host.gone():
            self.lose_store(f"the rendezvous store's host (pid {self.host.pid}) is gone", died=True)
        return self.store_gone is None

    def lose_store(self, why: str, *, died: bool) -> None:
        """The store can no longer be used: stop every request; tell the members.

        ``died``: the host process is gone without closing (not after ``h``).
        """
        if self.store_gone is None:
            self.store_gone = why
        for m in self._live_members():
            m.store_lost(why, died and not self.host_left, self.host)

    def _next_wait(self) -> float:
        dues = [m.due for m in self._live_members()]
        if not dues:
            return 0.05
        return max(0.0, min(dues) - time.monotonic())

    def _shutdown(self) -> None:
        with Service._lock:
            self._closing = True
            if Service._services.get(self._key) is self:
                del Service._services[self._key]
            Service._running.discard(self)
        if self._slot is not None and self.store_gone is None and not self._stopping:
            try:  # unlisted: a closing host need not wait for this process
                self.root.delete_key(f"{SERVICES_KEY}/{self._slot}")
                if self._listing is not None:
                    self.root.delete_key(self._listing)
            except RuntimeError:  # the store failed meanwhile: nothing more to say on it
                pass
        if self.pulse is not None:
            self.pulse.close()

    # ----------------------------------------------------------- the host
    @classmethod
    def announce_leaving(cls, store: Any, wait: float = LEAVE_WAIT) -> None:
        """This process is about to close the store server ``store`` (it hosts it):
        tell every service registered on it and wait (at most ``wait`` seconds) until
        each has stopped using the store, so that none of their requests meets a closed
        server. Blocking; never raises."""
        try:
            # A connection of its own: the process's client may be held by a blocked
            # call (a Gloo constructor waiting for peers that never came).
            store = store.clone()
            store.set_timeout(timedelta(seconds=wait))
            count = int(store.add(SERVICES_KEY, 0))
            message = news.leaving_message(news.store_identity(store))
            keys = [f"{SERVICES_KEY}/{i}" for i in range(1, count + 1)]
            values = [
                store.get(k) if store.check([k]) else b"-" for k in keys
            ]  # (unlisted ones are deleted)
        except (
            AttributeError,
            RuntimeError,
        ):  # no clone, or the server is unusable already: nobody can be told
            return
        targets: dict[int, tuple[tuple[str, int], str]] = {}
        for i, raw in enumerate(values):
            text = raw.decode(errors="replace")
            if text != "-" and "|" in text:
                host, port = text.rsplit("|", 1)
                targets[i] = ((host, int(port)), message)
        if targets:
            procs.deliver_all(targets, wait, ack=True)

    @classmethod
    def stop_all(cls) -> None:
        """The interpreter exits: every beater ends after its current store call (no
        thread of ours may be inside one when the interpreter finalizes), every pulse
        closes."""
        with cls._lock:
            services = list(cls._running)
        for svc in services:
            svc._stopping = True
            svc._wake.set()
        for svc in services:
            svc._beater.join(1.0)
            if svc.pulse is not None:
                svc.pulse.close(join=0.5)


shutdown.on_exit(Service.stop_all)
