"""The GPU run: asynccoll's real-GPU tests, then the GPU benchmark, with the Python it is run by.

    python tools/gpu_run.py [--out DIR] [--budget 420] [--workers 4]
    make gpu-test PY=python3            (NO_VENV=1 is the default: nothing is installed)

Installs nothing. Phases, each cut to what is left of ``--budget`` seconds (default
420, 7 minutes), each writing its files into ``--out`` as it goes (default ``$OUT``,
else ``bench/results/gpu``), so a run stopped at any point leaves what it found:

0. ``doctor.txt``: ``python -m asynccoll.doctor`` (torch and its CUDA, the GPUs,
   nccl4py and its libnccl). Without a CUDA GPU the run ends here: "no CUDA GPU:
   nothing to run", exit 0, in seconds.
1. ``gpu_tests.log`` / ``gpu_tests.xml``: pytest on ``tests/nccl/test_gpu.py``, the GPU
   tests of ``tests/streams/test_streams.py`` and ``tests/nccl/test_nccl4py.py``,
   ``tests/project/test_doctor.py`` and the GPU guide's script, ``--workers`` processes
   (at most 240 s).
2. ``bench.txt`` / ``bench.json``: ``python -m bench.gpu`` (asynccoll under asyncio and
   uvloop against torch's ProcessGroupNCCL, world size 1; at most 120 s).

``summary.txt`` grows after each phase and is printed at the end. A phase that runs out
of time is interrupted (SIGINT: pytest still writes its summary), then killed. Exit
status: 0 when every phase that ran passed (or there is no GPU), 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TESTS = [
    "tests/nccl/test_gpu.py",
    "tests/streams/test_streams.py",
    "tests/nccl/test_nccl4py.py",
    "tests/project/test_doctor.py",
    "tests/project/test_docs.py::test_script_runs",
]
#: pytest -k: every test of the files above but the docs' scripts other than the GPU guide's.
SELECT = "not test_script_runs or gpu"


class Run:
    """The report directory, the budget, and ``summary.txt``."""

    def __init__(self, out: Path, budget: float) -> None:
        self.out = out
        self.t0 = time.monotonic()
        self.budget = budget
        out.mkdir(parents=True, exist_ok=True)
        self.summary = out / "summary.txt"
        self.summary.write_text("")

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def say(self, text: str) -> None:
        line = f"[{time.monotonic() - self.t0:5.0f}s] {text}"
        print(line, flush=True)
        with self.summary.open("a") as f:
            f.write(line + "\n")

    def run(self, name: str, cmd: list[str], limit: float, log: str) -> int | None:
        """Run ``cmd`` in the repository with its output going to ``log`` as it comes;
        after ``limit`` seconds SIGINT, then SIGKILL. Its exit status (None: killed)."""
        env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
        )
        self.say(f"{name}: {' '.join(cmd)} (at most {limit:.0f} s) -> {log}")
        with (self.out / log).open("w") as f:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                return proc.wait(timeout=max(1.0, limit))
            except subprocess.TimeoutExpired:
                self.say(f"{name}: out of time after {limit:.0f} s: interrupted")
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                return None
            finally:
                _kill_group(proc.pid)


def _kill_group(pgid: int) -> None:
    """Whatever the phase left running (xdist workers, rank processes) goes with it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already gone
        os.killpg(pgid, signal.SIGKILL)


def doctor(run: Run) -> dict[str, Any]:
    """Phase 0: the doctor's report (text and JSON); the JSON as a dict ({} if it failed)."""
    run.run(
        "doctor", [sys.executable, "-m", "asynccoll.doctor"], min(60.0, run.left()), "doctor.txt"
    )
    out = subprocess.run(
        [sys.executable, "-m", "asynccoll.doctor", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    try:
        report: dict[str, Any] = json.loads(out.stdout)
    except json.JSONDecodeError:
        run.say(f"doctor: no report ({out.stderr.strip()[-300:]})")
        return {}
    (run.out / "doctor.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    lib = report.get("libnccl")
    lib_text = (
        f"libnccl {lib['version']} (CUDA {lib['cuda']})"
        if isinstance(lib, dict)
        else f"libnccl: {lib}"
    )
    run.say(
        f"torch {report.get('torch')} (CUDA {report.get('torch_cuda')}); devices {report.get('devices')}; "
        f"{lib_text}; NCCL backend: {report.get('nccl_backend')}"
    )
    return report


def junit_counts(path: Path) -> tuple[dict[str, int], list[str], dict[str, int]]:
    """(counts, failures, skip reasons with their counts) of a JUnit XML file."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures: list[str] = []
    skips: dict[str, int] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name', '')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skipped = case.find("skipped")
        if bad is not None:
            counts["failed"] += 1
            failures.append(
                f"{name}: {(bad.get('message') or '').splitlines()[0][:300] if bad.get('message') else ''}"
            )
        elif skipped is not None:
            counts["skipped"] += 1
            why = (skipped.get("message") or "")[:160]
            skips[why] = skips.get(why, 0) + 1
        else:
            counts["passed"] += 1
    return counts, failures, skips


def tests(run: Run, workers: int) -> bool:
    """Phase 1: the GPU tests; True when they passed."""
    limit = min(240.0, run.left() - 100.0)
    xml = run.out / "gpu_tests.xml"
    xml.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rfEs",
        "-n",
        str(workers),
        "-o",
        "faulthandler_timeout=100",
        f"--junitxml={xml}",
        "-k",
        SELECT,
        *TESTS,
    ]
    code = run.run("tests", cmd, limit, "gpu_tests.log")
    tail = (run.out / "gpu_tests.log").read_text(errors="replace").strip().splitlines()[-1:]
    run.say(f"tests: exit {code}: {tail[0] if tail else '(no output)'}")
    if not xml.exists():
        run.say("tests: no JUnit report")
        return False
    counts, failures, skips = junit_counts(xml)
    run.say(f"tests: {counts}")
    for line in failures[:30]:
        run.say(f"  FAILED {line}")
    for why, n in sorted(skips.items(), key=lambda kv: -kv[1])[:8]:
        run.say(f"  skipped x{n}: {why}")
    return code == 0


def bench(run: Run, iters: int) -> bool:
    """Phase 2: the GPU benchmark; True when it ran to the end."""
    limit = min(120.0, run.left() - 5.0)
    if limit < 30:
        run.say("bench: skipped (no time left)")
        return False
    cmd = [
        sys.executable,
        "-m",
        "bench.gpu",
        "--iters",
        str(iters),
        "--json",
        str(run.out / "bench.json"),
    ]
    code = run.run("bench", cmd, limit, "bench.txt")
    text = (run.out / "bench.txt").read_text(errors="replace")
    run.say(f"bench: exit {code}\n{text.strip()[-2500:]}")
    return code == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out",
        default=os.environ.get("OUT") or str(ROOT / "bench" / "results" / "gpu"),
        help="the report directory (default: $OUT, else bench/results/gpu)",
    )
    ap.add_argument(
        "--budget", type=float, default=420.0, help="seconds for the whole run (default 420)"
    )
    ap.add_argument(
        "--workers", type=int, default=4, help="pytest-xdist workers sharing the GPU (default 4)"
    )
    ap.add_argument("--iters", type=int, default=1000, help="bench.gpu --iters (default 1000)")
    args = ap.parse_args(argv)
    run = Run(Path(args.out).resolve(), args.budget)
    run.say(
        f"asynccoll GPU run: {sys.executable}, {ROOT}, report in {run.out}, budget {args.budget:.0f} s"
    )
    report = doctor(run)
    if not report:
        run.say(f"{sys.executable} cannot import asynccoll (see doctor.txt): nothing to run")
        return 1
    if not report.get("cuda_available"):
        why = f"torch {report.get('torch', '?')}, built for CUDA {report.get('torch_cuda') or 'none (CPU build)'}"
        run.say(f"no CUDA GPU: nothing to run ({why}; see doctor.txt)")
        return 0
    ok = tests(run, args.workers)
    ok = bench(run, args.iters) and ok
    run.say(
        f"done in {time.monotonic() - run.t0:.0f} s: {'all passed' if ok else 'FAILURES (see above)'}; "
        f"files: {' '.join(sorted(p.name for p in run.out.iterdir()))}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
