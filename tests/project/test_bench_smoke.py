"""The benchmarks still run: each in its --smoke mode (a few iterations), side by side.

No timing is asserted (speed is measured by the benchmarks themselves); these check
that every bench finishes, writes its JSON with every column, and that the plots draw.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT, child_env

HAS_TRIO = importlib.util.find_spec("trio") is not None


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_benches_run_in_smoke_mode(tmp_path: Path) -> None:
    core, coal, hot, trio_json = (
        tmp_path / n for n in ("core.json", "coal.json", "hot.json", "trio.json")
    )
    perf = tmp_path / "perf"
    cmds = {
        "core": [sys.executable, "-m", "bench", "--smoke", "--no-plot", "--json", str(core)],
        "perf": [
            sys.executable,
            "-m",
            "bench.perf",
            "--smoke",
            "--out",
            str(perf),
        ],  # every section
        "coalescing": [
            sys.executable,
            "bench/coalescing.py",
            "--smoke",
            "--no-plot",
            "--json",
            str(coal),
        ],
        "hotpath": [
            sys.executable,
            "-m",
            "bench.hotpath",
            "--smoke",
            "--loop",
            "asyncio",
            "--json",
            str(hot),
        ],
    }
    split = tmp_path / "split.json"
    cmds["split"] = [sys.executable, "bench/split.py", "--smoke", "--json", str(split)]
    if HAS_TRIO:
        cmds["trio"] = [
            sys.executable,
            "-m",
            "bench",
            "--smoke",
            "--loop",
            "trio",
            "--no-plot",
            "--json",
            str(trio_json),
        ]
    env = child_env()
    procs = {
        name: subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for name, cmd in cmds.items()
    }
    outs = {}
    try:
        for name, p in procs.items():
            outs[name] = p.communicate(timeout=200)[0]
            assert p.returncode == 0, f"{name} failed:\n{outs[name]}"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)

    split_res = json.loads(split.read_text())
    for mode in ("torch", "new_group", "floor", "gloo_floor", "asynccoll"):
        assert split_res[f"{mode}_median_s"] > 0, split_res
    assert split_res["ratio"] > 0 and split_res["gloo_floor_ratio"] > 0

    res = json.loads(core.read_text())
    assert res["asynccoll_supported"] is True
    for row in res["latency"]:
        for key in (
            "asynccoll_us",
            "floor_us",
            "torch_us",
            "asynccoll_p10_us",
            "ac/floor",
            "floor/torch",
            "ac/torch",
        ):
            assert row[key] is not None and row[key] > 0, (key, row)
    for m in ("asynccoll", "floor", "torch"):
        assert res["throughput"][m]["ops_per_s"] > 0
    assert set(res["loop_lag"]) >= {"idle", "asynccoll", "floor", "torch_wait"}
    assert "ac/floor" in outs["core"] and "pipelined" in outs["core"]

    coal_res = json.loads(coal.read_text())
    assert set(coal_res["results"]) == {
        "separate",
        "pipelined",
        "coalesced",
        "flattened",
        "by_hand",
        "torch_cm",
        "torch_sep",
    }
    assert (
        coal_res["ratios"]["coalesced/flattened"] > 0
        and coal_res["ratios"]["cpu coalesced/torch_cm"] > 0
    )

    perf_res = json.loads((perf / "perf.json").read_text())
    rows = perf_res["rows"]
    expected = (
        ["train"] * 8 + ["coalescing"] * 2 + ["latency", "pipelined", "abort", "abort", "host"]
    )
    assert [r["section"] for r in rows] == expected
    for r in rows:
        assert (
            r["measured"] > 0
            and r["floor"] > 0
            and r["machine"]["cpus"]
            and len(r["machine"]["loadavg"]) == 3
        )
        assert r["verdict"] in ("met", "NOT met") or r["verdict"].startswith("no verdict")
    assert (perf / "perf.md").read_text().count("\n| ") == len(
        rows
    ) + 1  # header + one line per goal

    hot_res = json.loads(hot.read_text())
    assert hot_res["issue"]["comm.all_reduce() call, whole issue"] > 0
    steps = {row["step"] for row in hot_res["timeline"]["asynccoll"]["steps"]}
    assert "total" in steps and any("succeed_all" in s for s in steps)
    assert (hot.parent / "hot_profile.txt").read_text().strip()

    if HAS_TRIO:
        trio_res = json.loads(trio_json.read_text())
        assert trio_res["loop"] == "trio"
        for row in trio_res["latency"]:
            assert row["floor_us"] > 0 and row["torch_us"] > 0
        if not trio_res["asynccoll_supported"]:
            assert "skipped: asynccoll does not support trio yet" in outs["trio"]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_plots_draw(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from bench.plot import plot_coalescing, plot_core

    rows = []
    for b in (8, 4096):
        row = {"bytes": b}
        for m, v in (("asynccoll", 110.0), ("floor", 100.0), ("torch", 90.0)):
            row[f"{m}_us"], row[f"{m}_p10_us"] = v, v * 0.9
        for k, v in (("ac/floor", 1.1), ("floor/torch", 1.11), ("ac/torch", 1.22)):
            row[k], row[k + "_p10"] = v, v
        rows.append(row)
    pngs = plot_core({"latency": rows, "world_size": 2, "loop": "asyncio"}, tmp_path / "core")
    table = {
        m: {"median_ms": 1.0, "cpu_median_ms": 0.5} for m in ("coalesced", "flattened", "torch_cm")
    }
    pngs += plot_coalescing(
        {"results": table, "config": {"ops": 64, "numel": 256, "loop": "asyncio"}},
        tmp_path / "coal",
    )
    assert len(pngs) == 3
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
