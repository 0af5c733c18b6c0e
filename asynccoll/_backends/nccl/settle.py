"""The only place the NCCL backend settles Works (one seam for the ledger's settle sink)."""

from __future__ import annotations

from typing import Any

from ..._core.errors import CollectiveTimeout, CommAborted, PeerFailure
from ..._core.work import Work


def _succeed(work: Work, value: Any = None) -> bool:
    """Settle ``work`` as a success; False if it was settled already."""
    return work._set_result(value)


def _fail(work: Work, exc: BaseException) -> bool:
    """Settle ``work`` as a failure; False if it was settled already."""
    return work._set_exception(exc)


def _copy(exc: BaseException, work: Work) -> BaseException:
    """A fresh exception like ``exc`` for another Work of the same launch."""
    new: BaseException
    if isinstance(exc, PeerFailure):
        new = PeerFailure(str(exc), exc.ranks)
    elif isinstance(exc, CollectiveTimeout):
        new = CollectiveTimeout(str(exc), seq=work.seq, op=work.op)
    elif isinstance(exc, CommAborted):
        new = CommAborted(str(exc))
    else:
        return exc
    new.__cause__ = exc.__cause__
    return new


def fail_all(works: Any, exc: BaseException) -> None:
    """Fail every Work of one launch, each with its own exception object."""
    for i, work in enumerate(works):
        _fail(work, exc if i == 0 else _copy(exc, work))
