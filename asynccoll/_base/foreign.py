"""The one boundary for foreign errors: torch.distributed's (Gloo, TCPStore) and
nccl4py's exceptions become the contract's (``errors.py``), the original kept as
``__cause__``.

An error is read by its type wherever its library gives one:

* nccl4py: ``NCCLError.status``, the ``ncclResult_t`` (:func:`status_of`,
  :data:`NCCL_CODES`);
* torch: ``DistStoreError`` (a store wait whose keys did not come in time),
  ``DistNetworkError`` (a store connection that failed);
* Python: ``TimeoutError``, ``ConnectionError``.

Where torch gives no finer type, the kind is read from the message, in
:data:`TORCH_TEXT` only: Gloo raises a plain ``RuntimeError`` for every transport
failure (a ``DistBackendError`` of a wrapped group says no more), and one
``DistNetworkError`` stands for a port in use, a refused or lost connection and a
connect that timed out (no errno attribute).

:func:`kind_of` and :func:`nccl_kind` say what an error means (:class:`Kind`); the
translators make the contract's exception for where it happened: an operation
(:func:`op_error`), the creation of a communicator (:func:`creation_error`), a
store's constructor (:func:`store_error`).
"""

from __future__ import annotations

import enum

import torch.distributed as dist

from .errors import (
    AsyncCollError,
    CollectiveTimeout,
    CommAborted,
    InvalidArgument,
    PeerFailure,
)


class Kind(enum.Enum):
    """What a foreign error means, beyond "it failed"."""

    PEER = "peer"  #: a peer's connection went away (or NCCL reported a peer's failure)
    TIMEOUT = "timeout"  #: something did not arrive or complete in time
    IN_USE = "in use"  #: a store server's port is taken


# ------------------------------------------------------------------- torch
#: Lower-case fragments of torch's messages, in the order they are checked: the one
#: place that reads message text. Read from torch 2.13.0 (CPU build), as it raised
#: them here: Gloo's ``transport/tcp/pair.cc`` "Connection closed by peer" and
#: ``unbound_buffer.cc`` "Timed out waiting ... for recv operation to complete";
#: c10d's TCPStore "... name: EADDRINUSE, message: address already in use", "The
#: client socket has timed out ...", "Broken pipe", "Connection refused"
#: (tests/base/test_foreign.py quotes each). A new torch: measure them again.
TORCH_TEXT: tuple[tuple[Kind, tuple[str, ...]], ...] = (
    (Kind.IN_USE, ("eaddrinuse", "address already in use")),
    (Kind.TIMEOUT, ("timed out", "timeout")),
    (
        Kind.PEER,
        (
            "connection closed",
            "connection reset",
            "broken pipe",
            "socket closed",
            "connection refused",
            "end of file",
        ),
    ),
)


def _by_text(exc: BaseException) -> Kind | None:
    low = str(exc).lower()
    for kind, fragments in TORCH_TEXT:
        if any(f in low for f in fragments):
            return kind
    return None


def kind_of(exc: BaseException) -> Kind | None:
    """What a torch/Gloo/TCPStore error means, or None (just a failure): by type where
    torch gives one, else by :data:`TORCH_TEXT`."""
    if isinstance(exc, TimeoutError):
        return Kind.TIMEOUT
    if isinstance(exc, ConnectionError):
        return Kind.PEER
    if isinstance(exc, dist.DistStoreError):
        return Kind.TIMEOUT  # torch 2.13 raises it for a wait whose keys did not come
    if isinstance(exc, dist.DistNetworkError):
        return _by_text(exc) or Kind.PEER  # a store connection that failed
    if isinstance(exc, RuntimeError):  # Gloo's plain RuntimeError, DistBackendError
        return _by_text(exc)
    return None


# ----------------------------------------------------------------- nccl4py
# ncclResult_t codes (nccl.h, a stable ABI; tests pin them to nccl4py's ``Result``)
# that mean more than "the communicator failed".
SYSTEM_ERROR = 2  #: ncclSystemError: a system call (a socket to a peer) failed
REMOTE_ERROR = 6  #: ncclRemoteError: a peer reported an error
TIMEOUT = 8  #: ncclTimeout: a bootstrap or init that did not complete
PEER_ERRORS = (SYSTEM_ERROR, REMOTE_ERROR)
#: What each of them means.
NCCL_CODES: dict[int, Kind] = {
    SYSTEM_ERROR: Kind.PEER,
    REMOTE_ERROR: Kind.PEER,
    TIMEOUT: Kind.TIMEOUT,
}


def status_of(exc: BaseException) -> int | None:
    """The ``ncclResult_t`` of an nccl4py exception, by type: ``NCCLError.status``
    (nccl.bindings.nccl), or None for anything else (``NcclInvalid``: nccl4py's own
    argument checks, before NCCL is called)."""
    status = getattr(exc, "status", None)
    return int(status) if isinstance(status, int) else None


def nccl_kind(error: BaseException | int) -> Kind | None:
    """What an nccl4py error (or an ``ncclResult_t``) means, or None: by its result
    code, and ``TimeoutError`` (a deadline of ours) by type. NCCL's messages are never read."""
    if isinstance(error, BaseException):
        if isinstance(error, TimeoutError):
            return Kind.TIMEOUT
        status = status_of(error)
        if status is None:
            return None
        error = status
    return NCCL_CODES.get(error)


# ------------------------------------------------------------- translators
def _caused(new: AsyncCollError, cause: BaseException) -> AsyncCollError:
    new.__cause__ = cause
    return new


def op_error(
    exc: BaseException,
    kind: Kind | None,
    *,
    backend: str,
    seq: int | None = None,
    op: str | None = None,
    message: str | None = None,
) -> CommAborted:
    """The contract's error for an operation that failed with ``exc`` in ``backend``:
    ``PeerFailure``, ``CollectiveTimeout`` or ``CommAborted`` (each aborts the
    communicator). ``message`` replaces the one made from ``seq``, ``op`` and ``exc``.
    A contract error that stands as an abort already is returned as it is.

    ``exc`` is kept as ``__cause__`` without its traceback: the error outlives the call
    (every failed Work and the aborted communicator hold it), and a traceback holds the
    frames it passed through and, through them, their callers': an op refused at issue
    on the caller's thread would keep that thread's stack alive, a training step and the
    model in it (a DDP whose hooks then fire beside the rebuilt one's)."""
    if isinstance(exc, CommAborted):
        return exc
    what = f"{op} (seq {seq})"
    new: CommAborted
    if kind is Kind.PEER:
        new = PeerFailure(message or f"{what}: a peer failed: {exc}")
    elif kind is Kind.TIMEOUT:
        new = CollectiveTimeout(message or f"{what} timed out in {backend}: {exc}", seq, op)
    else:
        new = CommAborted(message or f"{what} failed in {backend}: {exc}")
    new.__cause__ = exc.with_traceback(None)
    return new


def creation_error(
    exc: BaseException,
    kind: Kind | None,
    *,
    what: str,
    timeout: float | None = None,
    otherwise: type[AsyncCollError] = CommAborted,
) -> AsyncCollError:
    """The contract's error for ``what`` (the creation of a communicator: its store
    exchanges, an NCCL init, shrink or grow) that failed with ``exc``: the peers did
    not arrive (``CollectiveTimeout``; ``timeout``: the time they had, if known), one
    failed (``PeerFailure``), else ``otherwise``."""
    if kind is Kind.TIMEOUT:
        within = "in time" if timeout is None else f"within {timeout} s"
        return _caused(CollectiveTimeout(f"{what}: peers did not arrive {within}: {exc}"), exc)
    if kind is Kind.PEER:
        return _caused(
            PeerFailure(f"{what}: a peer failed while the communicator was created: {exc}"), exc
        )
    return _caused(otherwise(f"{what} failed: {exc}"), exc)


def store_error(exc: BaseException, addr: str, port: int, timeout: float) -> AsyncCollError:
    """A TCPStore constructor's error (``DistNetworkError``, ``DistStoreError``) as the
    contract's: a port in use or no store at the address is the caller's argument
    (``InvalidArgument``); a store that did not answer in time, ``CollectiveTimeout``."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    kind = kind_of(exc)
    new: AsyncCollError
    if kind is Kind.IN_USE:
        new = InvalidArgument(
            f"master_port {port} is already in use on this host (by another process): pick a free "
            f"port, or pass store= ({text})"
        )
    elif kind is Kind.TIMEOUT:
        new = CollectiveTimeout(
            f"store at {addr}:{port}: peers did not arrive within {timeout} s: {text}"
        )
    else:
        new = InvalidArgument(
            f"no asynccoll/torch store answers at {addr}:{port} (check master_addr and master_port): {text}"
        )
    return _caused(new, exc)
