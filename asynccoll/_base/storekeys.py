"""Reading a store key that another process may delete meanwhile; polling for peers.

A ``get`` of a missing key waits for the store's timeout, and holds the connection
(a store client serves one request at a time) for every other user of it. A key that
``check`` saw may be deleted before the ``get`` that follows: by the last rank out of
a communicator or a grow, while this process was stopped or starved of CPU. Every read
of such a key is :func:`peek`: one request that never waits.
"""

from __future__ import annotations

from typing import Any

#: A value no asynccoll key ever holds: ``compare_set`` with it reads a key without
#: waiting for it.
_ABSENT = "\x00absent"


def peek(store: Any, key: str) -> str | None:
    """``key``'s value (decoded), or None where it does not exist (blocking: one store
    request).

    ``compare_set`` of a missing key with a non-empty expected value returns that value
    and writes nothing; of a present one, whose value is never ``_ABSENT``, its value.
    """
    raw = bytes(store.compare_set(key, _ABSENT, _ABSENT)).decode(errors="replace")
    return None if raw == _ABSENT else raw


def next_poll(delay: float, waited: float, waiters: int) -> float:
    """The sleep before the next poll of a wait for peers' keys, after a sleep of
    ``delay`` and ``waited`` seconds in all, with up to ``waiters`` ranks polling alike.

    Doubling from 50 µs (``delay=0.000025`` first) up to 0.2 ms per 8 waiters for the
    first 10 ms: the peers of a creation that goes well arrive within a few ms, and a
    poll that comes late is time every rank waits (a 1 ms cap cost a split 0.3 to 1 ms
    per wait). Then every ms until 50 ms, then every 5 ms: a slow peer costs the store
    few requests. (A blocking ``wait`` would wake at once, but one that times out
    prints torch's warnings, and it cannot look for a peer that died or gave up.)
    """
    if waited < 0.01:
        cap = 0.0002 * max(1, -(-waiters // 8))
    else:
        cap = 0.001 if waited < 0.05 else 0.005
    return min(delay * 2, cap)
