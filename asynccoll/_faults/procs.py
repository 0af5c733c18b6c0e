"""Proof of life and death for a peer process, without the peer running any Python.

Two signs, neither of which needs the peer's interpreter (a rank whose main
thread holds the GIL for seconds, in one ``pickle.dumps``, is alive):

* **the process table**, for a peer on this machine (same kernel boot and pid
  namespace, see ``MACHINE``): its ``/proc/<pid>/stat`` says whether it is gone
  (exited, killed, a zombie, or its pid reused), stopped (SIGSTOP) or running;
* **a TCP knock**, for a peer anywhere: each process listens on a socket of its
  own (:class:`Pulse`), and the peer's *kernel* completes a connection to it
  whether or not the process gets the CPU or the GIL. A refused connection
  (RST) means no process listens there any more: the peer is gone. No answer
  at all means its machine is unreachable; the caller decides how long that may
  last before it counts as death.

The same socket carries short messages to the process (a peer's abort news, the
store host leaving): the :class:`Pulse` thread reads them and hands them on.
"""

from __future__ import annotations

import errno
import os
import selectors
import socket
import struct
import threading
import time
from typing import Callable, Iterable, Mapping, NamedTuple

#: Largest message a Pulse accepts (abort news carries an error message).
MAX_MESSAGE = 64 << 10
#: Sockets open at once while knocking or sending (far below the usual fd limit).
_BATCH = 256


def read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # no such file: not Linux, or the process is gone
        return None


def start_time(pid: int) -> str | None:
    """The process's start time (``/proc/<pid>/stat`` field 22), None if unreadable."""
    stat = read_text(f"/proc/{pid}/stat")
    if stat is None:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _machine() -> str:
    """Who can read this process's entry in the process table: kernel boot and pid namespace.

    Two ranks with the same value run on one kernel in one pid namespace, so each
    can tell whether the other's process still exists. Empty where unknown.
    """
    boot = read_text("/proc/sys/kernel/random/boot_id")
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:  # no /proc: no process checks
        return ""
    return f"{boot.strip()}/{ns}" if boot else ""


MACHINE = _machine()


#: ``PF_EXITING`` in ``/proc/<pid>/stat``'s flags (include/linux/sched.h): set when
#: the process starts to exit, before its files (its sockets) are closed.
_PF_EXITING = 0x4


def process_state(pid: int, start: str) -> str:
    """``"gone"`` (exiting, exited, killed, a zombie, or its pid reused), ``"stopped"``
    (SIGSTOP) or ``"running"``, for a process of this machine.

    Exiting counts as gone: a peer sees the process's sockets close only after its
    exit began, so by then this says so."""
    stat = read_text(f"/proc/{pid}/stat")
    if stat is None:
        return "gone"
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X", "x") or fields[19] != start or int(fields[6]) & _PF_EXITING:
        return "gone"
    return "stopped" if fields[0] in ("T", "t") else "running"


def this_process() -> tuple[str, int, str]:
    """``(machine, pid, start)`` of the calling process (``machine`` empty where unknown)."""
    pid = os.getpid()  # (not at import: a forked process inherits the module)
    started = start_time(pid) or ""
    return (MACHINE if started else ""), pid, started


class Peer(NamedTuple):
    """What a rank published about its process (``Liveness.start``)."""

    mid: int
    machine: str
    pid: int
    start: str
    host: str
    port: int

    def encode(self) -> str:
        return f"{self.mid}|{self.machine}|{self.pid}|{self.start}|{self.host}|{self.port}"

    @classmethod
    def decode(cls, raw: bytes | str) -> Peer:
        text = raw.decode() if isinstance(raw, bytes) else raw
        mid, machine, pid, start, host, port = text.split("|")
        return cls(int(mid), machine, int(pid), start, host, int(port))

    @property
    def local(self) -> bool:
        """On this machine: the process table tells its state."""
        return bool(self.machine) and self.machine == MACHINE

    @property
    def address(self) -> tuple[str, int] | None:
        return (self.host, self.port) if self.port else None

    def same_process(self, machine: str, pid: int, start: str) -> bool:
        return bool(machine) and (self.machine, self.pid, self.start) == (machine, pid, start)

    def state(self) -> str:
        """See :func:`process_state` (only meaningful where ``local``)."""
        return process_state(self.pid, self.start)


# ------------------------------------------------------------------ knocking
_REFUSED = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.EHOSTDOWN,
}


def _open(address: tuple[str, int], *, reset: bool) -> socket.socket | bool:
    """A socket with a non-blocking connect to ``address`` under way; False: refused at once.

    ``reset``: close with RST (``SO_LINGER`` 0), as a knock does: it leaves no TIME_WAIT behind. A
    message is closed normally, so that nothing sent is discarded."""
    try:
        infos = socket.getaddrinfo(address[0], address[1], type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):  # no such host: nothing can answer there
        return False
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setblocking(False)
    if reset:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    code = sock.connect_ex(addr)
    if code in (0, errno.EINPROGRESS, errno.EAGAIN):
        return sock
    sock.close()
    return False


def knock(addresses: dict[int, tuple[str, int]], timeout: float) -> dict[int, bool | None]:
    """Knock on every address at once: True (a process listens: alive), False
    (refused: no process there), None (no answer within ``timeout`` seconds)."""
    result: dict[int, bool | None] = {}
    items = list(addresses.items())
    end = time.monotonic() + timeout
    for i in range(0, len(items), _BATCH):
        result.update(_knock_some(dict(items[i : i + _BATCH]), end))
    return result


def _knock_some(addresses: dict[int, tuple[str, int]], end: float) -> dict[int, bool | None]:
    result: dict[int, bool | None] = {}
    sel = selectors.DefaultSelector()
    try:
        for key, address in addresses.items():
            sock = _open(address, reset=True)
            if isinstance(sock, bool):
                result[key] = sock
            else:
                sel.register(sock, selectors.EVENT_WRITE, key)
        while sel.get_map():
            left = end - time.monotonic()
            if left <= 0:
                break
            for sk, _ in sel.select(left):
                conn = sk.fileobj
                assert isinstance(conn, socket.socket)
                code = conn.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code == 0:
                    result[sk.data] = True
                else:
                    result[sk.data] = False if code in _REFUSED else None
                sel.unregister(conn)
                conn.close()
        for sk in list(sel.get_map().values()):
            result[sk.data] = None
            sk.fileobj.close()  # type: ignore[union-attr]
    finally:
        sel.close()
    return result


def deliver_all(
    targets: Mapping[int, tuple[tuple[str, int] | None, str]], timeout: float, *, ack: bool
) -> dict[int, bool]:
    """Send each target's message to its :class:`Pulse`, all at once, within ``timeout``
    seconds; with ``ack``, a message counts as delivered once the Pulse acknowledged it.
    Returns which were delivered (False: refused, unreachable or too slow)."""
    result: dict[int, bool] = {}
    items = list(targets.items())
    end = time.monotonic() + timeout
    for i in range(0, len(items), _BATCH):
        result.update(_deliver_some(dict(items[i : i + _BATCH]), end, ack))
    return result


def _deliver_some(
    targets: Mapping[int, tuple[tuple[str, int] | None, str]], end: float, ack: bool
) -> dict[int, bool]:
    result: dict[int, bool] = {}
    sel = selectors.DefaultSelector()
    pending: dict[int, bytes] = {}
    try:
        for key, (address, message) in targets.items():
            sock = _open(address, reset=False) if address is not None else False
            if isinstance(sock, bool):
                result[key] = False
                continue
            pending[key] = message.encode()[:MAX_MESSAGE]
            sel.register(sock, selectors.EVENT_WRITE, key)
        while sel.get_map():
            left = end - time.monotonic()
            if left <= 0:
                break
            for sk, events in sel.select(left):
                conn, key = sk.fileobj, sk.data
                assert isinstance(conn, socket.socket)
                try:
                    if events & selectors.EVENT_WRITE:
                        if conn.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
                            raise ConnectionRefusedError
                        data = pending[key]
                        sent = conn.send(data)
                        pending[key] = data = data[sent:]
                        if data:
                            continue
                        conn.shutdown(socket.SHUT_WR)
                        if ack:
                            sel.modify(conn, selectors.EVENT_READ, key)
                            continue
                        result[key] = True
                    else:
                        result[key] = conn.recv(1) == b"k"
                except OSError:  # refused or reset: nobody there to tell
                    result[key] = False
                sel.unregister(conn)
                conn.close()
        for sk in list(sel.get_map().values()):
            result[sk.data] = False
            sk.fileobj.close()  # type: ignore[union-attr]
    finally:
        sel.close()
    return result


def local_address(toward: str | None) -> str:
    """The address of this machine as seen from ``toward`` (the store's host)."""
    if toward:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((toward, 9))  # no packet is sent: this only picks the route
                return str(probe.getsockname()[0])
        except OSError:  # not an IPv4 route (a name that does not resolve, IPv6 only)
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:  # no resolvable host name: only this machine can reach us
        return "127.0.0.1"


class Pulse:
    """A listening socket whose kernel answers knocks, and a thread that reads messages.

    ``handle(text)`` runs on the Pulse thread for every message; when it returns
    True the sender gets a one-byte acknowledgement. ``close()`` ends the thread.
    """

    def __init__(self, handle: Callable[[str], bool], toward: str | None, name: str) -> None:
        self._handle = handle
        host = local_address(toward)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind(("127.0.0.1" if host.startswith("127.") else "", 0))
            self._sock.listen(socket.SOMAXCONN)
        except OSError:
            self._sock.close()
            raise
        self.address = (host, int(self._sock.getsockname()[1]))
        self._closed = False
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # the socket was closed: the service ended
                return
            if self._closed:
                conn.close()
                return
            with conn:
                self._read(conn)

    def _read(self, conn: socket.socket) -> None:
        conn.settimeout(1.0)
        chunks: list[bytes] = []
        size = 0
        try:
            while size < MAX_MESSAGE:
                chunk = conn.recv(MAX_MESSAGE - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        except OSError:  # a knock (closed with RST) or a sender that went away
            return
        if not chunks:
            return  # a knock
        if self._handle(b"".join(chunks).decode(errors="replace")):
            try:
                conn.sendall(b"k")
            except OSError:  # the sender stopped waiting for the acknowledgement
                pass

    def close(self, join: float = 1.0) -> None:
        """Stop listening (knocks are refused from now on) and end the thread."""
        if self._closed:
            return
        self._closed = True
        try:
            socket.create_connection(self.address, timeout=0.5).close()  # wakes accept()
        except OSError:  # the socket cannot be reached any more: accept() fails by itself
            pass
        self._sock.close()
        if self.thread is not threading.current_thread():
            self.thread.join(join)


def gone_among(peers: Iterable[tuple[int, Peer]]) -> list[int]:
    """The ranks among local ``peers`` whose process is gone."""
    return [r for r, p in peers if p.local and p.state() == "gone"]
