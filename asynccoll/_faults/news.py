"""Abort news and the pulse's messages, as text: what one process tells another.

**The news** (:func:`encode`, :func:`decode`) is what a rank's abort tells the other
ranks of its communicator. It travels twice: in the namespace's ``aborted`` key (first
writer wins; read at the beat) and in a pulse message that brings it at once. Its text is
``<origin rank>|<json>`` (the origin first: ``Roster.left`` reads it alone). The JSON holds
the message, the ranks of a :class:`PeerFailure`, and the whole of a
:class:`CollectiveMismatch` (its seq, fields and per-rank details; ranks with the same
details are listed together, so the text stays small at any world size): the receiving rank
raises the mismatch it names, never a bare ``CommAborted`` (``FingerprintChecker.settle``).

**Pulse messages** name whom they are for, since a pulse's port outlives its process (a
port is reused, member ids restart at 1 in every process):

* ``a|<store>|<namespace>|<member ids>|<news>``: abort news for those members;
* ``h|<store>``: the host of that store is closing it (``Service.announce_leaving``).

``<store>`` is :func:`store_identity`: the store server's address and a token that the
first service on that server agreed on through it, so a server restarted at the same
address is another store. ``<namespace>`` is the communicator's own token, agreed through its
namespace at start (``Liveness.start``). A service drops a message whose store is not its
own (:func:`same_store`); a member, news whose namespace is not its own.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, NamedTuple

from .._base.errors import CollectiveMismatch, CommAborted, PeerFailure

#: Root-store key of the store's token (see :func:`store_identity`).
STORE_KEY = "asynccoll/store"
#: Namespace key of the communicator's token (``Liveness.start``).
NAMESPACE_KEY = "ns"


# ------------------------------------------------------------------ the news
def encode(rank: int, error: BaseException) -> str:
    """The news of ``rank``'s abort because of ``error`` (its abort error: a mismatch
    travels whole, whether it is the error or its cause)."""
    found = mismatch_of(error)
    body: dict[str, Any] = {"message": str(error if found is None else found)}
    if isinstance(error, PeerFailure):
        body["ranks"] = list(error.ranks)
    if found is not None:
        body["mismatch"] = _pack(found)
    return f"{rank}|{json.dumps(body, separators=(',', ':'))}"


def decode(raw: str) -> CommAborted:
    """The local error for a peer's news: the :class:`CollectiveMismatch` it carries, a
    :class:`PeerFailure` with its ranks, or a :class:`CommAborted` naming the origin."""
    origin, _, text = raw.partition("|")
    try:
        body = json.loads(text)
        message = str(body["message"])
        if "mismatch" in body:
            return _unpack(message, body["mismatch"])
        if "ranks" in body:
            ranks = [int(r) for r in body["ranks"]]
            return PeerFailure(f"peer failure reported by rank {origin}: {message}", ranks)
    except (ValueError, KeyError, TypeError):  # not news of this format: say it as it came
        return CommAborted(f"aborted by rank {origin}: {text}")
    return CommAborted(f"aborted by rank {origin}: {message}")


def mismatch_of(error: BaseException | None) -> CollectiveMismatch | None:
    """The mismatch ``error`` is, or was caused by (an abort error wraps it), if any."""
    if isinstance(error, CollectiveMismatch):
        return error
    cause = error.__cause__ if error is not None else None
    return cause if isinstance(cause, CollectiveMismatch) else None


def _pack(error: CollectiveMismatch) -> dict[str, Any]:
    groups: dict[str, list[int]] = {}
    for r, detail in sorted(error.details.items()):
        groups.setdefault(json.dumps(detail, sort_keys=True), []).append(int(r))
    return {
        "seq": error.seq,
        "fields": list(error.fields),
        "details": [[ranks, json.loads(detail)] for detail, ranks in groups.items()],
    }


def _unpack(message: str, packed: dict[str, Any]) -> CollectiveMismatch:
    details = {int(r): detail for ranks, detail in packed["details"] for r in ranks}
    seq = packed["seq"]
    return CollectiveMismatch(
        message,
        seq=None if seq is None else int(seq),
        details=details,
        fields=tuple(packed["fields"]),
    )


# ------------------------------------------------------------ pulse messages
def store_identity(root: Any) -> str:
    """``<host>:<port>#<token>`` of the store server under ``root`` (one request: the first
    caller's token is the one every later caller reads). Raises the store's errors."""
    token = root.compare_set(STORE_KEY, "", secrets.token_hex(8))
    host, port = getattr(root, "host", None), getattr(root, "port", None)
    return f"{host or '-'}:{port or '-'}#{bytes(token).decode(errors='replace')}"


def same_store(a: str, b: str) -> bool:
    """Whether two :func:`store_identity` s name one store server: the same port and token
    (not the host, which each client may spell differently: a name, an address)."""
    return a.rpartition(":")[2] == b.rpartition(":")[2]


class Message(NamedTuple):
    """A parsed pulse message."""

    kind: str  # "a": abort news; "h": the store's host leaves
    store: str
    namespace: str = ""
    mids: tuple[int, ...] = ()
    news: str = ""


def abort_message(store: str, namespace: str, mids: list[int], news: str) -> str:
    return f"a|{store}|{namespace}|{','.join(map(str, mids))}|{news}"


def leaving_message(store: str) -> str:
    return f"h|{store}"


def parse(text: str) -> Message | None:
    """A pulse message, or None when it is not one of these (then it is dropped)."""
    kind, _, rest = text.partition("|")
    try:
        if kind == "a":
            store, namespace, mids, news = rest.split("|", 3)
            return Message(kind, store, namespace, tuple(int(m) for m in mids.split(",")), news)
        if kind == "h" and rest:
            return Message(kind, rest)
    except ValueError:
        return None
    return None
