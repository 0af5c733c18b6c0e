"""The examples run as a user would run them: ``python examples/<name>.py`` from the repository root."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT

TIMEOUT_S = 120


def run_example(name: str, *args: str) -> str:
    """Run an example in its own process group; on timeout kill the whole group (its ranks too)."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / name), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{name} did not finish within {TIMEOUT_S} s:\n{out}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of the example may outlive it
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{out}"
    return out


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_quickstart() -> None:
    out = run_example("quickstart.py")
    assert "all_reduce -> [1.0, 1.0, 1.0, 1.0]" in out, out


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_fault_tolerant_survivors_shrink_and_finish() -> None:
    out = run_example("fault_tolerant.py")
    timeline = {
        what: float(at)
        for at, what in re.findall(
            r"^\s+([+-]\d+\.\d+)\s+(failure|detected|shrunk|resumed)\b", out, re.MULTILINE
        )
    }
    assert list(timeline) == ["failure", "detected", "shrunk", "resumed"], out
    assert (
        timeline["failure"] <= timeline["detected"] <= timeline["shrunk"] <= timeline["resumed"]
    ), out
    assert timeline["resumed"] - timeline["failure"] < 10, (
        out
    )  # recovered in seconds, not at the op deadline
    assert re.search(r"rank 2 killed at step 20", out), out
    assert re.search(r"detected\s+PeerFailure, ranks \[2\]", out), out
    assert re.search(r"shrunk\s+3 -> 2 ranks", out), out
    assert "survivors: [0, 1]" in out, out
    losses = re.search(r"final loss (\S+) after \d+ steps \(first (\S+)\)", out)
    assert losses is not None, out
    final, first = float(losses[1]), float(losses[2])
    assert final < first / 10, out
    assert re.search(r"step\s+\d+\s+loss\s+\S+\s+\(2 ranks\)", out), out  # training went on with 2


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_train_gradsync_join_uneven_ranks_end_identical() -> None:
    out = run_example("train.py")
    assert "parameters identical on all 2 ranks: True" in out, out
    assert re.search(r"rank 0: 40 batches, shadowed 3 steps", out), (
        out
    )  # uneven: rank 0 joined early
    assert re.search(r"rank 1: 43 batches, shadowed 0 steps", out), out
    assert "final model from rank 1 (the last to finish)" in out, out
    assert "43 synchronised steps" in out, out
    evals = [float(v) for v in re.findall(r"eval  step\s+\d+: held-out loss (\S+)", out)]
    assert len(evals) == 4, out  # the concurrent eval task ran
    assert evals[-1] < evals[0], out
    first, last = re.search(r"rank 0: .*first loss (\S+), last loss (\S+),", out).groups()  # type: ignore[union-attr]
    assert float(last) < float(first), out


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_elastic_recipe_with_torchrun_rank_killed_restarted_rejoins(tmp_path: Path) -> None:
    """The launch recipe, with real components: the store CLI and one torchrun per rank; the
    killed worker is restarted by its own torchrun, joins, gets the state; all end bit-equal."""
    png = tmp_path / "elastic.png"
    out = run_example("elastic.py", "--png", str(png))
    timeline = {
        what: float(at)
        for at, what in re.findall(
            r"^\s+([+-]\d+\.\d+)\s+(death|detected|shrunk|resumed|replacement started|join called|"
            r"grow started|joined|rejoined|state received|first joint step)\b",
            out,
            re.MULTILINE,
        )
    }
    order = [
        "death",
        "detected",
        "shrunk",
        "resumed",
        "replacement started",
        "join called",
        "grow started",
        "joined",
        "rejoined",
        "state received",
        "first joint step",
    ]
    assert set(timeline) == set(order), out
    assert [timeline[w] for w in order[:4]] == sorted(timeline[w] for w in order[:4]), out
    assert timeline["replacement started"] <= timeline["join called"] <= timeline["joined"], out
    assert timeline["joined"] <= timeline["state received"] <= timeline["first joint step"], out
    assert timeline["grow started"] <= timeline["rejoined"] <= timeline["first joint step"], out
    assert timeline["resumed"] < 10, out  # the survivors went on in seconds, not at a deadline
    assert re.search(r"death\s+rank 2 SIGKILLed at step 10", out), out
    assert re.search(r"detected\s+(PeerFailure|CommAborted): rank\(s\) \[2\] failed", out), out
    assert re.search(r"shrunk\s+3 -> 2 ranks", out), out
    # torchrun logs each worker that exits non-zero: the killed one, and never a survivor during
    # training. The one exception is Gloo's teardown abort at interpreter exit after the job has
    # finished ("terminate called without an active exception", about 1 process exit in
    # 40 here, with or without elastic calls): its torchrun restarts it, and the restarted worker
    # sees the job finished and says so. Every such crash must be accounted for that way.
    failed = re.findall(r"failed \(exitcode: (-?\d+)\)", out)
    after_the_end = out.count("the job has finished, nothing to join")
    assert failed.count("-9") == 1 and len(failed) - 1 == after_the_end, out
    assert re.search(r"replacement started\s+rank 2's torchrun restarted it", out), out
    assert re.search(r"joined\s+as rank 2 of 3", out), out
    assert re.search(r"rejoined\s+2 -> 3 ranks", out), out
    assert "parameters bit-equal on all 3 ranks: True" in out, out
    sizes = [
        int(n) for n in re.findall(r"^step\s+\d+\s+loss\s+\S+\s+\((\d) ranks\)", out, re.MULTILINE)
    ]
    assert sizes[0] == 3 and 2 in sizes, out  # trained on 3, then on the 2 survivors
    losses = re.search(
        r"held-out loss (\S+) \(at the start (\S+)\)", out
    )  # it learnt (one step's loss is noise)
    assert losses is not None and float(losses[1]) < float(losses[2]), out
    assert png.stat().st_size > 10_000, out
