"""``python -m bench.gpu --sim`` runs (a few ops): its JSON has every figure, its floor and
its profile. No timing is asserted; the bench measures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.paths import ROOT, child_env


@pytest.mark.slow
@pytest.mark.skipif(
    torch.version.cuda is not None, reason="the simulated GPU needs a CPU build of torch"
)
@pytest.mark.timeout(240)
def test_gpu_sim_bench_runs(tmp_path: Path) -> None:
    env = child_env()
    out = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--sim", "--iters", "60", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.loads((tmp_path / "gpu_sim.json").read_text())
    for key in (
        "issue_us",
        "issue_thread_cpu_us",
        "call_to_nccl_returned_us",
        "member_us",
        "completion_us",
    ):
        assert res["results"][key]["p50"] > 0, key
    assert set(res["results"]["profile"]) == {"caller", "launch", "watcher"}
    assert all(res["results"]["profile"][t] for t in ("caller", "launch", "watcher"))
    assert res["floor"]["caller_us"]["p50"] > 0 and res["floor"]["launch_us"]["p50"] > 0
    assert len(res["meta"]["loadavg_before"]) == 3 and res["meta"]["cpus"] >= 1
    assert "issue floor" in out.stdout
