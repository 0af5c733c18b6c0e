"""The chaos soak's figures and summary (``bench/chaos.py`` gathers the counts and times)."""

from __future__ import annotations

import re
import statistics
from collections import Counter
from typing import Any

#: The fault kinds and their weights (of 10).
FAULTS = {"kill": 3, "stop": 3, "abort": 2, "joiner": 2}


def _median_max(xs: list[float]) -> dict[str, float | int | None]:
    return {
        "median": statistics.median(xs) if xs else None,
        "max": max(xs) if xs else None,
        "n": len(xs),
    }


def figures(res: dict[str, Any]) -> dict[str, Any]:
    """The derived figures of a finished run: medians and worsts."""
    rec, det = res["recovery_s"], res["detect_s"]
    return {
        "recovery_worst_s": max(rec) if rec else None,
        "recovery_median_s": statistics.median(rec) if rec else None,
        "detect_worst_s": max(det) if det else None,
        "figures": {
            what: _median_max(res[what])
            for what in (
                "recovery_s",
                "grow_s",
                "grow_call_s",
                "join_s",
                "join_undisturbed_s",
                "join_in_step_s",
                "start_in_step_s",
            )
        },
    }


def _spread(what: str, xs: list[float]) -> str:
    if not xs:
        return f"{what}: none"
    return f"{what}: median {statistics.median(xs):.3f} s, worst {max(xs):.3f} s ({len(xs)})"


def _keys(series: list[tuple[float, int]]) -> str:
    """The store keys over time, about ten points of the series."""
    if not series:
        return "none"
    step = max(1, len(series) // 10)
    points = series[::step] + ([series[-1]] if (len(series) - 1) % step else [])
    return ", ".join(f"{t:.0f} s: {n}" for t, n in points)


def summary(res: dict[str, Any]) -> str:
    rec = res["recovery_s"]
    if not res["split"]:
        sub = "subgroup: off (--no-split)"
    elif res["subgroup_splits"]:
        sub = f"subgroup (comm.split into pairs): {res['subgroup_splits']} made, {res['subgroup_ops']} ops"
    else:
        sub = "subgroup: none made (this build's Communicator has no split)"
    lines = [
        f"chaos soak: {res['minutes']:g} min, {res['world']} ranks per generation, deadline {res['deadline_s']:g} s, "
        f"{res['cpus']} CPUs, load {res['loadavg_start'][0]:.2f} -> {res['loadavg_end'][0]:.2f}",
        f"ops {res['ops']}, generations {res['generations']}, faults {sum(res['faults'].values())} {res['faults']}",
        f"recoveries {res['recoveries']} (+ {res['absorbed']} faults absorbed without one), "
        + (
            f"recovery (first failure seen -> slowest survivor's first op on the new communicator) median "
            f"{statistics.median(rec):.3f} s, worst {max(rec):.3f} s; fault -> first failure seen worst "
            f"{max(res['detect_s']):.3f} s"
            if rec
            else "no recovery"
        ),
        "recovery worst by fault kind: "
        + ", ".join(
            f"{kind} {max(e['recovery_s'] for e in res['fault_log'] if e['kind'] == kind and 'recovery_s' in e):.3f} s"
            for kind in FAULTS
            if any(e["kind"] == kind and "recovery_s" in e for e in res["fault_log"])
        )
        + " (a joiner fault that first kills a member counts from that kill to the last recovery, the hit"
        " replacement's included when it had joined before the hit)",
        f"replacements started {res['replacements']}, joins {res['joins']}, grow-backs {res['grows']} "
        f"(+ {len(res['grow_failures'])} failed: a participant died or froze in it, as rank 0 saw it), "
        + _spread("replacement start -> its first op in the group", res["join_s"])
        + "; "
        + _spread("with no fault meanwhile", res["join_undisturbed_s"]),
        _spread("grow: rank 0's grow() call", res["grow_call_s"])
        + "; "
        + _spread(
            "grow() called -> every rank of the grown group trained a step, checked bit-equal",
            res["grow_s"],
        ),
        f"training steps {res['train_steps']}, in-step checks passed {res['in_step_checks']} "
        "(every rank's parameters and momentum bit-equal after each membership change); "
        + _spread("a replacement's admission -> its first checked step", res["join_in_step_s"]),
        sub,
        f"store keys at each generation start: {res['keys']}; before each fault: "
        f"{res['keys_at_faults'][:3]} ... {res['keys_at_faults'][-3:]}",
        f"store keys over time: {_keys(res['keys_series'])}",
        "store keys left at the end, by shape (digits as N): "
        + ", ".join(f"{n} {shape}" for shape, n in list(res.get("keys_at_end", {}).items())[:12]),
        f"long waits of a rank that was itself frozen meanwhile (not violations): {res['excused_waits']}",
        f"violations: {len(res['violations'])}",
    ]
    lines += [f"  {v}" for v in res["violations"][:20]]
    return "\n".join(lines)


def key_shapes(keys: list[str]) -> dict[str, int]:
    """The store's keys counted by shape (every run of digits as ``N``), most first: which
    kind of key a soak leaves behind."""
    return dict(Counter(re.sub(r"\d+", "N", k) for k in keys).most_common())
