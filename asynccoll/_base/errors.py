"""The exception family of the public contract.

Every error a user can see from asynccoll derives from :class:`AsyncCollError`, and
each subclasses the builtin it resembles, so ``except TimeoutError`` and
``except ValueError`` keep working for code that does not know asynccoll.

``CommClosed`` means *you* closed the communicator; ``CommAborted`` means something
broke it (an explicit ``abort()``, a deadline, a dead peer, a mismatch): every error
after which a communicator is aborted is a ``CommAborted``, so "this communicator is
dead" is one ``except`` clause.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence


class AsyncCollError(Exception):
    """Base class of every asynccoll error."""


class CommAborted(AsyncCollError, RuntimeError):
    """The communicator was aborted: it can no longer be used. Pending and later
    operations fail with this.

    ``__cause__`` holds what triggered the abort (a timeout, a peer failure, or
    nothing for an explicit ``abort()``). Every error after which the communicator
    is aborted is one: :class:`PeerFailure`, :class:`CollectiveTimeout`,
    :class:`CollectiveMismatch`. Raised by a call that builds a communicator
    (``init``, ``join``, ``split``, ``shrink``, ``grow``), it means that no new
    communicator was built (a timeout: the peers did not arrive); the one the call
    was made on, if any, keeps its own ``state``.
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


class CollectiveTimeout(CommAborted, TimeoutError):
    """An operation (or ``init``) did not complete within its deadline.

    ``seq`` and ``op`` identify the operation; both are ``None`` for ``init``. The
    communicator is aborted (a :class:`CommAborted`), and its other pending
    operations fail with a ``CommAborted`` caused by this one.
    """

    def __init__(self, message: str, seq: int | None = None, op: str | None = None) -> None:
        super().__init__(message)
        self.seq = seq
        self.op = op

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0] if self.args else "", self.seq, self.op))


class CollectiveMismatch(CommAborted):
    """Ranks issued different collectives at the same point (``check="fingerprint"``),
    or created a communicator with different options. The communicator is aborted (a
    :class:`CommAborted`); its other pending operations fail with a ``CommAborted``
    caused by this one.

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
        return (
            type(self),
            (self.args[0] if self.args else "", self.seq, self.details, self.fields),
        )


class CommClosed(AsyncCollError):
    """The communicator was closed with ``close()``; it cannot be used any more."""


class BackendUnavailable(AsyncCollError):
    """The requested backend cannot run here (missing CUDA, nccl4py, ...)."""


class InvalidArgument(AsyncCollError, ValueError):
    """Bad input to a call. Raised at the call; the communicator stays usable."""


class GradSyncError(InvalidArgument, RuntimeError):
    """:class:`~asynccoll.GradSync` was used in a way it cannot synchronise: a parameter
    received a gradient twice in one step (no ``await sync.wait()`` in between, outside
    ``no_sync()``), a gradient that is not dense, or ranks that did not all run the same
    ``join()`` loop. Raised by ``backward()`` (from GradSync's hook) or ``sync.wait()``;
    the GradSync and the communicator stay usable. An :class:`InvalidArgument` (the
    training loop must change), and a ``RuntimeError``, as torch DDP raises for the
    same misuse.
    """


#: The errors of one operation (its deadline, its fingerprint) that abort the
#: communicator: the communicator's own error (``comm.error``), and what its other
#: Works raise, is a plain ``CommAborted`` caused by them (:func:`is_abort_error`).
OP_FAILURES = (CollectiveTimeout, CollectiveMismatch)


def is_abort_error(error: BaseException | None) -> bool:
    """Whether ``error`` stands as a communicator's abort error as it is: a
    :class:`CommAborted` (a :class:`PeerFailure` too) other than one operation's own
    failure (:data:`OP_FAILURES`), which the abort error wraps."""
    return isinstance(error, CommAborted) and not isinstance(error, OP_FAILURES)


__all__ = [
    "AsyncCollError",
    "BackendUnavailable",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "CommAborted",
    "CommClosed",
    "GradSyncError",
    "InvalidArgument",
    "PeerFailure",
]
