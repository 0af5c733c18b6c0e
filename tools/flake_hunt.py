"""Flake hunt: run the test suite N times on a fresh clone, beside CPU hogs; list every test that failed.

    python tools/flake_hunt.py [--runs 5] [--hogs 2] [--keep] [-- extra pytest args]
    make flake-hunt N=5

The clone is of this checkout's HEAD (``git clone``: committed work only), in a
temporary directory; it runs with this checkout's virtual environment, with the
clone first on ``PYTHONPATH`` (checked: ``asynccoll`` and ``streams`` must import
from the clone). ``--hogs`` processes spin on the CPU for the whole hunt, as the
issue's failing runs had (a package install, other engineers' suites). Each run
writes a JUnit XML file; at the end every test that failed or errored at least
once is listed with its count and the first lines of its first failure. Exit
status 0 only when every run was green.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _clone(dest: Path) -> Path:
    repo = dest / "asynccoll"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(repo)], check=True)
    head = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    print(f"fresh clone of {ROOT} at {head}: {repo}", flush=True)
    return repo


def _env(repo: Path) -> dict[str, str]:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        ),
    )
    env.pop("PYTEST_ADDOPTS", None)
    return env


def _check_imports(repo: Path, env: dict[str, str]) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import asynccoll, streams; print(asynccoll.__file__); print(streams.__file__)",
        ],
        cwd=repo,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for path in out:
        if not Path(path).resolve().is_relative_to(repo.resolve()):
            raise SystemExit(f"the clone's packages do not come first: {path} is outside {repo}")


def _failures(xml: Path) -> dict[str, str]:
    """test id -> the first lines of its failure (or error), from a JUnit XML file."""
    out: dict[str, str] = {}
    if not xml.exists():
        return {"<no junit xml: the run did not finish>": ""}
    for case in ET.parse(xml).getroot().iter("testcase"):
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                name = f"{case.get('classname', '')}::{case.get('name', '')}"
                text = (node.get("message") or node.text or "").strip().splitlines()
                out[name] = "\n".join(text[:3])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--hogs", type=int, default=2, help="CPU-hog processes running meanwhile")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per suite run")
    ap.add_argument("--keep", action="store_true", help="keep the clone and the XML files")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="asynccoll-flake-hunt-"))
    hogs: list[subprocess.Popen[bytes]] = []
    seen: dict[str, list[int]] = {}
    first: dict[str, str] = {}
    try:
        repo = _clone(work)
        env = _env(repo)
        _check_imports(repo, env)
        hogs = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)
        ]
        for i in range(1, args.runs + 1):
            xml = work / f"run{i}.xml"
            load = os.getloadavg()[0]
            t0 = time.monotonic()
            cmd = [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                f"--junitxml={xml}",
                *args.pytest_args,
            ]
            try:
                proc = subprocess.run(
                    cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=args.timeout
                )
                tail = proc.stdout.strip().splitlines()[-1:] or [""]
            except subprocess.TimeoutExpired:
                tail = [f"the run took more than {args.timeout:g} s"]
            failed = _failures(xml)
            for name, text in failed.items():
                seen.setdefault(name, []).append(i)
                first.setdefault(name, text)
            print(
                f"run {i}/{args.runs}: {'GREEN' if not failed else f'{len(failed)} failed'} in "
                f"{time.monotonic() - t0:.0f} s (load {load:.1f} at start, {args.hogs} hogs): {tail[0]}",
                flush=True,
            )
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if not seen:
        print(f"flake hunt: {args.runs}/{args.runs} runs green")
        return 0
    print(f"flake hunt: {len(seen)} test(s) failed at least once in {args.runs} runs:")
    for name, runs in sorted(seen.items()):
        print(f"  {name}: failed in run(s) {runs}\n    " + first[name].replace("\n", "\n    "))
    return 1


if __name__ == "__main__":
    sys.exit(main())
