"""PNG plots of the benchmark results (matplotlib, Agg backend).

    python -m bench.plot bench/results/core_uvloop.json [more.json ...]

Core results: latency vs size (median solid, p10 dashed) for asynccoll, the floor
bridge and torch, and the ratio lines. Coalescing results: per-mode bars.
Without matplotlib nothing is drawn (a note on stderr).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

COLORS = {"asynccoll": "tab:blue", "floor": "tab:green", "torch": "tab:red"}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_core(res: dict[str, Any], stem: Path) -> list[Path]:
    """``<stem>_latency.png`` and ``<stem>_ratios.png`` from ``bench.run`` results."""
    plt = _pyplot()
    if plt is None:
        return []
    rows = res["latency"]
    sizes = [r["bytes"] for r in rows]
    title = f"all_reduce, Gloo, {res['world_size']} ranks, {res['loop']}"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, c in COLORS.items():
        if rows[0].get(f"{m}_us") is None:
            continue
        ax.plot(sizes, [r[f"{m}_us"] for r in rows], "o-", color=c, label=f"{m} median")
        ax.plot(sizes, [r[f"{m}_p10_us"] for r in rows], "--", color=c, alpha=0.6, label=f"{m} p10")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bytes")
    ax.set_ylabel("latency per op (us)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    out = [Path(f"{stem}_latency.png")]
    fig.tight_layout()
    fig.savefig(out[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, c in (
        ("ac/floor", "tab:blue"),
        ("floor/torch", "tab:green"),
        ("ac/torch", "tab:purple"),
    ):
        if rows[0].get(key) is None:
            continue
        ax.plot(sizes, [r[key] for r in rows], "o-", color=c, label=f"{key} median")
        ax.plot(
            sizes, [r[key + "_p10"] for r in rows], "--", color=c, alpha=0.6, label=f"{key} p10"
        )
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.03, color="gray", lw=0.8, ls=":", label="1.03 (goal ac/floor)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes")
    ax.set_ylabel("latency ratio")
    ax.set_title(title + ": ratios")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    out.append(Path(f"{stem}_ratios.png"))
    fig.tight_layout()
    fig.savefig(out[1], dpi=110)
    plt.close(fig)
    return out


def plot_coalescing(res: dict[str, Any], stem: Path) -> list[Path]:
    """``<stem>.png``: median wall and CPU ms per iteration for each mode."""
    plt = _pyplot()
    if plt is None:
        return []
    table = res["results"]
    modes = list(table)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = range(len(modes))
    ax.bar([i - 0.2 for i in x], [table[m]["median_ms"] for m in modes], 0.4, label="wall (median)")
    ax.bar(
        [i + 0.2 for i in x], [table[m]["cpu_median_ms"] for m in modes], 0.4, label="CPU (median)"
    )
    ax.set_xticks(list(x))
    ax.set_xticklabels(modes, rotation=20)
    ax.set_ylabel("ms per iteration")
    cfg = res["config"]
    ax.set_title(f"{cfg['ops']} x all_reduce({cfg['numel']} floats), Gloo, {cfg['loop']}")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    out = Path(f"{stem}.png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [out]


def main(argv: list[str] | None = None) -> int:
    for name in argv if argv is not None else sys.argv[1:]:
        path = Path(name)
        res = json.loads(path.read_text())
        stem = path.with_suffix("")
        pngs = plot_core(res, stem) if "latency" in res else plot_coalescing(res, stem)
        for png in pngs:
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
