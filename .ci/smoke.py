"""Smoke test of an installed asynccoll (run by .ci/dist-check in a fresh venv, outside the source tree)."""

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import torch

import asynccoll as ac
import asynccoll.testing
import streams

EXPECTED = sys.argv[1]  # the version that was built

for mod in (ac, asynccoll.testing, streams):
    where = Path(mod.__file__).resolve()
    assert "site-packages" in where.parts, (
        f"{mod.__name__} imported from {where}, not from the installed package"
    )
for pkg in (ac, streams):
    assert (Path(pkg.__file__).parent / "py.typed").exists(), (
        f"{pkg.__name__}: py.typed not installed"
    )
assert ac.__version__ == EXPECTED, (ac.__version__, EXPECTED)


async def main() -> list[float]:
    store = torch.distributed.HashStore()
    async with ac.init("gloo", rank=0, world_size=1, store=store, timeout=30) as comm:
        return (await comm.all_reduce(torch.ones(3))).tolist()


assert asyncio.run(main()) == [1.0, 1.0, 1.0]
cli = subprocess.run(
    [sys.executable, "-m", "asynccoll.diagnose", "--help"],
    capture_output=True,
    text=True,
    timeout=60,
    env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
)
assert cli.returncode == 0 and "trace_dir" in cli.stdout, cli.stderr
# The doctor where no extra is installed (no nccl4py, cuda-bindings or libnccl): says so, exits 0.
doc = subprocess.run(
    [sys.executable, "-m", "asynccoll.doctor"],
    capture_output=True,
    text=True,
    timeout=120,
    env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
)
assert doc.returncode == 0 and "absent     nccl4py, cuda-bindings, cuda-core" in doc.stdout, (
    doc.stdout,
    doc.stderr,
)
print(
    f"asynccoll {ac.__version__} from {Path(ac.__file__).parent}: import, one-rank all_reduce, diagnose, doctor: ok"
)
