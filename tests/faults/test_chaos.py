"""The chaos soak in short: ``python -m bench.chaos`` for 30 seconds.

Four ranks run random op streams (every collective, coalesced batches of one and of
several kinds, p2p, objects small and large) and train a small model in step with
``GradSync``, while the driver SIGKILLs, SIGSTOPs/SIGCONTs and aborts them, and starts
replacements that ``ac.join`` the group (the members ``grow()`` back to four and send the
model and its optimizer's state with ``broadcast_state``); after every recovery and every
grow the ranks check their results, their waits against their bounds, the state they
hold, that every rank's parameters are bit-equal after a training step on the new
communicator, their threads and files and the flight record; a replacement admitted must
be in step within its bound. Where the communicator has ``split``, a subgroup of pairs
lives beside the world group. No violation may occur. Seed 7's faults begin abort, kill (a
third when the machine is quiet): within the 30 s at least one replacement joins and trains.
The long run is ``make chaos`` (10 minutes; figures in docs/performance.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import asynccoll as ac
from tests.support.paths import ROOT, child_env


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_chaos_soak_has_no_violation(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.chaos",
        "--minutes",
        "0.5",
        "--seed",
        "7",
        "--json",
        str(out),
    ]
    env = child_env()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    res = json.loads(out.read_text())
    assert res["violations"] == [], proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sum(res["faults"].values()) >= 2, res["faults"]
    assert res["recoveries"] >= 1, proc.stdout
    assert res["ops"] > 100, proc.stdout
    assert res["joins"] >= 1 and res["grows"] >= 1, proc.stdout
    # Grown back and trained in step: the replacement's admission -> its first checked step,
    # and the grow -> every rank of the grown group checked bit-equal.
    assert res["join_in_step_s"] and res["grow_s"], proc.stdout
    assert res["train_steps"] > 10 and res["in_step_checks"] >= 3, proc.stdout
    assert len(res["keys_series"]) >= 3, proc.stdout
    if hasattr(ac.Communicator, "split"):
        assert res["subgroup_splits"] >= 4 and res["subgroup_ops"] > 0, proc.stdout
