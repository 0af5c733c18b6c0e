"""``check="fingerprint"``: every operation is compared across ranks before it reaches the backend.

Why before: Gloo does not survive most mismatches. An all_reduce of different sizes
SIGABRTs the process, a dtype, reduce-op or broadcast-size mismatch returns garbage,
and ops issued in a different order hang. So each op is *held* until the peers'
fingerprints for it have arrived and agree; only then is it submitted.

Fingerprints travel on a side channel of their own: a full mesh of small TCP
connections set up at ``init`` (addresses and a per-rank token exchanged through
the communicator's store), one reader thread per communicator. The issuing thread
writes its fingerprint to the peers at once (a non-blocking send; a full socket
buffer spills into an outbox drained by the reader thread). In the common case a
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
it. A peer whose channel closes before sending a fingerprint that an op waits for
fails that op with ``PeerFailure`` naming it. The op's deadline still bounds the
wait for a peer that is alive but never issues the op.

Scope: backends that submit from any thread (Gloo, wrapped torch groups) and object
collectives. The NCCL backend is not wrapped yet: its ``submit`` records the
caller's current CUDA stream, which only the issuing thread knows; checking it needs
that capture split from the launch (capture at issue, launch after the check).
"""

from __future__ import annotations

import collections
import secrets
import select
import socket
import struct
import threading
import time
import weakref
from typing import Any, Callable, Literal, Sequence

from .._base.errors import CommAborted, PeerFailure
from .._base.ops import OpKind, OpSpec
from .._core.backend import Backend, Sink
from .._core.objects import poll_keys
from .._core.work import Bundle, Work
from .mismatch import MEMBERS as _MEM
from .mismatch import P2P as _P2P
from .mismatch import fingerprint, mismatch, object_fingerprint

_FRAME = "\x1d"
_LEN = struct.Struct("!I")
_HELLO = struct.Struct("!16sI")  # the listener's token, the connecting rank


# ---------------------------------------------------------------- the checker
class _Entry:
    """One held unit: its requirements (tag, index, peers, fingerprint), how to submit it."""

    __slots__ = ("reqs", "submit", "works", "seq", "what")

    def __init__(self, reqs: list[tuple[str, int, tuple[int, ...], str]], submit: Callable[[], None],
                 works: Sequence[Work], seq: int, what: str | None) -> None:
        self.reqs = reqs
        self.submit = submit
        self.works = works
        self.seq = seq
        self.what = what


# What a peer sends for each of my requirement tags: my collective k needs their
# collective k; my send k to q needs q's recv k from me; my recv needs q's send.
_NEEDS = {"C": "C", "S": "R", "R": "S"}


class FingerprintChecker:
    """The side channel and the held ops of one communicator (module docstring)."""

    def __init__(self, rank: int, world_size: int, outgoing: dict[int, socket.socket],
                 incoming: dict[int, socket.socket]) -> None:
        self.rank = rank
        self.world_size = world_size
        self._peers = tuple(sorted(outgoing))
        self._out = outgoing
        self._in = incoming
        # Reentrant: a submit made under it may settle a Work, whose abort path
        # comes back here (close, waiting) on the same thread.
        self._lock = threading.RLock()
        self._coll = 0
        self._sends: dict[int, int] = collections.defaultdict(int)
        self._recvs: dict[int, int] = collections.defaultdict(int)
        self._inbox: dict[tuple[int, str, int], tuple[int, str]] = {}
        self._queues: dict[Any, collections.deque[_Entry]] = {}
        self._outbox: dict[int, collections.deque[bytes]] = {q: collections.deque() for q in outgoing}
        self._gone: set[int] = set()
        self._closed = False
        self._spill = False  # some outbox holds bytes the socket did not take
        self._bufs = {p: bytearray() for p in incoming}  # partial frames per peer
        self._broken = False  # a verdict failed: submit nothing more (the abort follows)
        # Verdicts reached in an issuing thread (which holds the communicator's
        # lock): failed by the reader thread, since failing aborts the communicator.
        self._fail_later: list[tuple[Sequence[Work], BaseException]] = []
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        # The thread holds the checker only through a weak reference between
        # wake-ups, and the finalizer wakes it: a checker dropped without close()
        # (its communicator collected) still ends its thread and sockets.
        sockets = [*incoming.values(), *outgoing.values(), self._wake_r, self._wake_w]
        weakref.finalize(self, _poke, self._wake_w)
        self._thread = threading.Thread(
            target=_reader, args=(weakref.ref(self), sockets), name=f"asynccoll-fingerprints-r{rank}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------ setup
    @classmethod
    def connect(cls, store: Any, rank: int, world_size: int, timeout: float,
                host: str | None = None) -> FingerprintChecker:
        """Build the mesh through ``store`` (blocking, bounded by ``timeout``; run off the loop)."""
        addr = _local_address(host)
        deadline = time.monotonic() + timeout
        listener = socket.create_server((addr, 0), backlog=max(world_size, 8))
        token = secrets.token_hex(16)
        outgoing: dict[int, socket.socket] = {}
        incoming: dict[int, socket.socket] = {}
        try:
            store.set(f"fp/addr/{rank}", f"{addr}|{listener.getsockname()[1]}|{token}")
            keys = [f"fp/addr/{r}" for r in range(world_size) if r != rank]
            if not poll_keys(store, keys, deadline):
                raise TimeoutError(f"fingerprint channel: peers did not publish addresses within {timeout} s")
            for key, raw in zip(keys, store.multi_get(keys)):
                peer = int(key.rsplit("/", 1)[1])
                peer_addr, port, peer_token = raw.decode().split("|")
                s = socket.create_connection((peer_addr, int(port)), timeout=max(0.1, deadline - time.monotonic()))
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.sendall(_HELLO.pack(bytes.fromhex(peer_token), rank))
                s.setblocking(False)
                outgoing[peer] = s
            while len(incoming) < world_size - 1:
                listener.settimeout(max(0.01, deadline - time.monotonic()))
                conn, _ = listener.accept()
                conn.settimeout(max(0.1, deadline - time.monotonic()))
                # Exactly the hello: the peer may already be sending frames after it.
                hello = b""
                while len(hello) < _HELLO.size:
                    chunk = conn.recv(_HELLO.size - len(hello))
                    if not chunk:
                        break
                    hello += chunk
                if len(hello) < _HELLO.size:
                    conn.close()
                    continue
                got, peer = _HELLO.unpack(hello)
                if got != bytes.fromhex(token) or not 0 <= peer < world_size or peer in incoming:
                    conn.close()  # not one of our peers
                    continue
                incoming[peer] = conn
        except BaseException:
            for s in [*outgoing.values(), *incoming.values()]:
                s.close()
            raise
        finally:
            listener.close()
        return cls(rank, world_size, outgoing, incoming)

    def wrap(self, backend: Backend) -> Backend:
        """``backend`` with every submission held until its fingerprints agree."""
        return CheckedBackend(backend, self)

    #: Where failures go: the communicator's ledger (set when the wrapped backend is bound).
    sink: Sink | None = None

    def _fail(self, failures: list[tuple[Sequence[Work], BaseException]]) -> None:
        """Fail each unit's Works (outside every lock: failing aborts the communicator)."""
        sink = self.sink
        if sink is None:
            return
        for works, exc in failures:
            sink.fail(works[0] if len(works) == 1 else Bundle(list(works), works[0].op), exc)

    # ------------------------------------------------------------ issue side
    def gate_op(self, spec: OpSpec, work: Work, submit: Callable[[], None]) -> None:
        kind = spec.kind
        if kind is OpKind.SEND or kind is OpKind.RECV:
            self._gate_p2p(kind is OpKind.SEND, spec.peer, fingerprint(spec), submit, [work], work.seq)
        else:
            self._gate(fingerprint(spec), (), submit, [work], work.seq, None)

    def gate_batch(self, specs: Sequence[OpSpec], works: Sequence[Work], submit: Callable[[], None]) -> None:
        coll = [fingerprint(s) for s in specs if s.kind not in _P2P]
        p2p = [(s.kind is OpKind.SEND, s.peer, fingerprint(s), w.seq) for s, w in zip(specs, works) if s.kind in _P2P]
        self._gate(_MEM.join(coll) if coll else None, p2p, submit, works, works[0].seq, None)

    def gate_object(self, op: str, root: int, work: Work, submit: Callable[[], None]) -> None:
        self._gate(object_fingerprint(op, root), (), submit, [work], work.seq, None)

    def _gate_p2p(self, is_send: bool, peer: int, fp: str, submit: Callable[[], None],
                  works: Sequence[Work], seq: int) -> None:
        with self._lock:
            req = self._p2p_req(is_send, peer, fp, seq)
            self._enqueue(("S" if is_send else "R", peer), _Entry([req], submit, works, seq, None))

    def _p2p_req(self, is_send: bool, peer: int, fp: str, seq: int) -> tuple[str, int, tuple[int, ...], str]:
        counters, tag = (self._sends, "S") if is_send else (self._recvs, "R")
        k = counters[peer] = counters[peer] + 1
        self._send((peer,), _frame(tag, k, seq, fp))
        return (tag, k, (peer,), fp)

    def _gate(self, fp: str | None, p2p: Any, submit: Callable[[], None], works: Sequence[Work],
              seq: int, what: str | None) -> None:
        with self._lock:
            reqs = []
            if fp is not None:
                k = self._coll = self._coll + 1
                self._send(self._peers, _frame("C", k, seq, fp))
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
                        self._pull(p)
                verdict = self._verify(entry)
            if verdict is True:
                queue.popleft()
                entry.submit()  # an error here propagates to the caller, as without the check
            elif verdict is not None:
                queue.popleft()
                self._broken = True
                self._fail_later.append((entry.works, verdict))
                self._wake()

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
                            f"the matching operation", [p],
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
        """Held ops and the ranks whose fingerprints they wait for (for trace files)."""
        with self._lock:
            out = []
            for queue in self._queues.values():
                for entry in queue:
                    missing = sorted(
                        {p for tag, k, peers, _ in entry.reqs for p in peers if (p, _NEEDS[tag], k) not in self._inbox}
                    )
                    out.append({"seq": entry.seq, "ops": [w.op for w in entry.works], "waiting_for": missing})
            return out

    # ------------------------------------------------------------ wire
    def _send(self, peers: Sequence[int], frame: bytes) -> None:
        """Write ``frame`` to ``peers`` without blocking (lock held)."""
        for q in peers:
            if q in self._gone:
                continue
            box = self._outbox[q]
            if box:
                box.append(frame)
                continue
            try:
                n = self._out[q].send(frame)
            except BlockingIOError:
                n = 0
            except OSError:  # the peer is gone; what it still needed no longer matters
                self._gone.add(q)
                continue
            if n < len(frame):
                box.append(frame[n:])
                self._spill = True
                self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):  # already woken, or closing
            pass

    def _round(self, poller: Any, events: list[tuple[int, int]], by_fd: dict[int, Any],
               out_fds: dict[int, int], writing: set[int]) -> set[int]:
        """One wake-up of the reader thread: read, flush, decide held ops. Returns the
        peers whose sockets are now watched for writability."""
        for fd, mask in events:
            if fd in out_fds and mask & select.POLLOUT:
                self._flush(out_fds[fd])
                continue
            peer = by_fd.get(fd)
            if peer is None:
                try:
                    self._wake_r.recv(4096)
                except BlockingIOError:
                    pass
            elif self._read(peer):
                poller.unregister(fd)
        if self._closed:
            return writing
        with self._lock:
            failures = self._drain()
            want = {q for q, box in self._outbox.items() if box and q not in self._gone} if self._spill else set()
            self._spill = bool(want)
        if want or writing:
            for q in want - writing:
                poller.register(self._out[q], select.POLLOUT)
            for q in writing - want:
                poller.unregister(self._out[q])
        self._fail(failures)
        return want

    def _crashed(self, exc: Exception) -> None:
        """A bug in the reader thread must not leave held ops hanging silently."""
        threading.excepthook(threading.ExceptHookArgs((type(exc), exc, exc.__traceback__, None)))
        with self._lock:
            self._broken = True
            held = [e for q in self._queues.values() for e in q]
            self._queues.clear()
        err = CommAborted(f"fingerprint channel failed: {exc!r}")
        err.__cause__ = exc
        self._fail([(e.works, err) for e in held])

    def _read(self, peer: int) -> bool:
        """Reader thread: take what ``peer`` sent into the inbox; True when its channel closed."""
        with self._lock:
            return self._pull(peer)

    def _pull(self, peer: int) -> bool:
        """Move what the kernel holds from ``peer`` into the inbox (lock held, never blocks).

        Both the reader thread and an issuing thread call it; the lock keeps the
        byte stream whole. True when the peer's channel closed.
        """
        try:
            data = self._in[peer].recv(1 << 16)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self._gone.add(peer)
            return True
        buf = self._bufs[peer]
        buf += data
        inbox = self._inbox
        while len(buf) >= 4:
            (n,) = _LEN.unpack_from(buf)
            if len(buf) < 4 + n:
                break
            tag, k, seq, fp = bytes(buf[4:4 + n]).decode().split(_FRAME, 3)
            del buf[:4 + n]
            inbox[(peer, tag, int(k))] = (int(seq), fp)
        return False

    def _flush(self, q: int) -> None:
        with self._lock:
            box = self._outbox[q]
            while box:
                try:
                    n = self._out[q].send(box[0])
                except BlockingIOError:
                    return
                except OSError:
                    self._gone.add(q)
                    box.clear()
                    return
                if n < len(box[0]):
                    box[0] = box[0][n:]
                    return
                box.popleft()

    def close(self) -> None:
        """Stop the reader thread and drop held ops (their Works were failed by the
        communicator). Idempotent, never blocks."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queues.clear()
        self._wake()


def _poke(wake: socket.socket) -> None:
    try:
        wake.send(b"x")
    except OSError:  # already closed by the thread, or its buffer is full (a wake is pending)
        pass


def _reader(ref: weakref.ReferenceType[FingerprintChecker], sockets: list[socket.socket]) -> None:
    """The reader thread (see ``FingerprintChecker``): poll the peers' sockets, hand each
    wake-up to the checker while it lives, close every socket at the end."""
    # select.poll over raw fds: the selectors module costs tens of microseconds per
    # wake-up, and this loop sits on the critical path of held ops.
    me = ref()
    try:
        if me is None:
            return
        poller = select.poll()
        by_fd: dict[int, Any] = {me._wake_r.fileno(): None}
        poller.register(me._wake_r, select.POLLIN)
        for p, s in me._in.items():
            s.setblocking(False)
            by_fd[s.fileno()] = p
            poller.register(s, select.POLLIN)
        out_fds = {s.fileno(): q for q, s in me._out.items()}
        writing: set[int] = set()
        del me
        while True:
            events = poller.poll()
            me = ref()
            if me is None or me._closed:
                return
            try:
                writing = me._round(poller, events, by_fd, out_fds, writing)
            except Exception as exc:  # noqa: BLE001 - any failure here is reported, not raised (see the surrounding code)
                me._crashed(exc)
                return
            del me
    finally:
        for s in sockets:
            s.close()


def _frame(tag: str, k: int, seq: int, fp: str) -> bytes:
    payload = f"{tag}{_FRAME}{k}{_FRAME}{seq}{_FRAME}{fp}".encode()
    return _LEN.pack(len(payload)) + payload


def _local_address(host: str | None) -> str:
    """This machine's address on the route to ``host`` (the store's), or loopback."""
    if not host or host in ("localhost", "127.0.0.1", "::1", "::ffff:127.0.0.1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet is sent: this only picks the route
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def store_host(store: Any) -> str | None:
    """The host of the TCPStore under ``store`` (through PrefixStores), if any."""
    for _ in range(16):
        host = getattr(store, "host", None)
        if isinstance(host, str):
            return host
        store = getattr(store, "underlying_store", None)
        if store is None:
            return None
    return None


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
        self, store: Any, new_rank: int, new_size: int, exclude: Sequence[int], abort_pending: bool | None,
        timeout: float,
    ) -> Backend | None:
        return self._inner.shrink_agreed(store, new_rank, new_size, exclude, abort_pending, timeout)
