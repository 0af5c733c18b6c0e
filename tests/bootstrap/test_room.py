"""The waiting room's keys (``asynccoll/_bootstrap/room.py``) on a real TCPStore: the scan
keeps the marks and records of a bounded window of resolved tickets, and a joiner whose
mark went unread out of that window finds its admission expired.

Every ticket's ``admit`` mark (and the record of each ticket not admitted) stayed for
good: one key or two per replacement, for as long as the group lived.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from asynccoll._bootstrap import room as room_mod
from asynccoll._bootstrap.room import CANCELLED, WITHDRAWN, Room

pytestmark = pytest.mark.timeout(60)

PLAN: dict[str, Any] = {"backend": "gloo", "world_size": 3, "old_size": 2}


@pytest.fixture
def server() -> Any:
    return dist.TCPStore(
        "127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )


def _room_keys(server: Any, kind: str) -> list[str]:
    return sorted(k for k in server.list_keys() if f"/group/g/{kind}/" in k)


def _withdrawn(room: Room, n: int) -> None:
    """``n`` joiners that each take a ticket and give it up, a scan after each."""
    for _ in range(n):
        t = room.take_ticket("gloo")
        assert room.withdraw(t) == WITHDRAWN
        room.scan("gloo")


def test_a_scan_keeps_the_keys_of_a_bounded_window_of_resolved_tickets(server: Any) -> None:
    """40 tickets withdrawn, refused and admitted: 40 marks and 40 records stayed (the
    admitted ones' records go with their grow; here there is none)."""
    room = Room(server, "g")
    for i in range(40):
        t = room.take_ticket("auto" if i % 3 == 1 else "gloo")
        if i % 3 == 0:
            room.withdraw(t)
        elif i % 3 == 2:
            assert room.admit(1, PLAN) is not None
            room.generation(int(room.withdraw(t))).delete_key("plan")  # (the grow's cleanup)
        assert room.scan("gloo") == []
    marks, records = _room_keys(server, "admit"), _room_keys(server, "ticket")
    assert len(marks) <= 10 and len(records) <= 10, (marks, records)
    assert marks[-1].endswith("admit/40"), marks  # the newest are the ones kept


def test_a_joiner_whose_mark_expired_unread_is_told_so(server: Any) -> None:
    """Admitted while stopped, its mark deleted by the window before it read it: it must
    not wait for it until its deadline, and giving the ticket up must leave no mark."""
    room = Room(server, "g")
    t = room.take_ticket("gloo")
    assert room.admit(1, PLAN) is not None
    _withdrawn(room, 20)
    assert not server.check([f"asynccoll/group/g/admit/{t}"])
    start = time.monotonic()
    assert room.await_admission(t, start + 20.0, threading.Event()) == "expired"
    assert time.monotonic() - start < 5.0
    before = server.num_keys()
    assert room.withdraw(t) == WITHDRAWN  # (at its deadline: a timeout, as before)
    assert server.num_keys() == before, _room_keys(server, "admit")


def test_a_cancelled_plan_goes_with_its_tickets(server: Any, monkeypatch: Any) -> None:
    """A grow whose second chosen joiner withdrew as it was admitted writes a cancelled
    plan, read by the claimed one: nobody deleted it."""
    room = Room(server, "g")
    first, second = room.take_ticket("gloo"), room.take_ticket("gloo")
    room.withdraw(second)  # ...between the leader's scan and its claim:
    monkeypatch.setattr(room, "scan", lambda backend: [first, second])
    assert room.admit(2, PLAN) is None
    g = int(room.withdraw(first))
    assert room.generation(g).get("plan") == CANCELLED.encode()
    monkeypatch.undo()
    _withdrawn(room, 20)
    assert not server.check([f"asynccoll/group/g/gen/{g}/plan"]), server.list_keys()


def test_a_ticket_whose_record_never_came_is_void(server: Any, monkeypatch: Any) -> None:
    """A joiner killed between taking its ticket and writing its record (seen in the chaos
    soak) held ``resolved`` back for good: no ticket after it was ever passed again."""
    monkeypatch.setattr(room_mod, "VOID_AFTER", 0.2, raising=False)
    room = Room(server, "g")
    room.store.add("tickets", 1)  # ticket 1, whose joiner died before its record
    _withdrawn(room, 20)
    time.sleep(0.3)
    assert room.scan("gloo") == []
    assert room.store.get("resolved") == b"21"  # (ticket 1 resolved as void, its keys gone since)
    marks, records = _room_keys(server, "admit"), _room_keys(server, "ticket")
    assert len(marks) <= 10 and len(records) <= 10, (marks, records)
    assert room.take_ticket("gloo") == 22  # (and a new joiner's ticket is a normal one)
