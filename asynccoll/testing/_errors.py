"""Exceptions of the testing kit: a remote rank's traceback, and ranks that ran out of time."""

from __future__ import annotations

from typing import Mapping, Sequence


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in another process.

    Set as ``__cause__`` of an exception that :func:`run_ranks` re-raises, so the
    rank's own traceback is printed under the caller's (as ``concurrent.futures``
    does for process pools).
    """

    def __init__(self, text: str, rank: int | None = None) -> None:
        super().__init__(text)
        self.text = text
        self.rank = rank

    def __str__(self) -> str:
        return '\n"""\n' + self.text.rstrip("\n") + '\n"""'


class RanksTimedOut(TimeoutError):
    """Ranks were still running when :func:`run_ranks`' timeout expired.

    ``ranks``: the ranks that were stuck; ``stacks``: rank -> the text of its
    Python stacks (asyncio tasks and every thread), taken just before the ranks
    were killed. The message contains both.
    """

    def __init__(
        self, message: str, ranks: Sequence[int] = (), stacks: Mapping[int, str] | None = None
    ) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.stacks = dict(stacks or {})

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (str(self), self.ranks, self.stacks))
