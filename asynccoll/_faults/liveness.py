"""Liveness of one communicator's ranks: heartbeats, abort news, the store's loss.

Owns a communicator's :class:`Liveness` member of its process's shared
:class:`~.service.Service` (one per store server), and through it the communicator's
:class:`~.census.Census` (who failed, as every survivor names them). Invariants:

* a rank is named failed only on proof of death (``procs``), never for being slow;
* a failure names the census's ranks (first writer wins: ``census.py``);
* once ``goodbye()`` returns, this member makes no store request.

How the census, heartbeat detection and abort news work: ``docs/design.md``.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
import weakref
from typing import Any, Callable

from .._base import shutdown
from .._base.errors import CommAborted, PeerFailure
from .._base.storekeys import peek
from . import news, procs
from .census import Census, Roster, watched
from .service import Service, StoreHost, root_of

_COUNT = itertools.count(1)
#: Without heartbeat detection, how often the store is read for abort news (the
#: pulse brings it at once; this only backs it up). Few requests in flight means
#: few that a store host dying at that instant would fail (each prints a C++ trace).
_FALLBACK_EVERY = 2.0
#: The host rank writes ``host`` as it starts; after this the others stop looking.
_HOST_KNOWN_AFTER = 5.0
#: How long ``goodbye`` waits for a beat in flight (a few store requests) to end.
_QUIESCE_WITHIN = 5.0
#: Store errors: torch raises DistError subclasses (or RuntimeError) for a broken store.
_STORE_ERRORS = (RuntimeError, ValueError)


def _idle() -> bool:
    return False


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
        misses: int = 3,
    ) -> None:
        self._store = store
        self.root = root_of(store)
        self._rank = rank
        self._world_size = world_size
        self.interval = interval
        self.detect = detect
        self._misses = misses
        #: Where failures go (``start``); until then the first is kept in ``_early``.
        self._on_failure: Callable[[BaseException], None] | None = None
        self._early: BaseException | None = None
        self.id = next(_COUNT)
        #: The communicator's token, agreed through its namespace at start (``news``).
        self.namespace = ""
        self._closed = False  # close(): say goodbye, leave the service
        self._aborted = False  # no more news or detection; still beats until closed
        self.urgent = False
        self.due = 0.0
        self._lock = threading.Lock()
        self._abort_reason: str | None = None
        self._left_service = False
        self._said_bye = False
        self._roster = Roster(store, rank, world_size, self.store_usable)
        self._census = Census(store, self._roster, self)
        self._service: Service | None = None
        self._watch = watched(rank, world_size) if detect else []
        self._seen: dict[int, tuple[bytes, float, int]] = {}
        self._last_tick = 0.0
        #: Why the store can no longer be used, or None.
        self.store_gone: str | None = None
        self._host_rank: int | None = None
        self._started = time.monotonic()
        self._next_read = 0.0
        #: Whether the communicator has an op pending (its ``Resources`` sets it): while
        #: one is, a member without heartbeat detection looks at every beat for peers on
        #: this machine whose process is gone (``_fail_the_gone``).
        self.busy: Callable[[], bool] = _idle

    @property
    def bound(self) -> float:
        """Seconds of silence after which a rank counts as failed."""
        return self._misses * self.interval

    @property
    def dead(self) -> tuple[int, ...]:
        return self._census.dead

    @property
    def closed(self) -> bool:
        """``stop()`` or ``goodbye()`` ran: the communicator is closing or closed."""
        return self._closed

    # ------------------------------------------------------------ lifecycle
    def publish(self, namespace: str | None = None) -> None:
        """Join the process's service, create this rank's keys and publish its process
        (blocking: store requests; on the creation's thread, before its end barrier, so
        that every rank's keys exist once any rank's creation returns). Not beaten, and
        no failure delivered, before :meth:`start`.

        ``namespace``: the communicator's token in pulse messages, where every rank
        derives the same one (a subgroup's, from its parent's): no request waits for an
        answer then, and the keys exist once the next answered request on this store
        connection returns (the creation's end barrier). Otherwise the ranks agree on a
        random one through the store (the first proposal stored wins)."""
        self.due = (
            time.monotonic() + 3600.0
        )  # not beaten before its keys exist (a read would wait for them)
        svc = Service.join(self)
        self._service = svc
        store = self._store
        if self.detect:
            store.add(f"hb/{self._rank}", 1)
            for r in self._watch:
                store.add(f"hb/{r}", 0)  # exists from now on: a beat reads them in one request
        # Appending nothing makes a key exist (empty) and leaves one that does alone, and
        # like ``set`` waits for no answer; the token's ``compare_set`` last does, so every
        # key exists once this returns.
        store.append("aborted", "")  # empty: no news; read at every beat
        store.append("host", "")
        machine, pid, started = procs.this_process()
        host, port = svc.pulse.address if svc.pulse is not None else ("", 0)
        store.set(
            f"proc/{self._rank}", procs.Peer(self.id, machine, pid, started, host, port).encode()
        )
        if svc.host.here:
            store.set(
                "host", str(self._rank)
            )  # this process hosts the store: peers name it if it dies
        if namespace is None:
            token = store.compare_set(news.NAMESPACE_KEY, "", secrets.token_hex(8))
            namespace = bytes(token).decode(errors="replace")
        self.namespace = namespace

    def start(self, on_failure: Callable[[BaseException], None]) -> None:
        """Begin beating (never blocks, after :meth:`publish`); failures go to
        ``on_failure`` from now on (one that came before, as news, goes at once)."""
        with self._lock:
            self._on_failure = on_failure
            early, self._early = self._early, None
        self._last_tick = time.monotonic()
        self.due = self._last_tick + self.interval
        assert self._service is not None, "publish() first"
        self._service.wake()
        if early is not None:
            on_failure(early)

    def stop(self) -> None:
        """Stop beating: the service says goodbye for this rank, then drops it. Never blocks.

        A member that already said goodbye, has no news to send and left the service
        (a communicator that ``shrink()`` retired, then dropped) has nothing left to do:
        no service is started again for it (one was, for a moment, listed on the store
        while the peers may be counting its keys)."""
        with self._lock:
            self._closed = True
            done = self._said_bye and self._abort_reason is None and self._left_service
        if not done:
            self._keep()

    def goodbye(self) -> None:
        """``close()``: say goodbye now (blocking, bounded), then leave the service.

        Abort news not sent yet goes out first, from this thread. Once this returns,
        this member makes no more store requests (a beat in flight has ended; later
        ones see the goodbye): ``forget`` may delete the keys. Said once: again (the
        ``close()`` of a communicator that ``shrink()`` retired) writes nothing.
        """
        with self._lock:
            self._closed = True
            reason, self._abort_reason = self._abort_reason, None
            say, self._said_bye = not self._said_bye, True
        if not shutdown.exiting():
            gone = not self.store_usable()
            try:
                if reason is not None:
                    self._publish(reason, gone)
                if say and not gone:
                    self._store.set(f"bye/{self._rank}", "1")
            except _STORE_ERRORS:  # the store failed meanwhile: the service notices
                pass
        self._keep()
        svc = self._service
        if svc is not None:
            svc.quiesce(_QUIESCE_WITHIN)

    def hold(self) -> None:
        """Keep this process's service (its pulse, which the peers' census knocks on) up, even
        once this member has stopped, until :meth:`release`: ``shrink`` holds it while the
        survivors rebuild."""
        if self._service is not None:
            self._service.hold()

    def release(self) -> None:
        """Undo one :meth:`hold`."""
        if self._service is not None:
            self._service.release()

    def publish_abort(self, error: BaseException, *, wake: bool = True) -> None:
        """Tell the other ranks this communicator aborted (done by the service, not the caller).

        A ``PeerFailure`` travels as one, with its ranks, so every survivor knows
        which ranks to leave out when it shrinks; a ``CollectiveMismatch`` (the error
        or its cause) travels whole, so every rank raises it (``news``). ``wake=False``: the news is
        recorded and the service not woken yet (:meth:`wake` does it); its next
        beat sends the news at the latest.
        """
        reason = news.encode(self._rank, error)
        with self._lock:
            self._abort_reason = reason
            self._aborted = True
        self._keep(wake)

    def wake(self) -> None:
        """Have the service send the news recorded with ``publish_abort(..., wake=False)`` now."""
        svc = self._service
        if svc is not None and self.urgent:
            svc.wake()

    def _keep(self, wake: bool = True) -> None:
        """Have the service run this member until its news and goodbye are out, even
        after it left the service (a close may have raced ahead of the abort)."""
        if shutdown.exiting():
            return  # the interpreter exits: no thread starts, no goodbye is written
        with self._lock:
            rejoin = self._left_service or self._service is None
            self._left_service = False
            svc = Service.join(self) if rejoin else self._service
            assert svc is not None
            self._service = svc
            self.urgent = True
            svc.keep(self, wake)

    # ------------------------------------------------------------- the beat
    def tick(self, store_gone: bool) -> bool:
        """One beat (service thread). False when this member leaves the service.

        An aborted communicator keeps beating (its process is alive) until it is
        closed or collected.
        """
        self.urgent = False
        if shutdown.exiting():
            return True  # no store call while the interpreter exits
        with self._lock:
            reason, self._abort_reason = self._abort_reason, None
        try:
            if reason is not None:
                self._publish(reason, store_gone)
            if self._closed:
                if not store_gone and not self._said_bye:
                    self._store.set(f"bye/{self._rank}", "1")
                    self._said_bye = True
                with self._lock:
                    if self._abort_reason is not None:
                        return True  # news arrived meanwhile: out at the next round
                    self._left_service = True
                    if self._service is not None:
                        self._service.leave(self)
                return False
            if store_gone:
                return True
            now = time.monotonic()
            starved = now - self._last_tick > 2 * self.interval + 0.5
            self._last_tick = now
            if not self.detect and not self._aborted and self.busy():
                self._fail_the_gone()
                if self.store_gone is not None:
                    return True  # its host died meanwhile: no request may meet a dead server
            if not self.detect and self._host_rank is not None and now < self._next_read:
                return True  # abort news comes to the pulse; the store is read now and then only
            self._next_read = now + _FALLBACK_EVERY
            keys = ["aborted", "host"] + [f"hb/{r}" for r in self._watch]
            if not self._store.check(keys):
                # Deleted by the other ranks, which counted this one out as dead while it
                # was stopped or starved: a multi_get would wait for them until the store's
                # timeout, holding the process's store connection all that time.
                self._declare(
                    CommAborted(
                        "this communicator's keys are gone from the store: its other ranks "
                        "counted this rank out (it was stopped or starved of CPU meanwhile)"
                    )
                )
                return True
            if self.detect:
                self._store.add(f"hb/{self._rank}", 1)
            values = self._store.multi_get(keys)
            if values[1]:
                self._host_rank = int(values[1])
            elif now - self._started > _HOST_KNOWN_AFTER:
                self._host_rank = -1  # not hosted by a rank of this communicator
            if values[0] and not self._aborted:
                self.deliver(values[0].decode(errors="replace"))
            elif self.detect and not self._aborted:
                self._check(values[2:], now, starved)
            elif len(self._roster.cache) < self._world_size - 1:
                # The peers' processes, for ``_fail_the_gone``: read here, beside this read,
                # not at the first beat that finds an op pending (a request at a random
                # moment: a store host killed then left it without an answer, and torch
                # printed a C++ trace for it).
                self.peers()
        except _STORE_ERRORS as exc:  # the store server is gone or broken
            svc = self._service
            if svc is not None and self.store_gone is None:
                svc.lose_store(f"the rendezvous store failed: {exc}", died=True)
            return not self._closed
        return True

    def _check(self, values: list[bytes], now: float, starved: bool) -> None:
        """Heartbeat detection over the watched ranks (service thread)."""
        stale = []
        for r, value in zip(self._watch, values):
            seen = self._seen.get(r)
            if seen is None or value != seen[0] or starved:
                # A move, or this process did not run for a while: count afresh.
                self._seen[r] = (value, now, 0)
                continue
            old, since, count = seen
            self._seen[r] = (old, since, count + 1)
            if count + 1 >= self._misses and now - since > self.bound:
                stale.append(r)
        stale = [r for r in stale if not self._left(r)]
        if not stale:
            return
        dead = self.probe(stale, stopped_failed=True)
        if not dead:
            for r in stale:  # alive (busy, starved of CPU, holding its GIL): count afresh
                self._seen[r] = (self._seen[r][0], time.monotonic(), 0)
            return
        self._census.mark(dead)
        ranks = self._census.take() or dead
        self._declare(
            PeerFailure(
                f"no heartbeat from rank(s) {list(dead)} for {self._misses} x {self.interval:g} s",
                ranks,
            )
        )

    def _fail_the_gone(self) -> None:
        """Without heartbeats (service thread, while an op is pending): a peer on this
        machine whose process is gone fails the communicator now, on proof of death.

        Gloo reports most lost peers itself, within a fraction of a second, but not one
        it is already sending data to: that send waits for the op's timeout (gloo's
        ``tcp/pair.cc``, ``Pair::signalException``, wakes the sends still waiting for the
        peer to be ready; seen with torch 2.13: a 256 MB broadcast's root waited out its
        deadline for a receiver SIGKILLed mid-transfer). One ``/proc`` read per local
        peer and beat (the peers' records are read beside the periodic store read), and a
        store request or two only once one is gone.

        A process that is gone is a failure only while the store can say it did not
        leave on its own: a peer that said goodbye is not one; abort news already
        written is this communicator's verdict (a peer may have left because of it);
        and once the store is lost its host's death is the verdict (``store_lost``),
        as the survivors leave without a goodbye they can no longer write."""
        gone = procs.gone_among(list(self._roster.cache.items()))
        if not gone or not self.store_usable():
            return
        raw = peek(self._store, "aborted")
        if raw is None:
            return  # the keys are gone: this rank was counted out (the next read says so)
        if raw:  # an abort came first: deliver its news, name nobody else
            self.deliver(raw)
            return
        dead = tuple(r for r in gone if not self._left(r))
        if not dead or not self.store_usable():
            return
        # The census record names the failure (first writer wins), not this beat's view:
        # a survivor whose ``dead`` differed from the record would shrink apart from the
        # others (a second peer dying a moment later: the record's shrink gives up its build).
        ranks = self._census.take(dead) or dead
        self._declare(
            PeerFailure(f"the process of rank(s) {list(dead)} is gone (an op was pending)", ranks)
        )

    def _declare(self, failure: BaseException) -> None:
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            if isinstance(failure, PeerFailure):
                self._census.mark(failure.ranks)
            on_failure = self._on_failure
            if on_failure is None:  # published, not started: ``start`` delivers it
                self._early = failure
                return
        on_failure(failure)

    def deliver(self, raw: str) -> None:
        """A peer's abort news (service thread)."""
        if self._aborted:
            return
        self._declare(news.decode(raw))

    def _publish(self, reason: str, store_gone: bool) -> None:
        if not store_gone:
            if self._store.compare_set("aborted", "", reason).decode(errors="replace") != reason:
                return  # a peer's abort came first: every rank has that news already
        peers = self._roster.cache if store_gone else self.peers()
        by_process: dict[tuple[str, int], list[int]] = {}  # one message per peer process
        for p in peers.values():
            if p.address is not None and not (p.local and p.state() == "gone"):
                by_process.setdefault(p.address, []).append(p.mid)
        svc = self._service
        store = svc.identity if svc is not None else ""
        targets = {
            i: (address, news.abort_message(store, self.namespace, mids, reason))
            for i, (address, mids) in enumerate(by_process.items())
        }
        procs.deliver_all(targets, 1.0, ack=False)

    # --------------------------------------------------------- the store lost
    def store_lost(self, why: str, died: bool, host: StoreHost) -> None:
        """The store can no longer be used (service thread). ``died``: its host
        process is gone without closing it: a failure of the rank it was, if any."""
        self.store_gone = why
        if self._closed or self._aborted or not died:
            return
        rank = self._host_of(host)
        if rank is not None:
            self._declare(
                PeerFailure(f"rank {rank} hosted the rendezvous store and is gone: {why}", (rank,))
            )
        else:
            self._declare(CommAborted(why))

    def _host_of(self, host: StoreHost) -> int | None:
        if self._host_rank is not None:
            return self._host_rank if self._host_rank >= 0 else None
        for r, p in self._roster.cache.items():
            if host.pid and p.same_process(host.machine, host.pid, host.start):
                return r
        return None

    def store_usable(self) -> bool:
        """Whether the store may still be used (its host is alive; looked at now)."""
        svc = self._service
        if svc is not None:
            svc.check_host()
        return self.store_gone is None

    def failure(self) -> BaseException | None:
        """The error for an operation that needs the store when it is gone, else None."""
        self.store_usable()
        why = self.store_gone
        if why is None:
            return None
        rank = self.lost_store_host()
        if rank is not None:
            return PeerFailure(
                f"rank {rank} hosted the rendezvous store and is gone: {why}", (rank,)
            )
        return CommAborted(
            f"{why}: the store must outlive the ranks that use it (host it apart: python -m asynccoll.store, "
            "or torchrun's agent)"
        )

    # ---------------------------------------------------------------- peers
    def peers(self, ranks: list[int] | None = None) -> dict[int, procs.Peer]:
        """What each peer (of ``ranks``, default all) published about its process."""
        return self._roster.peers(ranks)

    def _left(self, rank: int) -> bool:
        return self._roster.left(rank)

    def probe(
        self,
        ranks: list[int],
        *,
        bound: float | None = None,
        stopped_failed: bool = False,
        eliminate: bool = False,
    ) -> tuple[int, ...]:
        """Which of ``ranks`` failed, on proof only (``Roster.probe``; at most about ``bound``
        seconds, default the detection bound)."""
        return self._roster.probe(
            ranks,
            bound=self.bound if bound is None else bound,
            stopped_failed=stopped_failed,
            eliminate=eliminate,
        )

    def gone_silently(self) -> tuple[int, ...]:
        """The other ranks whose processes are proven gone and that never said goodbye
        (blocking, bounded by the detection bound): at the close of an aborted
        communicator, the ranks that will never count themselves out of its keys.

        Only ranks that published their process are probed (one that has not yet
        may still be starting), and proof only: a stopped process may resume.
        """
        if not self.store_usable():
            return ()
        published = sorted(self.peers(self._roster.others()))
        dead = self.probe(published) if published else ()
        return tuple(r for r in dead if not self._store.check([f"bye/{r}"]))

    # ---------------------------------------------------------------- census
    def lost_store_host(self) -> int | None:
        """The rank that hosted the store, where the store is lost with it (not left)."""
        svc = self._service
        return self._host_of(svc.host) if svc is not None and not svc.host_left else None

    def record(self) -> tuple[int, ...] | None:
        """The failed set every survivor agreed on (first census result), or None."""
        return self._census.record()

    @property
    def census(self) -> Callable[[], tuple[int, ...]]:
        """``census()``: the ranks that failed, as every survivor names them
        (``Census.take``), after a transport error proved that some peer failed.

        The callable holds the census weakly: a backend keeps it, and must not keep a
        dropped communicator's membership (and its heartbeats) alive.
        """
        ref = weakref.ref(self._census)

        def census() -> tuple[int, ...]:
            me = ref()
            return me.take() if me is not None else ()

        return census

    def failure_among(self, ranks: list[int]) -> BaseException | None:
        """See ``Census.failure_among``."""
        return self._census.failure_among(ranks)
