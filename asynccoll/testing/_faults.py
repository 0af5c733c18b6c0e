"""Fault injection, called inside a rank: crash it, freeze it, make it skip collectives."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any, NoReturn

_HOW = ("exit", "sigkill", "sigterm")


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more can be written
            pass


def crash(how: str = "exit", code: int = 1) -> NoReturn:
    """End this process now, the way a real failure would.

    ``how="exit"``: ``os._exit(code)`` (no cleanup, no ``finally``);
    ``"sigkill"``: SIGKILL to itself; ``"sigterm"``: SIGTERM to itself with the
    default action restored first, so it terminates.
    """
    if how not in _HOW:
        raise ValueError(f"how must be one of {_HOW}, got {how!r}")
    _flush()
    pid = os.getpid()
    if how == "exit":
        os._exit(code)
    if how == "sigkill":
        os.kill(pid, signal.SIGKILL)
    else:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(pid, signal.SIGTERM)
    # Signals to oneself arrive at once; this is only reached if a handler that
    # could not be reset from this thread caught SIGTERM.
    time.sleep(2.0)
    os._exit(128 + signal.SIGTERM)


def crash_later(delay: float, how: str = "exit", code: int = 1) -> threading.Thread:
    """Crash this process from a daemon thread after ``delay`` seconds (see :func:`crash`).

    For "killed in the middle of a collective": call it, then issue the collective.
    """
    if how not in _HOW:
        raise ValueError(f"how must be one of {_HOW}, got {how!r}")

    def later() -> None:
        time.sleep(delay)
        crash(how, code)

    thread = threading.Thread(target=later, name="asynccoll-crash-later", daemon=True)
    thread.start()
    return thread


def freeze() -> None:
    """Stop this process (SIGSTOP to itself): alive, holding its sockets, doing nothing.

    ``run_ranks`` resumes it (SIGCONT) only to take its stacks on timeout or to kill it.
    """
    _flush()
    os.kill(os.getpid(), signal.SIGSTOP)


def skip_collective(comm: Any, n: int = 1) -> None:
    """Make the next ``n`` operations issued on ``comm`` skip the backend.

    They are settled as successes locally (their tensors untouched) and never reach
    the peers, which are left waiting on a collective this rank did not join. The
    flight record marks them ``"skipped"`` (so ``python -m asynccoll.diagnose``
    names this rank as the one that never took part). After ``n`` operations the
    backends are used again.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    backends = list(comm.backends.values())
    recorder = comm.ledger.recorder
    lock = threading.Lock()
    left = [n]
    saved: list[tuple[Any, bool, Any]] = []

    def restore() -> None:
        for backend, had_own, original in saved:
            if had_own:
                backend.submit = original
            else:
                try:
                    del backend.submit
                except AttributeError:
                    pass

    def wrap(backend: Any) -> Any:
        original = backend.submit

        def submit(spec: Any, work: Any) -> None:
            with lock:
                skip = left[0] > 0
                if skip:
                    left[0] -= 1
                    if left[0] == 0:
                        restore()
            if not skip:
                original(spec, work)
                return None
            # Recorded as skipped, not done (diagnose then names this rank), then settled
            # as a success here: the peers' op is left waiting.
            recorder.ended(
                work.seq, "skipped", time.time(), "skipped by asynccoll.testing.skip_collective"
            )
            backend.sink.succeed(work)
            return None

        return submit

    for backend in backends:
        saved.append((backend, "submit" in getattr(backend, "__dict__", {}), backend.submit))
    for backend in backends:
        backend.submit = wrap(backend)
