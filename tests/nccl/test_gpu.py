"""The NCCL path on a real GPU: what the simulated GPU cannot show (world size 1, one GPU).

Each test runs its GPU work in rank processes (``run_ranks``, rank functions in
``gpu_ranks.py``) or a fresh subprocess, never in the pytest process, so that they can
share one GPU with each other and with the simulated-GPU tests under ``pytest -n 8``.
Without CUDA and nccl4py they skip with the reason. ``tools/gpu_run.py`` (``make
gpu-test``) runs them on a GPU machine; the last test here checks it without one.

* stream order and the caching allocator, with the host never blocked;
* abort while an op waits behind seconds of GPU work; close with work pending;
* the event loop's longest stall in init (cold and warm), ops and close;
* two processes on one GPU at world size 2: a typed error naming the cause, nothing left;
* every collective, dtype and reduce op, torch and CuPy; coalesced groups; NCCL's group
  error rule;
* ``comm.split`` on real NCCL: a working child, None for no group, outliving its parent;
* the host cost of an op against torch's ProcessGroupNCCL, same process, same run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tests.support.gpu_ranks as gr
from asynccoll._backends import nccl
from asynccoll.testing import run_ranks
from tests.support.paths import ROOT, child_env

NCCL_MISSING = nccl.missing()
needs_nccl = pytest.mark.skipif(
    NCCL_MISSING is not None, reason=f"needs a CUDA GPU and nccl4py: {NCCL_MISSING}"
)
#: The event loop's longest stall allowed in each phase (init, ops, close), in ms.
STALL_MS = 5.0
#: asynccoll's issue cost per op, at most this many times torch's ProcessGroupNCCL's (a
#: regression guard; the figures themselves come from ``python -m bench.gpu``).
HOST_COST_LIMIT = 5.0


def on_gpu(
    fn: Any, world_size: int = 1, backend: str | None = "nccl", timeout: float = 90, **kw: Any
) -> Any:
    return run_ranks(fn, world_size=world_size, backend=backend, timeout=timeout, **kw)


# ============================================================== stream order, allocator
@needs_nccl
@pytest.mark.timeout(120)
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_side_stream_ops_see_their_inputs_and_outlive_freed_inputs(loop: str) -> None:
    (res,) = on_gpu(gr.side_stream_order, loop=loop)
    assert res["bad"] == [], res  # wrong bytes: ran before the fill, or read a reused block
    # The host never waited for the GPU: the loop was done with time to spare.
    assert res["pending_at_end"] and res["loop_s"] < res["gpu_sleep_s"], res


# ===================================================================== abort, close
@needs_nccl
@pytest.mark.timeout(120)
def test_abort_behind_seconds_of_gpu_work_is_prompt_and_leaves_nothing() -> None:
    (res,) = on_gpu(gr.abort_behind_gpu_work, backend=None)
    assert res["queued"] and res["outcome"] == "CommAborted", res
    assert res["failed_s"] < 1.0, res  # the awaiting task has its CommAborted within 1 s
    assert res["revoked"] or not res["can_revoke"], res  # ncclCommRevoke where the libnccl has it
    assert res["threads_left"] == [], res
    assert res["fresh"] == "ok", res


@needs_nccl
@pytest.mark.timeout(90)
def test_close_with_work_pending_finishes_it_then_finalizes() -> None:
    (res,) = on_gpu(gr.close_with_pending)
    assert res["done"] and res["exception"] == "None" and res["ran"], res
    assert res["state"] == "closed" and res["finalized"], res  # finalized, not aborted


# ======================================================================= loop stalls
@needs_nccl
@pytest.mark.timeout(150)
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_loop_never_stalls_in_init_ops_or_close(loop: str, record_property: Any) -> None:
    out = subprocess.run(
        [sys.executable, gr.__file__, "stall", loop],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        cwd=ROOT,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(lines[-1][7:])
    stalls = {k: v for k, v in res.items() if k.endswith("_ms")}
    assert set(stalls) == {"cold_init_ms", "warm_init_ms", "ops_ms", "close_ms"}, res
    for name, ms in stalls.items():
        record_property(name, ms)
    assert max(stalls.values()) <= STALL_MS, res


# ======================================================== two processes, one GPU
@needs_nccl
@pytest.mark.skipif(
    os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1",
    reason="NCCL_MULTI_RANK_GPU_ENABLE=1 lets NCCL >= 2.30 put two ranks on one GPU",
)
@pytest.mark.timeout(120)
def test_two_ranks_on_one_gpu_fail_with_the_cause_and_leave_nothing() -> None:
    results = on_gpu(gr.auto_two_ranks_one_gpu, world_size=2, backend=None, timeout=100)
    for res in results:
        assert res["outcome"].startswith("BackendUnavailable: "), results
        assert "Duplicate GPU" in res["outcome"], results  # NCCL's own words (ncclGetLastError)
        assert res["seconds"] < 20, results  # init's timeout: nothing hung
        assert res["keys_left"] == 0 and res["threads_left"] == [], results


# ===================================================== every collective, groups
@needs_nccl
@pytest.mark.timeout(150)
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_every_collective_dtype_and_reduce_op_is_exact(loop: str) -> None:
    (bad,) = on_gpu(gr.every_collective, loop=loop, timeout=120)
    assert bad == []


@needs_nccl
@pytest.mark.timeout(90)
def test_coalesced_groups_mix_collectives_and_send_recv_to_self() -> None:
    (bad,) = on_gpu(gr.coalesced_group)
    assert bad == []


@needs_nccl
@pytest.mark.timeout(90)
def test_a_bad_call_in_an_nccl_group_fails_group_end() -> None:
    (res,) = on_gpu(gr.nccl_group_error_rule, backend=None)
    assert res["group_end"].startswith("NCCLError: InvalidArgument"), res
    print(
        "the group's valid member ran:", res["ran"]
    )  # True on NCCL 2.28.9, an H100 (docs/verified.md)


# ======================================================================= lifecycle
@needs_nccl
@pytest.mark.timeout(120)
def test_init_close_cycles_leak_nothing() -> None:
    (res,) = on_gpu(gr.init_close_cycles)
    assert res == {"threads": 0, "mem": 0}, res


@needs_nccl
@pytest.mark.timeout(90)
def test_init_picks_the_local_rank_device() -> None:
    assert on_gpu(gr.local_rank_device, backend=None) == ["cuda:0 nccl"]


# ========================================================================== split
@needs_nccl
@pytest.mark.timeout(180)
def test_split_on_real_nccl_works_outlives_its_parent_and_leaves_nothing(
    record_property: Any,
) -> None:
    (res,) = on_gpu(gr.split_on_gpu, backend=None, timeout=150)
    print(json.dumps(res, indent=1))
    assert res["sub"] == [0, 1, "nccl", "cuda:0"] and res["own_nccl"], res
    assert res["ops_exact"], res
    assert res["none"] and res["parent_after"] == [2.0] * 4, res
    assert res["calls"] == [(0, 0), (None, 0)], res  # (pickled back: tuples stay tuples)
    assert res["child_after_abort"] == [3.0] * 4, res
    assert res["split_of_aborted"] == "CommAborted", res
    assert res["threads_left"] == [], res
    # What a split and its first op cost, beside torch's (figures, not a verdict).
    record_property("split_ms_median", statistics.median(res["split_ms"]))
    for name, times in res["torch"].items():
        record_property(
            f"torch_{name}", statistics.median(times) if isinstance(times, list) else times
        )


# ======================================================================= host cost
@needs_nccl
@pytest.mark.timeout(150)
def test_host_cost_per_op_against_torch_process_group_nccl(record_property: Any) -> None:
    (rows,) = on_gpu(gr.host_cost, backend=None, args=(2000,), timeout=120)
    ours, torchs = rows
    for key in (
        "issue_wall_us",
        "issue_thread_cpu_us",
        "process_cpu_per_op_us",
        "throughput_ops_s",
    ):
        record_property(f"asynccoll_{key}", round(ours[key], 2))
        record_property(f"torch_{key}", round(torchs[key], 2))
    print(json.dumps(rows, indent=1))
    assert ours["issue_wall_us"] <= HOST_COST_LIMIT * torchs["issue_wall_us"], rows


# ===================================================================== the GPU run
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU run where there is no GPU")
@pytest.mark.timeout(120)
def test_the_gpu_run_says_there_is_no_gpu_in_seconds(tmp_path: Path) -> None:
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_run.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no CUDA GPU: nothing to run" in out.stdout
    assert time.monotonic() - t0 < 60
    assert {p.name for p in tmp_path.iterdir()} == {"doctor.txt", "doctor.json", "summary.txt"}
    assert "no CUDA GPU: nothing to run" in (tmp_path / "summary.txt").read_text()
    assert "CUDA       not available" in (tmp_path / "doctor.txt").read_text()
