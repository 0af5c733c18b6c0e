"""Where things are: the repository's root, wherever a test file sits below it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
