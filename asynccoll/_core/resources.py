"""What a communicator runs besides its ledger, and the one place that stops it.

A communicator starts these parts, and each of three paths must stop every one of
them: ``abort`` (any thread; bounded, never waiting for peers), ``close`` (off the
loop, once the pending ops settled) and garbage collection without ``close``
(``weakref.finalize``, also at interpreter exit). :class:`Resources` keeps the three
paths side by side and holds no reference to the communicator, so that the
communicator's finalizer can run them:

* the backends, bound to the ledger (their outcomes settle Works there);
* the liveness membership (``interfaces.Membership``): heartbeats, census, abort news;
* the object channel (store-based object collectives);
* the diagnosis (recorder, checker gate, trace files).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

from .._base.aio import run_in_thread, running_loop
from .._base.errors import CommAborted
from .backend import Backend
from .interfaces import DiagnosticHooks, Membership
from .ledger import Ledger
from .objects import ObjectChannel

#: How long forgetting a communicator's keys waits for its object channel's thread to
#: leave the store (a job in a poll ends within ~20 ms; one reading a key, at once).
_QUIESCE_OBJECTS = 5.0


def weak_callback(method: Callable[[Any], None]) -> Callable[[Any], None]:
    """``method`` called through a weak reference to its object: what background threads
    and the parts hold of a communicator (a dropped one must still be collected)."""
    ref = weakref.WeakMethod(method)

    def call(arg: Any) -> None:
        fn = ref()
        if fn is not None:
            fn(arg)

    return call


class Resources:
    """The backends, liveness, object channel and diagnosis of one communicator."""

    def __init__(
        self,
        ledger: Ledger,
        backends: dict[str | None, Backend],
        objects: ObjectChannel | None,
        diag: DiagnosticHooks,
        forget: Callable[..., None] | None = None,
    ) -> None:
        self.ledger = ledger
        self.backends = backends
        self.objects = objects
        self.diag = diag
        self.liveness: Membership | None = None
        #: ``forget(dead=(), keys=(), ops=())``: this rank is done with the communicator's store keys
        #: (the last to be deletes them); run once, by ``close()`` or ``retire()``.
        self._forget = forget
        self._forget_lock = threading.Lock()
        for backend in backends.values():
            backend.bind(ledger)

    def start_liveness(
        self, liveness: Membership, on_failure: Callable[[BaseException], None]
    ) -> Membership:
        """Start ``liveness`` (published by the creation); the backends name lost peers
        with its census from now on."""
        self.liveness = liveness
        pending = self.ledger.pending
        liveness.busy = lambda: bool(pending)
        for backend in self.backends.values():
            backend.census = liveness.census
        if (
            self.objects is not None
        ):  # a peer that dies meanwhile fails an object collective at once
            self.objects.watch = liveness.failure_among
        liveness.start(on_failure)
        return liveness

    def aborted(self, error: BaseException) -> None:
        """The ledger aborted (any thread): tell the peers, stop the transport, record it.

        The peers' news and the backends come first: a failure to write the
        diagnostics must never keep them waiting. What wakes another thread comes
        last, and on a thread that runs an asyncio loop (``abort()`` called on the
        loop) after the waiters this abort woke there (a callback queued behind
        them): a thread woken earlier takes the GIL whenever this one lets it go
        (in a backend's abort, at the loop's next select) and holds the waiters up.
        Those are the liveness service, which sends the news (recorded at once: if
        the loop never runs the callback, the service's next beat sends it, within
        the beat interval), and the deadline service (``close()`` and garbage
        collection release it too).
        """
        loop = running_loop()
        if self.liveness is not None:
            # Tell the peers (a no-op when the news came from a peer: that thread is done).
            self.liveness.publish_abort(error, wake=loop is None)
        try:
            self.diag.aborted(
                error
            )  # the flight record goes to trace_dir (before the checker closes)
        except Exception as exc:  # noqa: BLE001 - a diagnostic must never stop the abort
            threading.excepthook(
                threading.ExceptHookArgs((type(exc), exc, exc.__traceback__, None))
            )
        if self.objects is not None:
            self.objects.shutdown()
        for backend in self.backends.values():
            backend.abort()
        if loop is None:
            self.ledger.release()
        else:
            # Threadsafe, on the loop's own thread too: a signal handler may have
            # called abort() while the loop sat in select(), which call_soon does not
            # wake (the waiters' futures only call_soon): this also writes its wake-up fd.
            loop.call_soon_threadsafe(self._waiters_ran)

    def _waiters_ran(self) -> None:
        """After an abort on a loop, behind the waiters it woke: wake the other threads."""
        self.ledger.release()
        if self.liveness is not None:
            self.liveness.wake()

    async def close(self) -> None:
        """The communicator closed (every op settled): stop and release everything, off the loop."""
        liveness = self.liveness
        if liveness is not None:
            await run_in_thread(liveness.goodbye, None, name="asynccoll-close")
        if self.objects is not None:
            self.objects.shutdown()
        for backend in self.backends.values():
            await run_in_thread(backend.close, None, name="asynccoll-close")
        await run_in_thread(
            self.diag.closed, None, name="asynccoll-close"
        )  # the timeline to trace_dir
        await run_in_thread(self._forget_keys_at_close, None, name="asynccoll-close")

    def retire(self, dead: tuple[int, ...] = (), keys: tuple[str, ...] = ()) -> None:
        """``shrink()`` built the survivors' communicator: this (aborted) one is done with
        the store (blocking; off the loop). Its liveness says goodbye and its keys are
        forgotten now (``dead``, ``keys``: see ``forget``), not at a ``close()`` that may
        never come (``comm = await comm.shrink()`` drops it); ``close()`` then releases
        the rest and writes nothing."""
        if self.liveness is not None:
            self.liveness.goodbye()
        self._forget_keys(dead, keys)

    def _forget_keys_at_close(self) -> None:
        """``close()``: after an abort, the peers proven dead meanwhile that never said
        goodbye (``gone_silently``) count as out, as a shrink's census would have
        counted them: otherwise nobody deletes the keys of a communicator whose peer
        was killed while it was idle (a subgroup aborted because its parent failed)."""
        self._forget_keys(silent=self.ledger.error is not None)

    def _forget_keys(
        self, dead: tuple[int, ...] = (), keys: tuple[str, ...] = (), silent: bool = False
    ) -> None:
        with self._forget_lock:
            forget, self._forget = self._forget, None
        liveness = self.liveness
        if forget is not None and (
            liveness is None or liveness.failure() is None
        ):  # (a store still there)
            if silent and liveness is not None:
                dead = tuple(sorted({*dead, *liveness.gone_silently()}))
            objects = self.objects
            if objects is not None:  # its thread is out of the store before anyone deletes keys
                objects.shutdown(wait=_QUIESCE_OBJECTS)
            # After an abort, object collectives may have left keys (a clean close finished them all).
            ops = (
                objects.unreleased()
                if objects is not None and self.ledger.error is not None
                else ()
            )
            forget(dead, keys, ops)

    def collected(self) -> None:
        """The communicator was dropped without ``close()``: stop everything, never block.

        Runs from ``weakref.finalize`` (garbage collection or interpreter exit).
        Pending Works fail with ``CommAborted``.
        """
        ledger = self.ledger
        ledger.abort(CommAborted("the communicator was garbage-collected without close()"))
        ledger.release()
        if self.liveness is not None:
            self.liveness.stop()
        if self.objects is not None:
            self.objects.shutdown()
        for backend in self.backends.values():
            backend.release()
