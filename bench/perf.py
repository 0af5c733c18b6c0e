"""Every figure of issue 20 (per-op cost) in one run, with its goal, its floor and a verdict.

    python -m bench.perf [--quick] [--runs N] [--noisy] [--only SECTION ...] [--out bench/results]
                         [--readme [PATH ...]]

Sections (each spawns its own ranks on this machine; all on Gloo, CPU):

  train       GradSync step / DDP step, 6 x Linear(1024) and 100 x Linear(128), backward
              on the loop and in a thread, DDP and GradSync at their defaults and at equal
              bucket sizes (4 MiB), each variant in processes of its own; floor: the
              same step, then one blocking all_reduce of a flat buffer of all the
              gradients' bytes (nothing overlapped, nothing copied; ``bench.train``)
  coalescing  64 x 256 floats coalesced vs one flattened op vs torch's
              ``_coalescing_manager``; floor: coalescing by hand (cat, one op, copy back)
  latency     one all_reduce of 8 floats vs the floor bridge (``bench.run``, one shared group)
  pipelined   1000 small all_reduces issued back to back, then awaited, vs torch
              (``bench.run``); floor: the floor bridge doing the same
  abort       ``comm.abort()`` -> the last of 1000 waiters, asyncio and uvloop; floor:
              1000 tasks on plain futures failed in one loop (``bench.fanout``)
  host        2000 back-to-back all_reduces at world size 1 (pure host cost) vs torch;
              floor: the floor bridge (``bench.host``)

Writes ``perf.json`` (every raw result, the machine's load and CPU count before and
after each section), ``perf.md`` (the summary table: goal, measured, p10, floor,
load, verdict), ``perf_summary.png`` (each figure against its goal) and the
sections' own plots, under ``--out``. A verdict needs a quiet machine: a section
that started with a 1-minute load average above 1.5 gets "no verdict" (each section
first waits, up to 3 minutes, for the load the last one left to decay below 1.0; the
load after a section counts its own ranks and is shown, not judged)
unless ``--noisy`` is given; ``--readme`` then writes the table between the markers of
README.md and docs/performance.md (refused for a loaded run). About 3 minutes on a quiet
machine (``--quick``: about 1; ``--smoke``: one round of each, for the test suite).
``--runs N`` repeats the whole run N times and reports each figure's median over the runs,
with its range; a figure's verdict then needs every one of its runs to start quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench._common import QUIET_LOAD, machine, progress, quiet

SECTIONS = ("train", "coalescing", "latency", "pipelined", "abort", "host")
EQUAL_MB = 4.0  # "DDP at equal bucket sizes": both capped at this many MiB


@dataclass
class Row:
    """One goal of issue 20 and what this run measured for it."""

    section: str
    goal: str  # what is compared, in words
    target: str  # "<= 0.90", ">= 1.1", "<= 5 ms"
    measured: float
    p10: float | None
    floor: float | None
    floor_note: str
    machine: dict[str, Any] = field(default_factory=dict)
    machine_after: dict[str, Any] = field(default_factory=dict)
    verdict: str = ""
    #: Every run's measured value (``--runs``); empty for a single run.
    runs: list[float] = field(default_factory=list)

    def met(self) -> bool:
        op, value = self.target.split()[:2]
        return self.measured <= float(value) if op == "<=" else self.measured >= float(value)

    def judge(self, noisy: bool) -> None:
        # The load before the section is the machine's own; the load after includes the
        # section's ranks (two busy processes on a 2-core machine read about 2).
        calm = quiet(self.machine)
        if not calm and not noisy:
            load = self.machine["loadavg"][0]
            self.verdict = f"no verdict (load {load:.2f} > {QUIET_LOAD})"
            return
        self.verdict = ("met" if self.met() else "NOT met") + ("" if calm else " (noisy)")


def median_of_runs(runs: list[list[Row]]) -> list[Row]:
    """One row per figure: the median of its runs' values, the loads of its loudest run."""
    from statistics import median

    merged = []
    for same in zip(*runs):
        values = [r.measured for r in same]
        loudest = max(same, key=lambda r: r.machine.get("loadavg", [0.0])[0])
        p10s = [r.p10 for r in same if r.p10 is not None]
        floors = [r.floor for r in same if r.floor is not None]
        merged.append(
            Row(
                same[0].section,
                same[0].goal,
                same[0].target,
                median(values),
                median(p10s) if p10s else None,
                median(floors) if floors else None,
                same[0].floor_note,
                loudest.machine,
                loudest.machine_after,
                runs=values,
            )
        )
    return merged


def settle(below: float = 1.0, limit: float = 180.0) -> None:
    """Wait until the 1-minute load average is below ``below`` (at most ``limit`` s)."""
    until = time.monotonic() + limit
    while os.getloadavg()[0] >= below and time.monotonic() < until:
        time.sleep(2.0)


# --------------------------------------------------------------------------- sections
def train(size: str, tmp: Path, out: Path) -> tuple[dict[str, Any], list[Row]]:
    from bench import train as bench_train

    variants = ["ddp", "gradsync", "ddp_thread", "gradsync_thread", "local", "flat"]
    variants += [f"{v}@{EQUAL_MB:g}" for v in ("ddp", "gradsync", "ddp_thread", "gradsync_thread")]
    rounds, steps, warmup = {
        "smoke": ("1", "1", "1"),
        "quick": ("4", "2", "2"),
        "full": ("12", "3", "2"),
    }[size]
    argv = [
        "--rounds",
        rounds,
        "--steps",
        steps,
        "--warmup",
        warmup,
        "--variants",
        *variants,
        "--json",
        str(tmp / "train.json"),
        "--plot",
        str(out / "perf_train.png"),
    ]
    bench_train.main(argv)
    res = json.loads((tmp / "train.json").read_text())
    rows = []
    for m in res["models"]:
        v = m["variants"]
        what = f"{m['layers']}xLinear({m['width']})"
        for style in ("", "_thread"):
            for suffix, sizes in (
                ("", "defaults"),
                (f"@{EQUAL_MB:g}", f"equal {EQUAL_MB:g} MiB buckets"),
            ):
                name = f"gradsync{style}{suffix}"
                row = v[name]
                local = v["local"]["median_ms"] / v[row["vs"]]["median_ms"]
                flat = v["flat"]["median_ms"] / v[row["vs"]]["median_ms"]
                if suffix and row.get("buckets_as_vs") is False:
                    sizes += f" (NOT equal: {row['buckets_mb']} vs {v[row['vs']]['buckets_mb']})"
                rows.append(
                    Row(
                        "train",
                        f"GradSync step / DDP, {what}, backward {'in a thread' if style else 'on the loop'}, "
                        f"{sizes}",
                        "<= 0.90",
                        row["ratio_vs_ddp"],
                        row["ratio_vs_ddp_p10"],
                        flat,
                        f"the step, then one flat all_reduce of the same bytes / {row['vs']}; without "
                        f"communication: {local:.3f}",
                        res["machine"],
                        res["machine_after"],
                    )
                )
    return res, rows


def coalescing(size: str, tmp: Path, out: Path) -> tuple[dict[str, Any], list[Row]]:
    from bench import coalescing as bench_coalescing

    argv = ["--json", str(tmp / "coalescing.json"), "--no-plot"]
    argv += {"smoke": ["--smoke"], "quick": ["--quick"], "full": ["--repeats", "30"]}[size]
    bench_coalescing.main(argv)
    res = json.loads((tmp / "coalescing.json").read_text())
    from bench.plot import plot_coalescing

    plot_coalescing(res, out / "perf_coalescing")
    t, r = res["results"], res["ratios"]
    p10 = {m: t[m]["p10_ms"] for m in t}
    rows = [
        Row(
            "coalescing",
            "coalesced 64x256 floats / one flattened op",
            "<= 1.3",
            r["coalesced/flattened"],
            p10["coalesced"] / p10["flattened"],
            r["by_hand/flattened"],
            "coalescing by hand: cat, the flattened op, split_with_sizes_copy back",
            res["machine"],
            res["machine_after"],
        ),
        Row(
            "coalescing",
            "coalesced 64x256 floats / torch _coalescing_manager",
            "<= 0.8",
            r["coalesced/torch_cm"],
            p10["coalesced"] / p10["torch_cm"],
            t["flattened"]["median_ms"] / t["torch_cm"]["median_ms"],
            "flattened / torch_cm",
            res["machine"],
            res["machine_after"],
        ),
    ]
    return res, rows


def _core(parts: tuple[str, ...], size: str) -> dict[str, Any]:
    from bench import run as bench_run

    iters, rounds = {"smoke": (40, 1), "quick": (800, 5), "full": (3000, 15)}[size]
    cfg = bench_run.Config(
        smoke=size == "smoke", sizes=[32], parts=parts, small_iters=iters, tput_rounds=rounds
    )
    return bench_run.run(cfg, loop="asyncio")


def latency(size: str, tmp: Path, out: Path) -> tuple[dict[str, Any], list[Row]]:
    res = _core(("latency",), size)
    row = res["latency"][0]
    return res, [
        Row(
            "latency",
            "8-float all_reduce / the floor bridge (2 ranks, one shared Gloo group)",
            "<= 1.03",
            row["ac/floor"],
            row["ac/floor_p10"],
            1.0,
            f"the floor bridge itself; it is {row['floor/torch']:.3f} x torch's blocking wait()",
            res["machine"],
            res["machine_after"],
        )
    ]


def pipelined(size: str, tmp: Path, out: Path) -> tuple[dict[str, Any], list[Row]]:
    res = _core(("throughput",), size)
    tp = res["throughput"]
    best = {m: tp[m]["min_ms"] for m in ("asynccoll", "floor", "torch")}
    return res, [
        Row(
            "pipelined",
            f"pipelined {tp['ops']} small all_reduces: throughput / torch",
            ">= 1.1",
            tp["ac_vs_torch"],
            best["torch"] / best["asynccoll"],
            tp["floor_vs_torch"],
            "floor bridge / torch",
            res["machine"],
            res["machine_after"],
        )
    ]


def abort(size: str, tmp: Path, out: Path) -> tuple[dict[str, Any], list[Row]]:
    from bench import fanout

    raw: dict[str, Any] = {}
    rows = []
    for loop in ("asyncio", "uvloop"):
        res = raw[loop] = fanout.measure(1000, {"smoke": 1, "quick": 4, "full": 25}[size], loop)
        rows.append(
            Row(
                "abort",
                f"abort -> last of 1000 waiters, {loop} (ms)",
                "<= 5 ms",
                res["asynccoll"]["last_ms"],
                res["asynccoll"]["last_p10_ms"],
                res["floor"]["last_ms"],
                "1000 plain futures failed in one loop (ms)",
                res["machine"],
                res["machine_after"],
            )
        )
    return raw, rows


def host(size: str, tmp: Path, out: Path) -> tuple[dict[str, Any], list[Row]]:
    from bench import host as bench_host

    res = bench_host.measure(2000, {"smoke": 1, "quick": 5, "full": 15}[size], "asyncio")
    return res, [
        Row(
            "host",
            "2000 back-to-back all_reduces at world size 1, per op / torch",
            "<= 1.5",
            res["asynccoll/torch"],
            res["asynccoll/torch_p10"],
            res["floor/torch"],
            "floor bridge / torch",
            res["machine"],
            res["machine_after"],
        )
    ]


RUNNERS: dict[str, Callable[[str, Path, Path], tuple[dict[str, Any], list[Row]]]] = {
    "train": train,
    "coalescing": coalescing,
    "latency": latency,
    "pipelined": pipelined,
    "abort": abort,
    "host": host,
}


# --------------------------------------------------------------------------- report
def markdown(rows: list[Row], header: dict[str, Any]) -> str:
    lines = [
        "# Issue 20: per-op cost (`python -m bench.perf`)",
        "",
        f"{header['when']}, {header['machine']['cpus']} CPUs, {header['size']} run. "
        f"Load average (1 min) before/after each section in the table; a verdict needs <= {QUIET_LOAD} before it (after: its own ranks included). "
        "Ratios are medians (p10: the same ratio of 10th percentiles); the floor is the thinnest version "
        "of the same thing, in the goal's unit.",
        "",
        "| goal | target | measured | p10 | floor | load | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    if rows and rows[0].runs:
        lines[2] += f" Over {len(rows[0].runs)} runs: measured is the median, [min-max] its range."
    for r in rows:
        floor = f"{r.floor:.3f} ({r.floor_note})" if r.floor is not None else r.floor_note
        p10 = f"{r.p10:.3f}" if r.p10 is not None else "-"
        load = f"{r.machine['loadavg'][0]:.2f}/{r.machine_after['loadavg'][0]:.2f}"
        spread = f" [{min(r.runs):.3f}-{max(r.runs):.3f}]" if r.runs else ""
        lines.append(
            f"| {r.goal} | {r.target} | {r.measured:.3f}{spread} | {p10} | {floor} | {load} "
            f"| {r.verdict} |"
        )
    return "\n".join(lines) + "\n"


README_BEGIN = "<!-- bench.perf: begin (written by python -m bench.perf --readme) -->"
README_END = "<!-- bench.perf: end -->"
README_PATHS = ("README.md", "docs/performance.md")  # --readme's default: both hold the markers


def update_readme(path: Path, rows: list[Row], header: dict[str, Any], noisy: bool) -> str:
    """Put this run's table between the README's markers; refuses a loaded run unless ``noisy``."""
    loaded = [r for r in rows if not quiet(r.machine)]
    if loaded and not noisy:
        return f"README not updated: {len(loaded)} figure(s) taken at load > {QUIET_LOAD} (--noisy to write them anyway)"
    text = path.read_text()
    if README_BEGIN not in text or README_END not in text:
        return f"README not updated: no {README_BEGIN!r} ... {README_END!r} block in {path}"
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    lines = [
        README_BEGIN,
        "",
        f"Measured {header['when']} ({header['size']} run, {header['machine']['cpus']} CPUs, "
        f"load average before each section at most {max(r.machine['loadavg'][0] for r in rows):.2f}, after "
        f"(its own ranks included) at most {max(r.machine_after['loadavg'][0] for r in rows):.2f}"
        f"{'; loaded: not a verdict' if loaded else ''}):",
        "",
        "| goal | target | measured | p10 | floor | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        floor = f"{r.floor:.3f} ({r.floor_note})" if r.floor is not None else r.floor_note
        p10 = f"{r.p10:.3f}" if r.p10 is not None else "-"
        lines.append(
            f"| {r.goal} | {r.target} | {r.measured:.3f} | {p10} | {floor} | {r.verdict} |"
        )
    path.write_text(head + "\n".join(lines) + "\n\n" + README_END + tail)
    return f"README updated: {path}"


def plot(rows: list[Row], path: Path) -> bool:
    """Each figure against its goal: measured / goal (``>=`` goals inverted), 1.0 = the goal."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    def rel(value: float, target: str) -> float:
        op, goal = target.split()[:2]
        return value / float(goal) if op == "<=" else float(goal) / value

    fig, ax = plt.subplots(figsize=(13, 0.42 * len(rows) + 1.5))
    ys = list(range(len(rows)))[::-1]
    colors = [
        "tab:gray" if r.verdict.startswith("no verdict") else "tab:green" if r.met() else "tab:red"
        for r in rows
    ]
    ax.barh(
        ys,
        [rel(r.measured, r.target) for r in rows],
        color=colors,
        alpha=0.7,
        label="measured (median)",
    )
    fl = [
        (y, rel(r.floor, r.target)) for y, r in zip(ys, rows) if r.floor is not None and r.floor > 0
    ]
    ax.plot([v for _, v in fl], [y for y, _ in fl], "k|", markersize=14, label="floor")
    ax.axvline(1.0, color="black", lw=1)
    ax.set_yticks(ys, [f"{r.goal} ({r.target})" for r in rows], fontsize=7)
    ax.set_xlabel(
        "relative to the goal (1.0 = goal; left of the line = met; gray: no verdict, loaded machine)"
    )
    load = max(max(r.machine["loadavg"][0], r.machine_after["loadavg"][0]) for r in rows)
    ax.set_title(f"issue 20 goals, Gloo on this machine (max load {load:.2f})")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the long goal labels whole
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help="fewer rounds (about a minute; a look, not a figure)"
    )
    ap.add_argument(
        "--smoke", action="store_true", help="one round of everything (does it still run?)"
    )
    ap.add_argument(
        "--noisy", action="store_true", help="give verdicts even when the load was above 1.5"
    )
    ap.add_argument(
        "--runs", type=int, default=1, help="repeat the whole run; report medians and ranges"
    )
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--out", default="bench/results")
    ap.add_argument(
        "--readme",
        nargs="*",
        default=None,
        metavar="PATH",
        help="also write the table between the bench.perf markers of each PATH (default: "
        + " and ".join(README_PATHS)
        + "; quiet runs only)",
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    header = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "size": size,
    }
    raws: list[dict[str, Any]] = []
    runs: list[list[Row]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(max(1, args.runs)):
            raw: dict[str, Any] = {}
            rows: list[Row] = []
            for name in args.only:
                if size != "smoke":
                    settle()
                progress(
                    f"bench.perf: run {run + 1}/{args.runs}, {name} "
                    f"(load {machine()['loadavg'][0]:.2f})"
                )
                raw[name], got = RUNNERS[name](size, Path(tmp), out)
                rows += got
            raws.append(raw)
            runs.append(rows)
    rows = runs[0] if len(runs) == 1 else median_of_runs(runs)
    raw = raws[0] if len(raws) == 1 else {"runs": raws}
    for r in rows:
        r.judge(args.noisy)
    md = markdown(rows, header)
    print("\n" + md)
    (out / "perf.md").write_text(md)
    (out / "perf.json").write_text(
        json.dumps(
            {**header, "noisy": args.noisy, "rows": [asdict(r) for r in rows], "raw": raw},
            indent=2,
            default=str,
        )
    )
    written = [out / "perf.md", out / "perf.json"]
    if plot(rows, out / "perf_summary.png"):
        written.append(out / "perf_summary.png")
    print("wrote " + ", ".join(str(p) for p in written))
    if args.readme is not None:
        for path in args.readme or README_PATHS:
            print(update_readme(Path(path), rows, header, args.noisy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
