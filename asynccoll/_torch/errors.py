"""The contract's errors as torch.distributed users catch them.

An operation issued through the process group fails with asynccoll's own error
(``PeerFailure``, ``CollectiveTimeout``, ``CommAborted``, ...), raised as an instance of
a subclass that also derives from ``torch.distributed.DistBackendError`` (itself a
``DistError``, a ``RuntimeError``): what c10d raises when a backend fails. So
``except ac.PeerFailure`` (with ``.ranks``) and ``except dist.DistBackendError`` catch
the same exception. ``InvalidArgument`` (a ``ValueError``, raised at the call) and
``CommClosed`` are raised as they are.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .._base.errors import CollectiveMismatch, CollectiveTimeout, CommAborted, PeerFailure


class C10dCommAborted(CommAborted, dist.DistBackendError):
    """:class:`~asynccoll.CommAborted`, as raised through a torch process group."""


class C10dPeerFailure(PeerFailure, dist.DistBackendError):
    """:class:`~asynccoll.PeerFailure` (``.ranks``), as raised through a torch process group."""


class C10dCollectiveTimeout(CollectiveTimeout, dist.DistBackendError):
    """:class:`~asynccoll.CollectiveTimeout` (``.seq``, ``.op``), as raised through a
    torch process group (a ``TimeoutError`` too)."""


class C10dCollectiveMismatch(CollectiveMismatch, dist.DistBackendError):
    """:class:`~asynccoll.CollectiveMismatch`, as raised through a torch process group."""


# Most derived first: the first entry the error is an instance of decides.
_AS_C10D: tuple[tuple[type[CommAborted], type[CommAborted]], ...] = (
    (PeerFailure, C10dPeerFailure),
    (CollectiveTimeout, C10dCollectiveTimeout),
    (CollectiveMismatch, C10dCollectiveMismatch),
    (CommAborted, C10dCommAborted),
)


def as_c10d(error: BaseException) -> BaseException:
    """``error`` as c10d users catch it: a new error (same message, attributes, cause;
    no traceback) of the class above that matches it; anything else (``CommClosed``,
    ``InvalidArgument``) as it is."""
    if isinstance(error, dist.DistBackendError):
        return error
    for ours, theirs in _AS_C10D:
        if isinstance(error, ours):
            # The constructor's arguments, as the error pickles itself (every one
            # of the contract's errors defines them), then whatever else it carries.
            reduced: Any = error.__reduce__()
            copy: Any = theirs(*reduced[1])
            copy.__dict__.update(vars(error))
            copy.__cause__ = error.__cause__
            copy.__context__ = error.__context__
            copy.__suppress_context__ = error.__suppress_context__
            return copy  # type: ignore[no-any-return]
    return error
