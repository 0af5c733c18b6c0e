"""The waiting room's reads race with the deletions of the last participant out of a grow.

A key that ``check`` saw may be gone by the ``get`` that follows: the grow's last
participant deletes the plan and the tickets' records (``assembly.leave_grow``), and a
joiner stopped in between (SIGSTOP, a long pause under load) resumes into a ``get`` of a
missing key, which waits for the store's timeout. Every read of a key that another
process may delete is one request that never waits (``service.peek``).
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from asynccoll._bootstrap.room import Room

pytestmark = pytest.mark.timeout(60)

#: The store's own timeout: what a blocking read of a deleted key waits for.
_STORE_TIMEOUT = 8.0


class _DeletedOnceSeen:
    """A store whose ``keys`` are deleted right after the first request that found them
    (the last participant's deletion landing just after a reader's request)."""

    def __init__(self, store: Any, keys: set[str]) -> None:
        self._store = store
        self._keys = set(keys)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def call(*args: Any) -> Any:
            named = (
                set(args[0]) if args and isinstance(args[0], list) else {args[0]} if args else set()
            )
            hit = self._keys & named
            present = {k for k in hit if self._store.check([k])}
            result = method(*args)
            for key in present:
                self._store.delete_key(key)
                self._keys.discard(key)
            return result

        return call


def _room() -> tuple[Room, Any]:
    server = dist.TCPStore(
        "127.0.0.1", 0, 1, True, timeout=timedelta(seconds=_STORE_TIMEOUT), wait_for_workers=False
    )
    return Room(server, "g"), server


def test_a_plan_deleted_as_the_joiner_reads_it_is_never_waited_for() -> None:
    room, _server = _room()
    t = room.take_ticket("gloo")
    gen = room.generation(1)
    gen.set("plan", json.dumps({"tickets": [t], "old_size": 2, "world_size": 3}))
    # The last participant deletes the plan, then the ticket's record (leave_grow).
    real = room.generation
    room.generation = lambda g: _DeletedOnceSeen(real(g), {"plan"})  # type: ignore[method-assign]
    room.store.delete_key(f"ticket/{t}")
    start = time.monotonic()
    plan = room.await_plan(1, t, time.monotonic() + 30, threading.Event())
    took = time.monotonic() - start
    assert took < _STORE_TIMEOUT / 2, f"waited {took:.1f} s for a deleted plan"
    # Read in the request that found it (the grow's outcome then tells the joiner it
    # ended); before, a check found it and the get after the deletion waited.
    assert plan == {"tickets": [t], "old_size": 2, "world_size": 3}
    # Deleted before the joiner looked (stopped from its admission): a new ticket.
    assert room.await_plan(1, t, time.monotonic() + 30, threading.Event()) is None


def test_a_record_deleted_as_the_scan_reads_it_is_never_waited_for() -> None:
    """The scan (``waiting()`` on rank 0, on the shared connection) of a ticket whose
    record the last participant of its grow deletes meanwhile."""
    room, _server = _room()
    t = room.take_ticket("gloo")
    room.store = _DeletedOnceSeen(room.store, {f"ticket/{t}"})
    start = time.monotonic()
    live = room.scan("gloo")
    took = time.monotonic() - start
    assert took < _STORE_TIMEOUT / 2, f"waited {took:.1f} s for a deleted record"
    assert live == [t]  # its record was read in the request that found it
    assert room.scan("gloo") == []  # gone since: "between its two calls", not live


def test_an_admission_mark_is_read_in_one_request() -> None:
    room, _server = _room()
    t = room.take_ticket("gloo")
    room.store.compare_set(f"admit/{t}", "", "7")
    assert room.await_admission(t, time.monotonic() + 5, threading.Event()) == "7"
    assert room.await_admission(t + 1, time.monotonic() + 0.2, threading.Event()) is None
