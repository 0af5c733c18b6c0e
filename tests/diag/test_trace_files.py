"""Trace files of several communicators in one ``trace_dir``: a shrink's new
communicator (its ranks renumbered) and two communicators alive at once each write
files of their own, and ``python -m asynccoll.diagnose`` reads one communicator at a
time, says which, and lists the others."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import asynccoll as ac
from asynccoll.testing import RankContext, crash_later, run_ranks

pytestmark = pytest.mark.timeout(150)


def _diagnose(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asynccoll.diagnose", str(path), *extra],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _files(path: Path) -> dict[str, dict[str, list[int]]]:
    """``{comm: {"flight"|"trace": [ranks]}}`` of the files in ``path``."""
    out: dict[str, dict[str, list[int]]] = {}
    for f in sorted(path.iterdir()):
        *named, rank, kind, _ = f.name.split(".")  # (rank<R>.<kind>.json: no communicator)
        comm = named[0] if named else ""
        out.setdefault(comm, {}).setdefault(kind, []).append(int(rank[len("rank") :]))
    return out


async def shrink_traced(ctx: RankContext, trace_dir: str) -> dict[str, Any]:
    """3 ranks with ``trace_dir``; rank 2 dies; the survivors shrink (ranks 0, 1 again),
    all-reduce on the new communicator and close both."""
    comm = await ac.init(
        "gloo",
        rank=ctx.rank,
        world_size=ctx.world_size,
        store=ctx.store,
        timeout=30,
        trace_dir=trace_dir,
    )
    await comm.all_reduce(torch.ones(2))
    if ctx.rank == 2:
        crash_later(0.2, how="sigkill")
    with pytest.raises(ac.PeerFailure):
        while True:
            await comm.all_reduce(torch.ones(1024))
    new = await comm.shrink()
    await new.all_reduce(torch.ones(2))
    await new.barrier()
    await new.close()
    await comm.close()
    return {"rank": new.rank}


def test_a_shrink_writes_files_of_its_own_and_diagnose_says_which_it_reads(
    tmp_path: Path,
) -> None:
    """Files were named by rank only: the shrunk communicator's rank 0 and 1 wrote over
    the old one's timelines, and diagnose read the old one's flight records (a
    PeerFailure, rank 2 missing) as the new ranks' files."""
    run_ranks(
        shrink_traced, world_size=3, backend=None, timeout=120, args=(str(tmp_path),), lost=(2,)
    )
    files = _files(tmp_path)
    assert len(files) == 2, files
    old, new = sorted(files, key=lambda c: "flight" not in files[c])  # the old one aborted
    assert files[old] == {"flight": [0, 1], "trace": [0, 1]}, files
    assert files[new] == {"trace": [0, 1]}, files
    # The newest communicator by default: the shrunk one, healthy.
    proc = _diagnose(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"communicator {new} (created " in proc.stdout, proc.stdout
    assert "2 ranks" in proc.stdout and f"  {old} (created " in proc.stdout, proc.stdout
    # The old one on request: 3 ranks, rank 2 without files, the failure recorded.
    proc = _diagnose(tmp_path, "--comm", old)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"communicator {old} (created " in proc.stdout, proc.stdout
    assert "no trace files from rank 2" in proc.stdout, proc.stdout
    assert "recorded PeerFailure" in proc.stdout, proc.stdout
    js = json.loads(_diagnose(tmp_path, "--json").stdout)
    assert js["comm"]["id"] == new and js["comm"]["world_size"] == 2, js["comm"]
    assert [o["id"] for o in js["others"]] == [old], js["others"]
    assert js["others"][0]["flight_records"] == [0, 1], js["others"]
    listed = _diagnose(tmp_path, "--list").stdout.splitlines()
    assert [line.split()[0] for line in listed] == [old, new], listed
    assert _diagnose(tmp_path, "--comm", "c0-nothing").returncode == 2


async def two_at_once(ctx: RankContext, trace_dir: str) -> None:
    """Two communicators of the same ranks alive at once, one ``trace_dir``: the first
    runs two ops, the second three; then both close."""
    kw: dict[str, Any] = dict(
        rank=ctx.rank, world_size=ctx.world_size, store=ctx.store, timeout=30, trace_dir=trace_dir
    )
    a = await ac.init("gloo", **kw)
    b = await ac.init("gloo", **kw)
    for _ in range(2):
        await a.all_reduce(torch.ones(2))
    for _ in range(3):
        await b.broadcast(torch.ones(2), 0)
    await a.close()
    await b.close()


def test_two_communicators_alive_at_once_keep_their_files_apart(tmp_path: Path) -> None:
    run_ranks(two_at_once, world_size=2, backend=None, timeout=60, args=(str(tmp_path),))
    files = _files(tmp_path)
    assert sorted(files.values(), key=str) == [{"trace": [0, 1]}] * 2, files
    ops = {}
    for comm in files:
        js = json.loads(_diagnose(tmp_path, "--comm", comm, "--json").stdout)
        assert js["ok"] and js["comm"]["id"] == comm, js
        ops[comm] = js["ranks"]["0"]["last_completed"]
    assert sorted((o["seq"], o["op"]) for o in ops.values()) == [
        (2, "all_reduce"),
        (3, "broadcast"),
    ]
