"""Spies for the tests: a real object keeps working while its calls are counted."""

from __future__ import annotations

import threading


class Sets:
    """Counts the calls of an event's ``set`` (a spy: the event behaves as before)."""

    def __init__(self, event: threading.Event) -> None:
        self.n = 0
        self._set = event.set
        event.set = self  # type: ignore[method-assign]

    def __call__(self) -> None:
        self.n += 1
        self._set()
