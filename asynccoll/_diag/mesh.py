"""The fingerprint checker's side channel: a full mesh of small TCP connections.

Set up once at ``init`` through the communicator's store (:func:`connect`: each
rank publishes its listening address and a token, connects to every peer, and
accepts every peer's connection). Then one reader thread per mesh polls the
peers' sockets. Sending never blocks: what a socket does not take at once spills
into that peer's outbox, which the reader thread drains as the socket becomes
writable, and sends out before the sockets close (bounded: ``_LINGER``).

A frame is ``(tag, k, seq, text)``. Received frames wait in :attr:`Mesh.inbox`
under ``(peer, tag, k)`` until the user takes them; a peer whose connection closed
is in :attr:`Mesh.gone`. The user (the checker) shares :attr:`Mesh.lock`, under which
every send, pull and inbox access happens, and is told after each wake-up of the
reader thread that frames may have arrived (:meth:`MeshUser.frames_arrived`).

Ownership: the user holds the mesh; the mesh holds the user weakly, and the reader
thread holds the mesh weakly between wake-ups, so a user dropped without
``close()`` (its communicator collected) still ends the thread and its sockets.
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
from typing import Any, Protocol, Sequence

from .._core.objects import poll_keys

_FRAME = "\x1d"
_LEN = struct.Struct("!I")
_HELLO = struct.Struct("!16sI")  # the listener's token, the connecting rank
#: How long a closing mesh goes on sending what its outboxes hold (``Mesh._linger``).
_LINGER = 1.0


class MeshUser(Protocol):
    """Who reads the mesh's frames (the fingerprint checker)."""

    def frames_arrived(self) -> None:
        """Reader thread, after a wake-up, outside the lock: decide what the inbox allows."""

    def crashed(self, exc: Exception) -> None:
        """Reader thread: it failed with ``exc`` and stops; nothing more will arrive."""


class Mesh:
    """Connections to every peer, their outboxes, the inbox and the reader thread."""

    def __init__(
        self,
        rank: int,
        outgoing: dict[int, socket.socket],
        incoming: dict[int, socket.socket],
        user: MeshUser,
    ) -> None:
        self.peers = tuple(sorted(outgoing))
        self._out = outgoing
        self._in = incoming
        # Reentrant: the user calls in while holding it (a submit under it may settle a
        # Work, whose abort path comes back to the user and here on the same thread).
        self.lock = threading.RLock()
        #: Frames received and not yet taken: ``(peer, tag, k) -> (seq, text)``.
        self.inbox: dict[tuple[int, str, int], tuple[int, str]] = {}
        #: Peers whose connection closed.
        self.gone: set[int] = set()
        self.closed = False
        self._outbox: dict[int, collections.deque[bytes]] = {
            q: collections.deque() for q in outgoing
        }
        self._spill = False  # some outbox holds bytes the socket did not take
        self._bufs = {p: bytearray() for p in incoming}  # partial frames per peer
        self._user = weakref.ref(user)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        for s in (*incoming.values(), *outgoing.values()):
            # Here, before anyone can call pull() or send(): an op issued before the
            # reader thread first ran once met a blocking recv (it waited for the
            # peer's next frame; under CPU load a test hung in it).
            s.setblocking(False)
        sockets = [*incoming.values(), *outgoing.values(), self._wake_r, self._wake_w]
        weakref.finalize(self, _poke, self._wake_w)
        self._thread = threading.Thread(
            target=_reader,
            args=(weakref.ref(self), sockets),
            name=f"asynccoll-fingerprints-r{rank}",
            daemon=True,
        )

    def start(self) -> None:
        """Start the reader thread (once the user is ready for :meth:`MeshUser.frames_arrived`)."""
        self._thread.start()

    # ------------------------------------------------------------ user side (lock held)
    def send(self, peers: Sequence[int], tag: str, k: int, seq: int, text: str) -> None:
        """Write one frame to ``peers`` without blocking (lock held)."""
        frame = _frame(tag, k, seq, text)
        for q in peers:
            if q in self.gone:
                continue
            pending = self._outbox[q]
            if pending:
                pending.append(frame)
                continue
            try:
                n = self._out[q].send(frame)
            except BlockingIOError:
                n = 0
            except OSError:  # the peer is gone; what it still needed no longer matters
                self.gone.add(q)
                continue
            if n < len(frame):
                pending.append(frame[n:])
                self._spill = True
                self.wake()

    def pull(self, peer: int, everything: bool = False) -> bool:
        """Move what the kernel holds from ``peer`` into the inbox (lock held, never blocks):
        one read, or with ``everything`` until the kernel holds no more.

        Both the reader thread and an issuing thread call it; the lock keeps the
        byte stream whole. True when the peer's channel closed.
        """
        while True:
            try:
                data = self._in[peer].recv(1 << 16)
            except BlockingIOError:
                return False
            except OSError:
                data = b""
            if not data:
                self.gone.add(peer)
                return True
            buf = self._bufs[peer]
            buf += data
            inbox = self.inbox
            while len(buf) >= 4:
                (n,) = _LEN.unpack_from(buf)
                if len(buf) < 4 + n:
                    break
                tag, k, seq, text = bytes(buf[4 : 4 + n]).decode().split(_FRAME, 3)
                del buf[: 4 + n]
                inbox[(peer, tag, int(k))] = (int(seq), text)
            if not everything:
                return False

    def wake(self) -> None:
        """Wake the reader thread (any thread)."""
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):  # already woken, or closing
            pass

    def close(self) -> None:
        """Stop the reader thread (it closes the sockets). Idempotent, never blocks."""
        self.closed = True
        self.wake()

    # ------------------------------------------------------------ reader thread
    def _round(
        self,
        poller: Any,
        events: list[tuple[int, int]],
        by_fd: dict[int, Any],
        out_fds: dict[int, int],
        writing: set[int],
    ) -> set[int]:
        """One wake-up: read, flush, let the user decide. Returns the peers whose sockets
        are now watched for writability."""
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
            else:
                with self.lock:
                    if self.pull(peer):
                        poller.unregister(fd)
        if self.closed:
            return writing
        user = self._user()
        if user is not None:
            user.frames_arrived()
            del user
        with self.lock:
            want = (
                {q for q, pending in self._outbox.items() if pending and q not in self.gone}
                if self._spill
                else set()
            )
            self._spill = bool(want)
        if want or writing:
            for q in want - writing:
                poller.register(self._out[q], select.POLLOUT)
            for q in writing - want:
                poller.unregister(self._out[q])
        return want

    def _flush(self, q: int) -> None:
        with self.lock:
            pending = self._outbox[q]
            while pending:
                try:
                    n = self._out[q].send(pending[0])
                except BlockingIOError:
                    return
                except OSError:
                    self.gone.add(q)
                    pending.clear()
                    return
                if n < len(pending[0]):
                    pending[0] = pending[0][n:]
                    return
                pending.popleft()

    def _linger(self) -> None:
        """Closing (reader thread): send what the outboxes still hold, for at most
        ``_LINGER`` seconds, before the sockets close. A peer then reads every fingerprint
        this rank sent before it sees the channel close: a rank that aborts on a mismatch
        has sent its fingerprint of that op, and the peers decide the same mismatch from
        it (without it they would name this rank as failed: ``PeerFailure``)."""
        end = time.monotonic() + _LINGER
        with self.lock:
            left = {q for q, pending in self._outbox.items() if pending and q not in self.gone}
        while left:
            wait = end - time.monotonic()
            if wait <= 0:
                return
            poller = select.poll()
            for q in left:
                poller.register(self._out[q], select.POLLOUT)
            for fd, _mask in poller.poll(wait * 1000):
                q = next(q for q in left if self._out[q].fileno() == fd)
                self._flush(q)
            with self.lock:
                left = {q for q in left if self._outbox[q] and q not in self.gone}

    def _crashed(self, exc: Exception) -> None:
        """A bug in the reader thread must not leave the user waiting silently."""
        threading.excepthook(threading.ExceptHookArgs((type(exc), exc, exc.__traceback__, None)))
        user = self._user()
        if user is not None:
            user.crashed(exc)


def _poke(wake: socket.socket) -> None:
    try:
        wake.send(b"x")
    except OSError:  # already closed by the thread, or its buffer is full (a wake is pending)
        pass


def _reader(ref: weakref.ReferenceType[Mesh], sockets: list[socket.socket]) -> None:
    """The reader thread: poll the peers' sockets, hand each wake-up to the mesh while it
    lives, close every socket at the end."""
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
            by_fd[s.fileno()] = p
            poller.register(s, select.POLLIN)
        out_fds = {s.fileno(): q for q, s in me._out.items()}
        writing: set[int] = set()
        del me
        while True:
            events = poller.poll()
            me = ref()
            if me is None:
                return
            if me.closed:
                me._linger()
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


def _frame(tag: str, k: int, seq: int, text: str) -> bytes:
    payload = f"{tag}{_FRAME}{k}{_FRAME}{seq}{_FRAME}{text}".encode()
    return _LEN.pack(len(payload)) + payload


def connect(
    store: Any, rank: int, world_size: int, timeout: float, host: str | None = None
) -> tuple[dict[int, socket.socket], dict[int, socket.socket]]:
    """Build the mesh's connections through ``store`` (blocking, bounded by ``timeout``;
    run off the loop): the sockets to each peer, and each peer's socket to this rank."""
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
            raise TimeoutError(
                f"fingerprint channel: peers did not publish addresses within {timeout} s"
            )
        for key, raw in zip(keys, store.multi_get(keys)):
            peer = int(key.rsplit("/", 1)[1])
            peer_addr, port, peer_token = raw.decode().split("|")
            s = socket.create_connection(
                (peer_addr, int(port)), timeout=max(0.1, deadline - time.monotonic())
            )
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
    return outgoing, incoming


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
