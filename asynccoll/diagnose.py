"""``python -m asynccoll.diagnose DIR``: read every rank's trace files and say what went wrong.

Reads ``<comm>.rank<R>.flight.json`` (written on timeout, abort or mismatch) or, for a
rank without one, ``<comm>.rank<R>.trace.json`` (its timeline, written on close), as
produced by ``ac.init(..., trace_dir=DIR)``. ``<comm>`` names the communicator (its
creation time and a random part): a directory may hold several, the generations of an
elastic job (each ``shrink()`` or ``grow()`` makes a new communicator whose ranks are
renumbered) and communicators alive at once. One is read at a time, never a mix: the
newest, or the one named with ``--comm``; the report names it and lists the others
(``--list`` lists them only). Files named ``rank<R>.*.json`` (before communicators were
named) are read as one communicator. Reports, in this order:

* ranks without files;
* errors the ranks recorded (a ``CollectiveMismatch`` names the fields that differ);
* a rank that is behind: "rank 1 never issued seq 3 all_reduce; rank 0 issued it at ...";
* ranks that disagree on what an op was (op, dtype, shape, root, reduce op) at one seq;
* ops whose outcome differs between ranks (done on one, timed out on another);
* for every rank, its last completed op and what it was still waiting on.

Exit status: 0 when every rank agrees and nothing failed, 1 when a problem was found,
2 when ``DIR`` holds no trace files (or none of the communicator named). ``--json``
prints the same as one JSON object, with ``comm`` (the communicator read) and
``others``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path
from typing import Any

_FILE = re.compile(r"^(?:(?P<comm>[^.]+)\.)?rank(?P<rank>\d+)\.(?P<kind>flight|trace)\.json$")
_COMPARED = ("op", "dtype", "shape", "root", "reduce_op")
_P2P = ("send", "recv")


def _when(t: float | None) -> str:
    if t is None:
        return "?"
    return (
        datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%H:%M:%S.%f")[:-3]
        + " UTC"
    )


def _op(rec: dict[str, Any]) -> str:
    return f"seq {rec['seq']} {rec['op']}"


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


def _from_timeline(data: dict[str, Any]) -> list[dict[str, Any]]:
    records = []
    for ev in data.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") == "op":
            rec = dict(ev.get("args", {}))
            rec["op"] = ev.get("name")
            rec["issued_at"] = ev["ts"] / 1e6
            rec["ended_at"] = (
                (ev["ts"] + ev.get("dur", 0.0)) / 1e6 if rec.get("state") != "issued" else None
            )
            records.append(rec)
    return sorted(records, key=lambda r: r["seq"])


def load_all(directory: str | Path) -> dict[str, dict[int, dict[str, Any]]]:
    """Every communicator's ranks (see :func:`load`), by the communicator's name in the
    file names (``""``: files without one)."""
    found: dict[str, dict[int, dict[str, Path]]] = {}
    for path in Path(directory).iterdir():
        m = _FILE.match(path.name)
        if m:
            comm = found.setdefault(m.group("comm") or "", {})
            comm.setdefault(int(m.group("rank")), {})[m.group("kind")] = path
    return {comm: load(files) for comm, files in found.items()}


def load(found: dict[int, dict[str, Path]]) -> dict[int, dict[str, Any]]:
    """One communicator's ranks, from their files (``{rank: {"flight"|"trace": path}}``):
    each rank's ``records`` by seq, plus the error fields of its flight record."""
    ranks: dict[int, dict[str, Any]] = {}
    for rank, files in sorted(found.items()):
        if "flight" in files:
            data = json.loads(files["flight"].read_text())
            records = data.get("records", [])
            source = "flight"
        else:
            data = json.loads(files["trace"].read_text())
            records = _from_timeline(data)
            data = {**data.get("otherData", {}), "error_type": None}
            source = "trace"
        ranks[rank] = {
            "rank": rank,
            "comm": data.get("comm"),
            "created_at": data.get("created_at"),
            "group": data.get("group"),
            "world_size": data.get("world_size"),
            "source": source,
            "error_type": data.get("error_type"),
            "error": data.get("error"),
            "waiting": data.get("waiting", []),
            "records": {r["seq"]: r for r in records},
        }
    return ranks


def describe(comm: str, ranks: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """What names a communicator in a report: its id, creation time, group, size, files."""
    first = ranks[min(ranks)]
    return {
        "id": comm or None,
        "created_at": first["created_at"],
        "group": first["group"],
        "world_size": max([r["world_size"] or 0 for r in ranks.values()] + [max(ranks) + 1]),
        "ranks": sorted(ranks),
        "flight_records": sorted(r for r, d in ranks.items() if d["source"] == "flight"),
    }


def _newest_last(desc: dict[str, Any]) -> tuple[float, str]:
    created = desc["created_at"]
    return (created if created is not None else float("-inf"), desc["id"] or "")


def _name(desc: dict[str, Any]) -> str:
    """``c2026...-3fa91c (created 01:45:12 UTC, 3 ranks, group 'chaos')``."""
    parts = [] if desc["created_at"] is None else [f"created {_when(desc['created_at'])}"]
    parts.append(f"{desc['world_size']} ranks")
    if desc["group"]:
        parts.append(f"group {desc['group']!r}")
    if desc["flight_records"]:
        parts.append(f"flight records from {_ranks(desc['flight_records'])}")
    return f"{desc['id'] or '(unnamed files rank<R>.*.json)'} ({', '.join(parts)})"


def analyse(ranks: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Problems found and each rank's status (see the module docstring)."""
    problems: list[dict[str, Any]] = []
    world = max([r["world_size"] or 0 for r in ranks.values()] + [max(ranks) + 1])
    missing = [r for r in range(world) if r not in ranks]
    if missing:
        problems.append(
            {
                "kind": "missing",
                "ranks": missing,
                "text": f"no trace files from {_ranks(missing)} (crashed, killed, or another trace_dir?)",
            }
        )
    seen_errors: set[str] = set()
    for data in ranks.values():
        if data["error_type"] and data["error"] not in seen_errors:
            seen_errors.add(data["error"])
            holders = [q for q, d in ranks.items() if d["error"] == data["error"]]
            problems.append(
                {
                    "kind": "error",
                    "ranks": holders,
                    "error_type": data["error_type"],
                    "text": f"{_ranks(holders)} recorded {data['error_type']}: {data['error']}",
                }
            )
    # An op a rank skipped (asynccoll.testing.skip_collective) never reached its peers:
    # it counts as not issued there, and is reported as such.
    for r, d in sorted(ranks.items()):
        for rec in sorted(d["records"].values(), key=lambda x: x["seq"]):
            if rec["state"] == "skipped":
                problems.append(
                    {
                        "kind": "skipped",
                        "rank": r,
                        "seq": rec["seq"],
                        "op": rec["op"],
                        "text": f"rank {r} skipped {_op(rec)}: settled on rank {r} only, it never "
                        "reached the other ranks (asynccoll.testing.skip_collective)",
                    }
                )
    # Collectives line up across ranks by ``cseq`` (seq minus this rank's p2p ops):
    # ranks that exchanged point-to-point ops have moved their seqs on, the others not.
    recs = {
        r: {
            rec.get("cseq", rec["seq"]): rec
            for rec in d["records"].values()
            if rec["op"] not in _P2P and rec["state"] != "skipped"
        }
        for r, d in ranks.items()
    }
    present = [r for r in recs if recs[r]]
    lo = max((min(recs[r]) for r in present), default=0)  # older ops fell out of some ring
    hi = {r: max(recs[r], default=0) for r in recs}
    behind_at: set[int] = set()
    # Behind: a rank whose newest collective is older than one the others issued.
    for r in sorted(recs):
        nxt = hi[r] + 1
        others = [q for q in recs if q != r and nxt in recs[q]]
        if others and nxt >= lo:
            behind_at.add(nxt)
            rec = recs[others[0]][nxt]
            ended = ", ".join(f"{recs[q][nxt]['state']} on rank {q}" for q in others)
            issued = ", ".join(
                f"rank {q} at {_when(recs[q][nxt]['issued_at'])}"
                + ("" if recs[q][nxt]["seq"] == rec["seq"] else f" (its seq {recs[q][nxt]['seq']})")
                for q in others
            )
            problems.append(
                {
                    "kind": "behind",
                    "rank": r,
                    "seq": rec["seq"],
                    "op": rec["op"],
                    "ranks": others,
                    "text": f"rank {r} never issued {_op(rec)}; issued by {issued} ({ended})",
                }
            )
    # Disagreement on what an op was, and on how it ended.
    disagree = 0
    outcome_reported = False
    for key in range(lo, max(hi.values(), default=0) + 1):
        have = {r: recs[r][key] for r in recs if key in recs[r]}
        if len(have) < 2:
            continue
        first = have[min(have)]
        seq = first["seq"]
        seqs = {r: rec["seq"] for r, rec in have.items()}
        where = (
            ""
            if len(set(seqs.values())) == 1
            else " (seq " + ", ".join(f"{s} on rank {r}" for r, s in sorted(seqs.items())) + ")"
        )
        diffs = []
        for field in _COMPARED:
            values = {r: rec.get(field) for r, rec in have.items()}
            if len({json.dumps(v) for v in values.values()}) > 1:
                groups: dict[str, list[int]] = {}
                for r, v in sorted(values.items()):
                    groups.setdefault(_show(v), []).append(r)
                diffs.append(
                    f"{field} " + ", ".join(f"{v} on {_ranks(rs)}" for v, rs in groups.items())
                )
                if field == "op":
                    break  # different ops: their other fields say nothing more
        if diffs and disagree < 5:
            disagree += 1
            problems.append(
                {
                    "kind": "disagree",
                    "seq": seq,
                    "ranks": sorted(have),
                    "text": f"seq {seq}: ranks disagree: " + "; ".join(diffs) + where,
                }
            )
        states = {r: rec["state"] for r, rec in have.items()}
        if (
            not diffs
            and len(set(states.values())) > 1
            and not outcome_reported
            and key not in behind_at
        ):
            outcome_reported = True
            by_state: dict[str, list[int]] = {}
            for r, st in sorted(states.items()):
                by_state.setdefault(st, []).append(r)
            problems.append(
                {
                    "kind": "outcome",
                    "seq": seq,
                    "op": first["op"],
                    "text": f"seq {seq} {first['op']} ended differently: "
                    + ", ".join(f"{st} on {_ranks(rs)}" for st, rs in by_state.items())
                    + where,
                }
            )
    status = {}
    for r, data in ranks.items():
        done = [rec for rec in data["records"].values() if rec["state"] == "done"]
        last = max(done, key=lambda x: x["seq"]) if done else None
        unfinished = [rec for rec in data["records"].values() if rec["state"] != "done"]
        first_bad = min(unfinished, key=lambda x: x["seq"]) if unfinished else None
        status[r] = {
            "last_completed": None
            if last is None
            else {"seq": last["seq"], "op": last["op"], "at": last["ended_at"]},
            "first_unfinished": None
            if first_bad is None
            else {
                "seq": first_bad["seq"],
                "op": first_bad["op"],
                "state": first_bad["state"],
                "error": first_bad.get("error"),
            },
            "waiting": data["waiting"],
            "source": data["source"],
        }
        if first_bad is not None and not any(p["kind"] in ("behind", "error") for p in problems):
            problems.append(
                {
                    "kind": "failed",
                    "rank": r,
                    "seq": first_bad["seq"],
                    "text": f"rank {r}: {_op(first_bad)} {first_bad['state']}",
                }
            )
    # Most telling first: who is behind, who disagrees, how ops ended, then what
    # each rank recorded (a rank aborted by another's news last).
    order = {
        "skipped": 0,
        "behind": 0,
        "disagree": 1,
        "outcome": 2,
        "failed": 3,
        "missing": 4,
        "error": 5,
    }
    problems.sort(key=lambda p: (order[p["kind"]], p.get("error_type") == "CommAborted"))
    return {"ok": not problems, "world_size": world, "problems": problems, "ranks": status}


def _show(v: Any) -> str:
    if isinstance(v, list):
        return "(" + ", ".join(map(str, v)) + ("," if len(v) == 1 else "") + ")"
    return "-" if v is None else str(v)


def render(result: dict[str, Any], directory: str) -> str:
    """The report as readable text."""
    lines = [f"asynccoll diagnose: {result['world_size']} ranks, files in {directory}"]
    comm, others = result.get("comm"), result.get("others", [])
    if comm is not None:
        lines.append(f"communicator {_name(comm)}")
    if others:
        lines.append(
            f"{directory} also holds {len(others)} other communicator(s) (read one with --comm ID):"
        )
        lines.extend(f"  {_name(o)}" for o in others)
    if result["ok"]:
        lines.append("OK: every rank issued the same operations and all of them completed")
    for p in result["problems"]:
        lines.append(f"PROBLEM: {p['text']}")
    for r, st in sorted(result["ranks"].items()):
        last = st["last_completed"]
        text = f"rank {r}: " + (
            f"last completed seq {last['seq']} {last['op']} at {_when(last['at'])}"
            if last
            else "completed nothing"
        )
        bad = st["first_unfinished"]
        if bad is not None:
            text += f"; seq {bad['seq']} {bad['op']} {bad['state']}"
        for w in st["waiting"]:
            text += (
                f"; seq {w['seq']} {'+'.join(w['ops'])} held for the fingerprint of {_ranks(w['waiting_for'])}"
                if w["waiting_for"]
                else ""
            )
        lines.append(text)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asynccoll.diagnose",
        description="Explain a hang or mismatch from asynccoll trace files.",
    )
    parser.add_argument("dir", help="the trace_dir given to asynccoll.init")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument(
        "--comm", metavar="ID", help="the communicator to read (default: the newest in DIR)"
    )
    parser.add_argument(
        "--list", action="store_true", help="list the communicators in DIR, newest last"
    )
    args = parser.parse_args(argv)
    directory = Path(args.dir)
    if not directory.is_dir():
        print(f"{directory}: not a directory", file=sys.stderr)
        return 2
    comms = load_all(directory)
    if not comms:
        print(f"{directory}: no *rank*.flight.json or *rank*.trace.json files", file=sys.stderr)
        return 2
    descs = sorted((describe(c, r) for c, r in comms.items()), key=_newest_last)
    if args.list:
        for d in descs:
            print(json.dumps(d) if args.json else _name(d))
        return 0
    if args.comm is None:
        chosen = descs[-1]
    else:
        named = [d for d in descs if d["id"] == args.comm]
        if not named:
            print(
                f"{directory}: no files of communicator {args.comm!r}; it holds: "
                + ", ".join(_name(d) for d in descs),
                file=sys.stderr,
            )
            return 2
        chosen = named[0]
    result = analyse(comms[chosen["id"] or ""])
    result["comm"] = chosen
    result["others"] = [d for d in descs if d is not chosen]
    if args.json:
        print(
            json.dumps(
                {**result, "ranks": {str(k): v for k, v in result["ranks"].items()}}, indent=1
            )
        )
    else:
        print(render(result, str(directory)))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
