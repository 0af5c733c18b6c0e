"""Trace files: a rank's flight record (on timeout, abort, mismatch) and its timeline (on close).

Files in ``trace_dir`` (one set per rank of each communicator, read back by
``python -m asynccoll.diagnose``) are named by the communicator, then the rank:
``<comm>.rank<R>.*``. ``<comm>`` (:func:`new_comm_id`: its creation time, UTC, and
a random part) is agreed by the communicator's ranks as it is created, so one
directory holds every generation of an elastic job (a ``shrink()`` or ``grow()``
renumbers ranks; their new communicator writes files of its own) and every
communicator alive at once (subgroups) without one overwriting another's.

* ``<comm>.rank<R>.flight.json`` — ``{"kind": "asynccoll.flight_record", "comm",
  "created_at", "group", "rank", "world_size", "backend", "reason", "error_type",
  "written_at", "records": [...], "waiting": [...]}``;
  ``records`` are :meth:`FlightRecorder.snapshot` dicts, ``waiting`` lists ops held by
  the fingerprint check and the ranks whose fingerprints they still wait for.
* ``<comm>.rank<R>.trace.json`` — a Chrome trace / Perfetto timeline (JSON object format):
  ``traceEvents`` with one process per rank (``pid`` = rank) and one thread row per
  stream (collectives, point-to-point, object collectives); each op is a complete
  event (``"ph": "X"``) from issue to end, with its record in ``args``; a coalesced
  batch is one span ``coalesced[n]`` with its members' seqs in ``args.members``, its
  members drawn inside it. Times are wall-clock microseconds, so the ranks' files
  line up when loaded together. ``otherData`` names the communicator as above.

Files are written to a temporary name and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Thread rows of the timeline.
STREAMS = {"collectives": 1, "p2p": 2, "objects": 3}
_P2P = ("send", "recv")
_OBJECTS = ("all_gather_object", "broadcast_object")


@dataclass(frozen=True)
class CommName:
    """Which communicator a rank's files belong to (the same on all of its ranks)."""

    #: ``new_comm_id()`` of one of its ranks, agreed as it was created.
    id: str
    #: When it was created (seconds since the epoch, from the id's proposer).
    created_at: float
    #: The elastic group's name (``ac.init(name=...)``), or None.
    group: str | None = None

    def fields(self) -> dict[str, Any]:
        return {"comm": self.id, "created_at": self.created_at, "group": self.group}


def new_comm_id(now: float | None = None) -> str:
    """A communicator's file name part: its creation time (UTC, to the second, so that a
    directory's files sort by it) and 6 random hex digits: ``c20261127T014512-3fa91c``."""
    t = time.time() if now is None else now
    return "c" + time.strftime("%Y%m%dT%H%M%S", time.gmtime(t)) + "-" + secrets.token_hex(3)


def flight_path(trace_dir: str | os.PathLike[str], comm: str, rank: int) -> Path:
    return Path(trace_dir) / f"{comm}.rank{rank}.flight.json"


def timeline_path(trace_dir: str | os.PathLike[str], comm: str, rank: int) -> Path:
    return Path(trace_dir) / f"{comm}.rank{rank}.trace.json"


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, separators=(",", ":"))
    os.replace(tmp, path)


def write_flight_record(
    trace_dir: str | os.PathLike[str],
    *,
    comm: CommName,
    rank: int,
    world_size: int,
    backend: str,
    records: list[dict[str, Any]],
    reason: BaseException | None,
    waiting: list[dict[str, Any]] | None = None,
) -> Path:
    """Write ``<comm>.rank<R>.flight.json`` (see the module docstring); returns its path."""
    path = flight_path(trace_dir, comm.id, rank)
    cause = reason
    # The root cause names the problem best (a CommAborted wrapping a mismatch or timeout).
    while (
        cause is not None and cause.__cause__ is not None and type(cause).__name__ == "CommAborted"
    ):
        cause = cause.__cause__
    data = {
        "kind": "asynccoll.flight_record",
        **comm.fields(),
        "rank": rank,
        "world_size": world_size,
        "backend": backend,
        "reason": None if reason is None else str(reason),
        "error_type": None if cause is None else type(cause).__name__,
        "error": None if cause is None else str(cause),
        "details": _jsonable(getattr(cause, "details", None)),
        "written_at": time.time(),
        "records": records,
        "waiting": waiting or [],
    }
    _write_json(path, data)
    return path


def _jsonable(details: Any) -> Any:
    if not details:
        return None
    return {str(k): v for k, v in dict(details).items()}


def stream_of(op: str) -> str:
    """The timeline row of an op name."""
    if op in _P2P:
        return "p2p"
    if op in _OBJECTS:
        return "objects"
    return "collectives"


def timeline(
    records: list[dict[str, Any]],
    *,
    rank: int,
    world_size: int,
    backend: str,
    comm: CommName | None = None,
) -> dict[str, Any]:
    """A Chrome-trace JSON object for one rank's records (see the module docstring)."""
    events: list[dict[str, Any]] = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": rank,
            "tid": 0,
            "args": {"name": f"rank {rank}"},
        },
        {
            "ph": "M",
            "name": "process_sort_index",
            "pid": rank,
            "tid": 0,
            "args": {"sort_index": rank},
        },
    ]
    for name, tid in STREAMS.items():
        events.append(
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}}
        )
    end_of = time.time()
    batches: dict[int, list[dict[str, Any]]] = {}
    for rec in records:
        t0 = rec["issued_at"]
        t1 = rec["ended_at"] if rec["ended_at"] is not None else end_of
        args = {k: v for k, v in rec.items() if k not in ("issued_at", "ended_at")}
        events.append(
            {
                "ph": "X",
                "cat": "op",
                "name": rec["op"],
                "pid": rank,
                "tid": STREAMS[stream_of(rec["op"])],
                "ts": t0 * 1e6,
                "dur": max(0.0, (t1 - t0) * 1e6),
                "args": args,
            }
        )
        if "batch" in rec:
            batches.setdefault(rec["batch"], []).append(rec)
    for first, members in batches.items():
        t0 = min(m["issued_at"] for m in members)
        t1 = max(m["ended_at"] if m["ended_at"] is not None else end_of for m in members)
        states = sorted({m["state"] for m in members})
        events.append(
            {
                "ph": "X",
                "cat": "batch",
                "name": f"coalesced[{len(members)}]",
                "pid": rank,
                "tid": STREAMS["collectives"],
                "ts": t0 * 1e6,
                "dur": max(0.0, (t1 - t0) * 1e6),
                "args": {"batch": first, "members": [m["seq"] for m in members], "states": states},
            }
        )
    # Spans that start together: the enclosing batch first, so viewers nest members in it.
    events.sort(key=lambda e: (e.get("ts", -1.0), -e.get("dur", 0.0)))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "kind": "asynccoll.timeline",
            **(comm.fields() if comm is not None else {}),
            "rank": rank,
            "world_size": world_size,
            "backend": backend,
        },
    }


def write_timeline(
    trace_dir: str | os.PathLike[str],
    *,
    comm: CommName,
    rank: int,
    world_size: int,
    backend: str,
    records: list[dict[str, Any]],
) -> Path:
    """Write ``<comm>.rank<R>.trace.json`` (see the module docstring); returns its path."""
    path = timeline_path(trace_dir, comm.id, rank)
    data = timeline(records, rank=rank, world_size=world_size, backend=backend, comm=comm)
    _write_json(path, data)
    return path
