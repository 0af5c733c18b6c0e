"""Run torch's own distributed collective tests against the ``"asynccoll"`` backend.

    BACKEND=asynccoll WORLD_SIZE=2 python tools/torch_suite.py [-k PATTERN ...] [-v]

The ``_group`` variants need ``WORLD_SIZE=8`` (torch's ``skip_if_small_worldsize``
skips them below 8 ranks for every backend but MPI).

torch ships the suite in its wheel (``torch.testing._internal.distributed.
distributed_test``, needs ``expecttest``); its harness builds the default group with
``dist.init_process_group(BACKEND, init_method="file://...")`` in one process per
rank, which ``import asynccoll`` makes an asynccoll communicator. The results, and
why the skipped tests skip, are listed in docs/guides/torch.md.
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("BACKEND", "asynccoll")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="asynccoll-torch-suite-"))

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

import asynccoll  # noqa: E402,F401  - registers the backend name in every rank process


class TestAsynccollBackend(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc]
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    sys.exit(run_tests())
