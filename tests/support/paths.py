"""Where things are: the repository's root, wherever a test file sits below it; and the
environment a child Python needs to import it."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH``, the rest
    kept (the GPU run's wheels live there: replacing it hid trio from a child), plus
    ``extra``."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
