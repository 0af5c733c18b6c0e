"""Reading a store key that another process may delete meanwhile.

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
