"""The one owner of an NCCL communicator handle.

:class:`CommHandle` holds the nccl4py ``Communicator``, the lock around every call
on it, and its state (ok, stopping, revoked, closed). It is the only code that
aborts, revokes, finalizes, shrinks or grows the communicator, behind a small
interface; the launcher calls into the communicator only through :meth:`use`.

nccl4py's ``abort()`` nulls the handle, so a call on another thread would use
freed state: every call takes :attr:`CommHandle` 's lock, and the stop path takes
it too (bounded: if a call hangs inside NCCL, ``ncclCommAbort`` is what unblocks
it, so abort goes ahead without the lock). Stopping runs on a thread the handle
owns (one at a time, joined by :meth:`close`), so :meth:`stop` stays bounded by
``abort_timeout`` however long NCCL takes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator, Sequence

from ..._base.errors import BackendUnavailable, CollectiveTimeout, CommAborted
from ..._base.foreign import creation_error, nccl_kind, op_error
from .lib import IN_PROGRESS, INTERNAL_ERROR, SUCCESS, NcclError, poll_async_error


def abort_quietly(comm: Any) -> None:
    """``comm.abort()``, for a communicator being thrown away after another error."""
    try:
        comm.abort()
    except Exception:  # noqa: BLE001, S110 - the original error is what gets reported; abort frees what it can
        pass


def last_error(comm: Any) -> str:
    """``ncclGetLastError``: the text of NCCL's last warning in this process ("" if none)."""
    try:
        return str(comm.get_last_error() or "").strip()
    except Exception:  # noqa: BLE001 - NcclInvalid on a freed handle: the status code alone is reported
        return ""


def wait_ready(
    comm: Any, lib: Any, deadline: float, what: str, cancel: threading.Event | None = None
) -> None:
    """Poll a new communicator until it leaves InProgress; abort it on failure."""
    delay = 1e-4
    while True:
        try:
            status = int(comm.get_async_error())
        except Exception as exc:  # NcclInvalid/NCCLError: the communicator is unusable
            abort_quietly(comm)
            raise creation_error(
                exc, nccl_kind(exc), what=what, otherwise=BackendUnavailable
            ) from exc
        if status == SUCCESS:
            return
        if status != IN_PROGRESS:
            last = last_error(
                comm
            )  # NCCL's own words (e.g. "Duplicate GPU detected"), before abort frees it
            abort_quietly(comm)
            text = lib.error_string(status)
            error = NcclError(status, f"{text}: {last}" if last else text)
            raise creation_error(
                error, nccl_kind(status), what=what, otherwise=BackendUnavailable
            ) from error
        if time.monotonic() > deadline or (cancel is not None and cancel.is_set()):
            abort_quietly(comm)
            raise CollectiveTimeout(f"{what}: peers did not arrive in time (still ncclInProgress)")
        time.sleep(delay)
        delay = min(delay * 2, 5e-3)


class CommHandle:
    """One nccl4py communicator: the handle, its lock, its state, and every change to it."""

    def __init__(
        self,
        comm: Any,
        lib: Any,
        *,
        rank: int,
        bind: Callable[[], None],
        abort_timeout: float = 2.0,
        close_timeout: float = 10.0,
        use_revoke: bool = True,
    ) -> None:
        self.lib = lib
        self.rank = rank
        self.abort_timeout = abort_timeout
        self.close_timeout = close_timeout
        self.use_revoke = use_revoke
        self._comm = comm
        self._bind = bind
        self._lock = threading.Lock()  # every NCCL call on the communicator
        self._flags = threading.Lock()  # the flags below
        self.stopping = False  # stop() was called: no new NCCL call starts
        self.revoked = False  # stopped by ncclCommRevoke: shrinkable until aborted
        self.closed = False
        self._stopper: threading.Thread | None = None
        self._stopped = threading.Event()
        self._stopped.set()

    def __repr__(self) -> str:
        return f"<CommHandle rank={self.rank} {self.state}>"

    @property
    def communicator(self) -> Any:
        """The nccl4py communicator (None once freed). Read-only, for diagnostics and tests:
        calls into it go through :meth:`use`."""
        return self._comm

    @property
    def calling(self) -> bool:
        """Whether a call into NCCL is in progress (the lock is held)."""
        return self._lock.locked()

    @property
    def state(self) -> str:
        if self.revoked and self._comm is not None:
            return "revoked"
        return "aborted" if self.stopping else "closed" if self.closed else "ok"

    # ----------------------------------------------------------------- calls
    @contextlib.contextmanager
    def use(self) -> Iterator[Any]:
        """The communicator, with the lock held; None once stopping (never call into it then)."""
        with self._lock:
            yield None if self.stopping else self._comm

    def poll(self, deadline: float) -> int | None:
        """Poll ``get_async_error`` until it leaves InProgress (or ``deadline``); None once stopping."""
        return poll_async_error(self._lock, lambda: None if self.stopping else self._comm, deadline)

    def status(self) -> int | None:
        """One ``get_async_error`` (None once stopping)."""
        with self._lock:
            comm = None if self.stopping else self._comm
            if comm is None:
                return None
            try:
                return int(comm.get_async_error())
            except Exception:  # noqa: BLE001 - NcclInvalid: the communicator is unusable
                return INTERNAL_ERROR

    def failure(self, status: int) -> CommAborted:
        """The contract's exception for an NCCL error code (``foreign.op_error``: a
        ``PeerFailure`` for a peer's)."""
        text = self.lib.error_string(status)
        with self._lock:
            comm = None if self.stopping else self._comm
            last = "" if comm is None else last_error(comm)
        msg = f"NCCL reported error {status} ({text}) on rank {self.rank}" + (
            f": {last}" if last else ""
        )
        return op_error(NcclError(status, text), nccl_kind(status), backend="NCCL", message=msg)

    # ------------------------------------------------------------------ stop
    def stop(self, *, revoke: bool | None = None, after: Callable[[], None] | None = None) -> None:
        """Stop every op: ``ncclCommRevoke`` (keeps it shrinkable) where NCCL has it and
        ``revoke`` (default: ``use_revoke``) allows, else ``ncclCommAbort``. Idempotent
        (the first call decides), bounded by ``abort_timeout``; ``after`` runs once the
        ops have stopped (on the stop thread, or here when there is nothing to stop)."""
        with self._flags:
            first = not self.stopping
            self.stopping = True
        if first:
            comm = self._comm
            if comm is None:
                if after is not None:
                    after()
                return
            rv = (self.use_revoke if revoke is None else revoke) and self.lib.can_revoke(comm)
            self._spawn(lambda: self._stop(rv), after)
        self._stopped.wait(self.abort_timeout)

    def _spawn(self, fn: Callable[[], None], after: Callable[[], None] | None) -> None:
        prev = self._stopper
        if prev is not None:
            prev.join(self.abort_timeout)
        done = self._stopped = threading.Event()

        def main() -> None:
            try:
                try:
                    self._bind()
                except Exception:  # noqa: BLE001, S110 - a bad device: NCCL's own cudaSetDevice still applies
                    pass
                fn()
            finally:
                if after is not None:
                    after()
                done.set()

        self._stopper = threading.Thread(
            target=main, name=f"asynccoll-nccl-stop-{self.rank}", daemon=True
        )
        self._stopper.start()

    def _stop(self, revoke: bool) -> None:
        deadline = time.monotonic() + self.abort_timeout / 2
        got = self._lock.acquire(timeout=self.abort_timeout / (4 if revoke else 2))
        try:
            comm = self._comm
            if revoke and got and comm is not None and self._revoke(comm, deadline):
                self.revoked = True
            else:
                comm, self._comm = self._comm, None
                if comm is not None:
                    abort_quietly(comm)
        finally:
            if got:
                self._lock.release()

    def _revoke(self, comm: Any, deadline: float) -> bool:
        """Revoke ``comm`` and poll until it is quiescent; False: not done by ``deadline``."""
        try:
            self.lib.revoke(comm)
        except Exception:  # noqa: BLE001 - NCCLError/NcclInvalid, or a libnccl without the symbol: abort instead
            return False
        delay = 1e-4
        while True:
            try:
                status = int(comm.get_async_error())
            except Exception:  # noqa: BLE001 - NcclInvalid: unusable, abort instead
                return False
            if status != IN_PROGRESS:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)

    def discard(self) -> None:
        """``ncclCommAbort`` a revoked communicator nobody will shrink (bounded, idempotent)."""
        self._stopped.wait(self.abort_timeout)  # a revoke still running
        if not self.revoked or self._comm is None:
            return
        self._spawn(lambda: self._stop(False), None)
        self._stopped.wait(self.abort_timeout)

    def close(self, *, broken: bool) -> bool:
        """Finalize (polled, bounded) and destroy, or abort after an error or a stop.

        True when the communicator ended cleanly and nothing of it can be left on the
        device (its stream may be reused)."""
        with self._flags:
            if self.closed:
                return False
            self.closed = True
        if self.stopping:
            self.discard()  # finalize after revoke is invalid: abort it
            return self._joined()
        comm = self._comm
        if comm is None:
            return True
        if not broken and self._finalize(comm):
            return True
        self.stop(revoke=False)
        return self._joined()

    def _joined(self) -> bool:
        t = self._stopper
        if t is not None:
            t.join(self.abort_timeout)
        return self._comm is None and self._stopped.is_set()

    def _finalize(self, comm: Any) -> bool:
        try:
            with self._lock:
                comm.finalize()
            if self.poll(time.monotonic() + self.close_timeout) != SUCCESS:
                return False
            with self._lock:
                self._comm = None
                comm.destroy()
            return True
        except Exception:  # noqa: BLE001 - NCCLError from finalize/destroy: fall back to abort
            return False

    # -------------------------------------------------------- shrink, grow
    @property
    def can_shrink(self) -> bool:
        """Whether ``ncclCommShrink`` can run: alive (healthy, or revoked by a stop) and not
        closed. Waits (bounded) for a revoke still running."""
        self._stopped.wait(self.abort_timeout)
        return not self.closed and self._comm is not None and (not self.stopping or self.revoked)

    @property
    def can_grow(self) -> bool:
        """Whether ``ncclCommGrow`` can run: healthy, and NCCL has it."""
        comm = self._comm
        return not (self.closed or self.stopping) and comm is not None and self.lib.can_grow(comm)

    def shrink(self, drop: Sequence[int], abort_pending: bool, deadline: float) -> Any:
        """The ready child of ``ncclCommShrink`` without ``drop`` (blocking, bounded)."""
        with self._lock:
            parent = self._comm
            if parent is None or self.closed or (self.stopping and not self.revoked):
                raise CommAborted(
                    "the NCCL communicator was aborted; create a new one instead of shrinking"
                )
            child = self.lib.shrink(parent, list(drop), abort_pending)
        self._child_ready(parent, child, deadline, "NCCL shrink")
        if self.revoked:  # a revoked parent shares nothing with the child: free it now
            with self._lock:
                old, self._comm = self._comm, None
            if old is not None:
                abort_quietly(old)
        return child

    def split(self, color: int | None, key: int, deadline: float) -> Any:
        """The ready child of ``ncclCommSplit`` (blocking, bounded); None for ``color`` None
        (NCCL_SPLIT_NOCOLOR: no child, but the parent's split job must still end)."""
        with self._lock:
            parent = None if self.stopping or self.closed else self._comm
            if parent is None:
                raise CommAborted("the NCCL communicator was aborted; it cannot split")
            child = self.lib.split(parent, color, key)
        self._child_ready(parent, None if color is None else child, deadline, "NCCL split")
        return None if color is None else child

    def grow_id(self) -> bytes:
        """``ncclCommGetUniqueId`` (the grow root only)."""
        with self._lock:
            comm = None if self.stopping else self._comm
            if comm is None:
                raise CommAborted("the NCCL communicator was aborted; it cannot grow")
            return bytes(self.lib.grow_id(comm))

    def grow(self, nranks: int, uid: bytes | None, deadline: float) -> Any:
        """The ready child of ``ncclCommGrow`` to ``nranks`` (``uid``: the root's id)."""
        with self._lock:
            parent = None if self.stopping else self._comm
            if parent is None:
                raise CommAborted("the NCCL communicator was aborted; it cannot grow")
            child = self.lib.grow(parent, nranks, uid)
        self._child_ready(parent, child, deadline, "NCCL grow")
        return child

    def _child_ready(self, parent: Any, child: Any, deadline: float, what: str) -> None:
        """A non-blocking shrink/grow/split: the parent's job must end (its state leaves
        InProgress; only then is the child's handle filled), then the child (None: a split
        that made none here) must reach Success."""
        status = poll_async_error(
            self._lock,
            lambda: (
                parent
                if self._comm is parent and not (self.stopping and not self.revoked)
                else None
            ),
            deadline,
        )
        if status is None:
            if child is not None:
                abort_quietly(child)
            raise CommAborted(f"{what}: the communicator was aborted meanwhile")
        if status == IN_PROGRESS:
            if child is not None:
                abort_quietly(child)
            raise CollectiveTimeout(f"{what}: peers did not arrive in time (still ncclInProgress)")
        if status != SUCCESS:
            if child is not None:
                abort_quietly(child)
            raise self.failure(status)
        if child is not None:
            wait_ready(child, self.lib, deadline, what)
