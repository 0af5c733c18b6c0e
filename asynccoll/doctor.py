"""``python -m asynccoll.doctor``: what asynccoll finds on this machine, on one screen.

Python and torch (its CUDA build), the CUDA devices, the driver, cuda-bindings,
cuda-core, nccl4py and the libnccl it loads (with torch's own NCCL beside it), whether
the NCCL backend can run and which of revoke, shrink and grow the loaded libnccl has,
and the priority of the communication stream. It ends with what to install where
something is missing or of the wrong CUDA major. Paste it into a bug report.

Every probe is guarded: on a machine without CUDA (or without nccl4py) it says what is
absent, and the command never fails. Exit status 0; ``--json`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import platform
import sys
from typing import Any, Callable

#: Distributions whose versions are listed (those that decide the GPU path).
_DISTS = (
    "torch",
    "nccl4py",
    "cuda-bindings",
    "cuda-core",
    "cuda-pathfinder",
    "nvidia-nccl-cu12",
    "nvidia-nccl-cu13",
    "cupy-cuda12x",
    "cupy-cuda13x",
    "uvloop",
    "trio",
    "anyio",
)
#: The extras of each CUDA major (pyproject.toml).
_EXTRA = {12: "nccl-cu12", 13: "nccl-cu13"}


def _probe(fn: Callable[[], Any]) -> Any:
    """``fn()``, or the text of what it raised (a probe never fails the report)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - every failure is a finding, reported as text
        return f"unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''})"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _major(version: Any) -> int | None:
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        return None


def _devices(torch: Any) -> list[str]:
    out = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        out.append(f"cuda:{i} {torch.cuda.get_device_name(i)} (sm_{major}{minor})")
    return out


def _driver() -> str:
    from cuda.bindings import driver

    err, version = driver.cuDriverGetVersion()
    if int(err) != 0:
        return f"unavailable (cuDriverGetVersion: {err})"
    return f"{version // 1000}.{version % 1000 // 10} (supports CUDA up to this)"


def _libnccl() -> dict[str, Any]:
    import nccl.core as nc

    lib = nc.get_version().libnccl
    if lib is None:
        raise RuntimeError("nccl4py found no libnccl")
    return {"version": str(lib.version), "cuda": str(lib.cuda_variant), "path": str(lib.path)}


def _features(version: str) -> dict[str, str]:
    """Which of revoke, shrink and grow the loaded libnccl and nccl4py have."""
    import nccl.core as nc

    from ._backends.nccl import lib

    have = tuple(int(p) for p in version.split("+")[0].split(".")[:3])

    def feature(attr: str, since: tuple[int, int, int]) -> str:
        ok = hasattr(nc.Communicator, attr) and have >= since
        return f"{'yes' if ok else 'no'} (NCCL >= {'.'.join(map(str, since))})"

    return {
        "revoke": feature("revoke", lib.REVOKE_SINCE),
        "shrink": feature("shrink", lib.SHRINK_SINCE),
        "grow": feature("grow", lib.GROW_SINCE),
    }


def _comm_stream(torch: Any) -> str:
    import streams

    least, greatest = torch.cuda.Stream.priority_range()
    s = streams.comm_stream(0)
    return f"priority {s.priority} on cuda:0 (device range {least} lowest .. {greatest} highest)"


def collect() -> dict[str, Any]:
    """Everything the report shows, as a dict (the ``--json`` output)."""
    from . import __version__

    r: dict[str, Any] = {
        "asynccoll": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "packages": {d: _version(d) for d in _DISTS},
    }
    torch: Any = _probe(lambda: importlib.import_module("torch"))
    if isinstance(torch, str):
        r["torch"] = torch
        return r
    r["torch"] = torch.__version__
    r["torch_cuda"] = torch.version.cuda  # None: a CPU build
    r["cuda_available"] = bool(_probe(torch.cuda.is_available) is True)
    r["devices"] = _probe(lambda: _devices(torch)) if r["cuda_available"] else []
    r["driver"] = _probe(_driver)
    r["torch_nccl"] = (
        _probe(lambda: ".".join(map(str, torch.cuda.nccl.version())))
        if r["torch_cuda"]
        else "none (CPU build)"
    )
    lib = _probe(_libnccl)
    r["libnccl"] = lib
    r["features"] = _probe(lambda: _features(lib["version"])) if isinstance(lib, dict) else {}
    from ._backends.nccl import missing

    r["nccl_backend"] = _probe(missing) or "usable"
    r["comm_stream"] = (
        _probe(lambda: _comm_stream(torch)) if r["cuda_available"] else "no CUDA device"
    )
    r["advice"] = advice(r)
    return r


def advice(r: dict[str, Any]) -> list[str]:
    """What to install or check, from a :func:`collect` report."""
    tips: list[str] = []
    pkgs = r.get("packages", {})
    cuda_major = _major(r.get("torch_cuda")) if r.get("torch_cuda") else None
    if cuda_major is None:
        tips.append(
            "torch is a CPU build: CPU tensors only (backend='gloo'); for CUDA tensors install a CUDA "
            "build of torch first, then asynccoll's NCCL extra of the same CUDA major"
        )
        return tips
    extra = _EXTRA.get(cuda_major, f"nccl-cu{cuda_major}")
    bindings = _major(pkgs.get("cuda-bindings")) if pkgs.get("cuda-bindings") else None
    if not pkgs.get("nccl4py") or bindings is None:
        tips.append(f"torch is built for CUDA {r['torch_cuda']}: pip install 'asynccoll[{extra}]'")
    elif bindings != cuda_major:
        tips.append(
            f"cuda-bindings {pkgs['cuda-bindings']} is for CUDA {bindings}, torch for CUDA {cuda_major}: "
            f"pip install 'asynccoll[{extra}]' in a fresh environment"
        )
    lib = r.get("libnccl")
    if isinstance(lib, dict) and _major(lib.get("cuda")) not in (None, cuda_major):
        tips.append(
            f"nccl4py loads a libnccl built for CUDA {lib['cuda']} ({lib['path']}), torch is built for "
            f"CUDA {cuda_major}: pip install 'asynccoll[{extra}]' (nvidia-nccl-cu{cuda_major})"
        )
    torch_nccl = str(r.get("torch_nccl", ""))
    if isinstance(lib, dict) and torch_nccl[:1].isdigit() and torch_nccl != str(lib.get("version")):
        tips.append(
            f"torch's NCCL is {torch_nccl}, nccl4py's libnccl {lib['version']}: two NCCL libraries "
            "in one process; the NCCL extra of torch's CUDA major installs the one torch uses"
        )
    if not r.get("cuda_available"):
        tips.append(
            "torch sees no CUDA device (driver, CUDA_VISIBLE_DEVICES, or a container without the GPU)"
        )
    return tips


def render(r: dict[str, Any]) -> str:
    """The report as text (one screen)."""
    lines = [
        f"asynccoll {r['asynccoll']}",
        f"python     {r['python']}",
        f"platform   {r['platform']}",
    ]
    if "torch_cuda" not in r:
        return "\n".join([*lines, f"torch      {r['torch']}"])
    built = f"built for CUDA {r['torch_cuda']}" if r["torch_cuda"] else "CPU build"
    lines.append(f"torch      {r['torch']} ({built}); NCCL in torch: {r['torch_nccl']}")
    devices = r["devices"] if isinstance(r["devices"], list) else [r["devices"]]
    lines.append(
        f"CUDA       {'available: ' + '; '.join(devices) if r['cuda_available'] else 'not available'}"
    )
    lines.append(f"driver     {r['driver']}")
    pkgs = r["packages"]
    lines.append("packages   " + (", ".join(f"{d} {v}" for d, v in pkgs.items() if v) or "none"))
    absent = [d for d in ("nccl4py", "cuda-bindings", "cuda-core") if not pkgs.get(d)]
    if absent:
        lines.append(f"absent     {', '.join(absent)}")
    lib = r["libnccl"]
    if isinstance(lib, dict):
        lines.append(
            f"libnccl    {lib['version']} for CUDA {lib['cuda']}, loaded by nccl4py from {lib['path']}"
        )
        feats = r["features"]
        if isinstance(feats, dict):
            lines.append("features   " + "; ".join(f"{k} {v}" for k, v in feats.items()))
        else:
            lines.append(f"features   {feats}")
    else:
        lines.append(f"libnccl    {lib}")
    lines.append(f"NCCL       {r['nccl_backend']}")
    lines.append(f"stream     comm stream: {r['comm_stream']}")
    lines += [f"advice     {tip}" for tip in r["advice"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asynccoll.doctor",
        description="Say what asynccoll finds here: torch and its CUDA, the GPUs, nccl4py and libnccl, NCCL features.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    report = collect()
    print(json.dumps(report, indent=1, default=str) if args.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
