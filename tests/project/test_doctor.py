"""``python -m asynccoll.doctor``: one screen of what asynccoll finds, on any machine, never failing."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch

from asynccoll import doctor


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asynccoll.doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_doctor_prints_one_screen_and_exits_0() -> None:
    out = run()
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert len(text.splitlines()) <= 25
    for label in (
        "asynccoll ",
        "python ",
        "torch ",
        "CUDA ",
        "driver ",
        "packages ",
        "libnccl ",
        "NCCL ",
        "stream ",
    ):
        assert any(line.startswith(label) for line in text.splitlines()), (label, text)
    assert f"torch      {torch.__version__}" in text
    if not torch.cuda.is_available():
        assert "CUDA       not available" in text
        assert "needs a CUDA GPU" in text  # the NCCL line says why it cannot run
        assert "comm stream: no CUDA device" in text


def test_doctor_json_names_the_libnccl_and_its_features() -> None:
    out = run("--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["torch"] == torch.__version__ and report["torch_cuda"] == torch.version.cuda
    lib = report["libnccl"]
    assert isinstance(lib, dict), lib  # the test extras install nccl4py with a libnccl
    assert lib["path"].endswith(".so.2") and lib["version"][0].isdigit()
    assert set(report["features"]) == {"revoke", "shrink", "grow"}
    assert all(v.startswith(("yes", "no")) for v in report["features"].values())


def test_a_failing_probe_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> Any:
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(doctor, "_driver", broken)
    monkeypatch.setattr(doctor, "_libnccl", broken)
    report = doctor.collect()
    assert report["driver"].startswith("unavailable (OSError: libcuda.so.1")
    assert report["libnccl"].startswith("unavailable (OSError") and report["features"] == {}
    text = doctor.render(report)
    assert "driver     unavailable (OSError" in text and "libnccl    unavailable" in text


def _report(
    cuda: str | None, bindings: str | None, lib_cuda: str = "13.0", nccl4py: str | None = "0.6.0"
) -> Any:
    return {
        "torch_cuda": cuda,
        "cuda_available": True,
        "torch_nccl": "2.28.9",
        "packages": {"nccl4py": nccl4py, "cuda-bindings": bindings},
        "libnccl": {"version": "2.28.9", "cuda": lib_cuda, "path": "/x/libnccl.so.2"},
    }


def test_advice_names_the_extra_of_torchs_cuda_major() -> None:
    assert doctor.advice(_report("13.0", "13.5.0")) == []  # all of one CUDA major: nothing to say
    assert any(
        "asynccoll[nccl-cu13]" in t for t in doctor.advice(_report("13.0", None, nccl4py=None))
    )
    (tip,) = doctor.advice(_report("13.0", "12.9.4"))
    assert "cuda-bindings 12.9.4 is for CUDA 12" in tip and "nccl-cu13" in tip
    (tip,) = doctor.advice(_report("12.8", "12.9.4", lib_cuda="13.0"))
    assert "libnccl built for CUDA 13.0" in tip and "nccl-cu12" in tip
    assert "CPU build" in doctor.advice(_report(None, "12.9.4"))[0]
    two = dict(_report("13.0", "13.5.0"), torch_nccl="2.27.5")
    assert any("two NCCL libraries" in t for t in doctor.advice(two))
