"""The chaos soak in short: ``python -m bench.chaos`` for 45 seconds.

Four ranks run random op streams (every collective, coalesced batches, p2p,
objects) while the driver SIGKILLs, SIGSTOPs/SIGCONTs and aborts them, and
starts replacements that ``ac.join`` the group (the members ``grow()`` back to
four and send the state with ``broadcast_state``); after every recovery and
every grow the ranks check their results, their waits against their bounds,
the state they hold, their threads and files and the flight record. No
violation may occur. Seed 7's faults begin abort, kill, a hit replacement:
within the 45 s at least one replacement joins. The long run is ``make chaos``
(10 minutes; figures in docs/performance.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT


@pytest.mark.timeout(240)
def test_chaos_soak_has_no_violation(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.chaos",
        "--minutes",
        "0.75",
        "--seed",
        "7",
        "--json",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    res = json.loads(out.read_text())
    assert res["violations"] == [], proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sum(res["faults"].values()) >= 3, res["faults"]
    assert res["recoveries"] >= 1, proc.stdout
    assert res["ops"] > 100, proc.stdout
    assert res["joins"] >= 1 and res["grows"] >= 1, proc.stdout
