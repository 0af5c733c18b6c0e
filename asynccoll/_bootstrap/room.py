"""A named group's waiting room in the store: joiners' tickets, admissions, grow plans.

Blocking functions (every call is a store round trip): callers run them off the loop.
Keys, under ``asynccoll/group/<name>`` on the store the group met on (the one
joiners connect to as well):

``tickets``
    counter; a joiner takes ticket ``t = add(tickets, 1)``.
``ticket/<t>``
    the joiner's record (JSON: backend, host, pid, and its process identity), or
    ``"void"``: the joiner did not write it within :data:`VOID_AFTER` seconds of a
    scan seeing the ticket (it died between taking the ticket and writing it; a live
    one that was stopped there takes a new ticket).
``unrecorded/<t>``
    when a scan first saw ticket ``t`` without its record (the scanner's clock).
``admit/<t>``
    how ticket ``t`` ended, first writer wins (``compare_set``): ``"<g>"`` admitted
    by grow ``g``; ``"withdrawn"`` (the joiner gave up); ``"dead"`` (its process is
    gone); ``"void"`` (its record never came); ``"refused|<why>"`` (it cannot join
    this group).
``resolved``
    every ticket up to this one has an ``admit`` key: where the next scan starts.
``expired``
    the keys of every ticket up to this one are deleted (see below).
``generations``
    counter; each grow takes ``g = add(generations, 1)``.
``gen/<g>/plan``
    JSON (the admitted tickets, the new world size, the members' options) or
    ``"cancelled"``; ``gen/<g>/`` also holds the grown communicator's own keys.

The room's keys stay bounded: the scan that moves ``resolved`` on deletes the
``admit`` mark and record of each ticket that falls more than :data:`KEEP` tickets
behind it (and the plan of a cancelled grow that mark names). A joiner that had not
read its mark by then (stopped, or starved of CPU, for all that time) finds it
gone with its ticket behind ``resolved``: its admission expired (:data:`EXPIRED`),
and it takes a new ticket, as after a cancelled plan. The grow it was admitted to
cannot have succeeded without it (every participant announces that it built).

A joiner is admitted only with all the others of its grow: the grow's leader (rank 0
of the members) claims every chosen ticket, and writes the plan only when it won all
of them (a joiner may withdraw at the same moment); otherwise the plan says
``"cancelled"`` and the claimed joiners take new tickets.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import torch.distributed as dist

from .._base.storekeys import peek
from .._faults import procs
from .._faults.census import encode_ranks

WITHDRAWN, DEAD, VOID, REFUSED, CANCELLED = "withdrawn", "dead", "void", "refused|", "cancelled"
#: ``await_admission``: the ticket's mark was deleted before its joiner read it.
EXPIRED = "expired"
#: How many resolved tickets behind ``resolved`` keep their mark and record.
KEEP = 8
_POLL_MAX = 0.005
#: How often a waiting joiner looks whether ``resolved`` passed its ticket (seconds).
_EXPIRY_EVERY = 0.25
#: A ticket still without its record this long after a scan first saw it is void (seconds).
#: A joiner writes it right after taking the ticket: only a death (or a stop) comes between,
#: and a ticket without its record holds ``resolved`` back, and with it the window.
VOID_AFTER = 10.0


def process_identity() -> dict[str, Any]:
    """This process as a peer on this machine can check it (see ``procs.Peer``)."""
    machine, pid, start = procs.this_process()
    return {"host": socket.gethostname(), "pid": pid, "machine": machine, "start": start}


def gone(record: dict[str, Any]) -> bool:
    """The joiner's process is known to be gone (only decidable on its own machine)."""
    machine = record.get("machine", "")
    if not machine or machine != procs.MACHINE:
        return False
    return procs.process_state(int(record["pid"]), str(record["start"])) == "gone"


class Room:
    """The waiting room of group ``name`` on ``root`` (the store every member and joiner reaches)."""

    def __init__(self, root: Any, name: str) -> None:
        self.name = name
        self.store = dist.PrefixStore(f"asynccoll/group/{name}", root)

    def generation(self, g: int) -> Any:
        """The store of grow ``g`` (its plan, its watch, the grown communicator's keys)."""
        return dist.PrefixStore(f"gen/{g}", self.store)

    # ------------------------------------------------------------- joiner side
    def take_ticket(self, backend: str) -> int:
        """A new ticket, its record written (one request after the ticket is taken)."""
        record = json.dumps({"backend": backend, **process_identity()})
        while True:
            t = int(self.store.add("tickets", 1))
            if bytes(self.store.compare_set(f"ticket/{t}", "", record)).decode() == record:
                return t
            # Void: this process was stopped between the two requests for VOID_AFTER.

    def withdraw(self, t: int) -> str:
        """Give ticket ``t`` up unless it was resolved first; how it ended (``"withdrawn"``: by us).

        A ticket whose mark had expired gets a ``withdrawn`` mark here, behind the scan's
        window: the scan never visits it again, so it is deleted at once (the scan may
        have deleted marks up to it before this one was written)."""
        key = f"admit/{t}"
        mark = bytes(self.store.compare_set(key, "", WITHDRAWN)).decode()
        if mark == WITHDRAWN and t <= self._resolved() - KEEP:
            self.store.delete_key(key)
        return mark

    def await_admission(self, t: int, until: float, stop: Any) -> str | None:
        """Ticket ``t``'s ``admit`` value, :data:`EXPIRED` if it was deleted unread, or
        None at ``until`` (``time.monotonic()``) or on ``stop``."""
        key = f"admit/{t}"
        delay = 0.0005
        look = time.monotonic() + _EXPIRY_EVERY
        while True:
            mark = peek(self.store, key)
            if mark is not None:
                return mark
            now = time.monotonic()
            if now >= look:
                # ``resolved`` passes a ticket only once it has a mark, and only the scan's
                # window deletes marks: behind it and without one, it expired (unless the
                # mark came just now).
                look = now + _EXPIRY_EVERY
                if t <= self._resolved():
                    mark = peek(self.store, key)
                    return EXPIRED if mark is None else mark
            if now >= until or stop.is_set():
                return None
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX)

    def await_plan(self, g: int, t: int, until: float, stop: Any) -> dict[str, Any] | None:
        """Grow ``g``'s plan for ticket ``t``; None when it was cancelled, when the grow
        is over without ``t``, at ``until`` or on ``stop``.

        The leader writes the plan while ``t``'s record exists (a scan admits no ticket
        without one), and the grow's last participant deletes the plan, then the record
        (``leave_grow``): no plan and no record means the grow ended without this joiner,
        which was stopped (SIGSTOP) from its admission until the others counted it out.
        """
        store = self.generation(g)
        delay = 0.0005
        while (raw := peek(store, "plan")) is None:
            if not self.store.check([f"ticket/{t}"]):
                return None
            if time.monotonic() >= until or stop.is_set():
                return None
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX)
        if raw == CANCELLED:
            return None
        plan: dict[str, Any] = json.loads(raw)
        return plan

    def joiners(self, g: int) -> dict[int, int]:
        """Grow ``g``'s joiners: new rank -> ticket (from its plan)."""
        plan = json.loads(bytes(self.generation(g).get("plan")))
        return {int(plan["old_size"]) + i: int(t) for i, t in enumerate(plan["tickets"])}

    # ------------------------------------------------------------ leader side
    def call_off(self, g: int, error: BaseException) -> str:
        """Grow ``g`` will not happen (the members' admission failed): its outcome says
        so. The outcome (this one, or one a participant wrote first)."""
        ranks = encode_ranks(getattr(error, "ranks", ()))
        return bytes(
            self.generation(g).compare_set(
                "outcome", "", f"failed|{ranks}|the members' admission failed: {error}"
            )
        ).decode()

    def scan(self, backend: str) -> list[int]:
        """The live tickets waiting for admission, in order.

        Resolves on the way the tickets that can never join: a joiner whose process
        is gone (on this machine), or that asked for another backend.
        """
        store = self.store
        last = int(store.add("tickets", 0))
        low = int(store.add("resolved", 0))
        live: list[int] = []
        upto, contiguous = low, True
        for t in range(low + 1, last + 1):
            if not store.check([f"admit/{t}"]):
                verdict = self._verdict(t, backend)
                if verdict is None:
                    live.append(t)
                    contiguous = False
                    continue
                if verdict:
                    store.compare_set(f"admit/{t}", "", verdict)
                else:  # no record yet: the joiner is between its two calls
                    contiguous = False
                    continue
            if contiguous:
                upto = t
        if upto > low:
            store.compare_set("resolved", str(low), str(upto))
            self._expire(upto)
        return live

    def _resolved(self) -> int:
        raw = peek(self.store, "resolved")
        return int(raw) if raw else 0

    def _expire(self, resolved: int) -> None:
        """Delete the keys of the tickets fallen out of the window behind ``resolved``:
        each one's mark and record, and the plan of a cancelled grow its mark names.

        ``expired`` says up to where this is done; it moves only once the keys are gone,
        so a scan that died on the way leaves the rest to the next one (two scans at
        once delete the same keys twice, which is harmless)."""
        store = self.store
        raw = peek(store, "expired")
        done = int(raw) if raw else 0
        for t in range(done + 1, resolved - KEEP + 1):
            mark = peek(store, f"admit/{t}")
            if mark is not None and mark.isdigit():
                plan = self.generation(int(mark))
                if peek(plan, "plan") == CANCELLED:
                    plan.delete_key("plan")
            for key in (f"admit/{t}", f"ticket/{t}", f"unrecorded/{t}"):
                store.delete_key(key)
        if resolved - KEEP > done:
            store.compare_set("expired", raw or "", str(resolved - KEEP))

    def _verdict(self, t: int, backend: str) -> str | None:
        """None: ticket ``t`` may join; ``""``: not decidable yet; else its ``admit`` value."""
        key = f"ticket/{t}"
        raw = peek(self.store, key)
        if raw is None:
            now = str(time.time())
            seen = float(bytes(self.store.compare_set(f"unrecorded/{t}", "", now)).decode())
            if time.time() - seen < VOID_AFTER:
                return ""  # the joiner is between its two requests
            raw = bytes(self.store.compare_set(key, "", VOID)).decode()  # (or it wrote it just now)
        if raw == VOID:
            return VOID
        try:
            record = json.loads(raw)
            dead = gone(record)
        except (ValueError, TypeError, KeyError, AttributeError):  # not written by ac.join
            return f"{REFUSED}unreadable ticket record {key!r}"
        if dead:
            return DEAD
        if record.get("backend") != backend:
            return (
                f"{REFUSED}group {self.name!r} runs backend {backend!r}; "
                f"ac.join asked for {record.get('backend')!r}"
            )
        return None

    def admit(self, k: int, plan: dict[str, Any]) -> int | None:
        """Admit the first ``k`` live tickets to a new grow; its number, or None if fewer wait.

        ``plan`` (world size, options) is completed with the admitted tickets.
        """
        chosen = self.scan(plan["backend"])[:k]
        if len(chosen) < k:
            return None
        g = int(self.store.add("generations", 1))
        mark = str(g)
        won = [
            t
            for t in chosen
            if bytes(self.store.compare_set(f"admit/{t}", "", mark)).decode() == mark
        ]
        gen = self.generation(g)
        if len(won) < k:  # a joiner withdrew meanwhile: the claimed ones take new tickets
            if won:  # (read by them; the scan's window deletes it with their marks)
                gen.set("plan", CANCELLED)
            return None
        gen.set("plan", json.dumps({**plan, "tickets": chosen}))
        return g
