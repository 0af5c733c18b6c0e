"""The exception family of the public contract.

Every error a user can see from asynccoll derives from :class:`AsyncCollError`, and
each subclasses the builtin it resembles, so ``except TimeoutError`` and
``except ValueError`` keep working for code that does not know asynccoll.

``CommClosed`` means *you* closed the communicator; ``CommAborted`` means something
broke it (an explicit ``abort()``, a deadline, a dead peer).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence


class AsyncCollError(Exception):
    """Base class of every asynccoll error."""


class CommAborted(AsyncCollError, RuntimeError):
    """The communicator was aborted; pending and later operations fail with this.

    ``__cause__`` holds what triggered the abort (a timeout, a peer failure, or
    nothing for an explicit ``abort()``).
    """


class PeerFailure(CommAborted):
    """A peer died or became unreachable.

    ``ranks`` lists the ranks known to have failed (empty when the backend could
    not tell which peer it was).
    """

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks: tuple[int, ...] = tuple(sorted(set(ranks)))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0] if self.args else "", self.ranks))


class CollectiveTimeout(AsyncCollError, TimeoutError):
    """An operation (or ``init``) did not complete within its deadline.

    ``seq`` and ``op`` identify the operation; both are ``None`` for ``init``.
    """

    def __init__(self, message: str, seq: int | None = None, op: str | None = None) -> None:
        super().__init__(message)
        self.seq = seq
        self.op = op

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0] if self.args else "", self.seq, self.op))


class CollectiveMismatch(AsyncCollError):
    """Ranks issued different collectives at the same point (``check="fingerprint"``).

    ``seq`` is this rank's sequence number of the operation; ``details`` maps each
    rank to what it issued there (``seq``, ``op``, ``dtype``, ``shape``, ``root``,
    ``reduce_op``; a coalesced batch lists ``members``); ``fields`` names the fields
    that differ.
    """

    def __init__(
        self,
        message: str,
        seq: int | None = None,
        details: Mapping[int, Any] | None = None,
        fields: Sequence[str] = (),
    ) -> None:
        super().__init__(message)
        self.seq = seq
        self.details: dict[int, Any] = dict(details or {})
        self.fields: tuple[str, ...] = tuple(fields)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0] if self.args else "", self.seq, self.details, self.fields))


class CommClosed(AsyncCollError):
    """The communicator was closed with ``close()``; it cannot be used any more."""


class BackendUnavailable(AsyncCollError):
    """The requested backend cannot run here (missing CUDA, nccl4py, ...)."""


class InvalidArgument(AsyncCollError, ValueError):
    """Bad input to a call. Raised at the call; the communicator stays usable."""


__all__ = [
    "AsyncCollError",
    "BackendUnavailable",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "CommAborted",
    "CommClosed",
    "InvalidArgument",
    "PeerFailure",
]
