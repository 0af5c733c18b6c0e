"""Leaving the interpreter while daemon threads of ours may sit in native code.

CPython (3.13 and older) ends a daemon thread that wakes up after finalization
has begun with ``pthread_exit``, which unwinds through the C++ frames the thread
returns into; a ``noexcept`` frame there (pybind11's GIL release around every
torch store call, Gloo's waits) turns that into ``std::terminate``: "terminate
called without an active exception", SIGABRT (measured here in 2 of 16 exits
of a rank whose peer had died, from the liveness thread returning from a store
call).

So, at exit:

* first (an ``atexit`` handler registered after the one that runs
  ``weakref.finalize`` callbacks, so it runs before them): :func:`exiting` turns
  true and the services registered with :func:`on_exit` stop their threads
  (they make no native call from then on, e.g. no store request);
* last (a finalizer older than any communicator's, so it runs after theirs):
  if a thread registered with :func:`register_native_thread` is still alive, it may be inside
  native code, and the process leaves with ``os._exit`` (streams flushed)
  instead of finalizing under it.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from typing import Callable

_lock = threading.Lock()
_native: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_stoppers: list[Callable[[], None]] = []
_exiting = threading.Event()


def exiting() -> bool:
    """True once the interpreter has begun to exit: start no thread, make no native call."""
    return _exiting.is_set()


def register_native_thread(thread: threading.Thread | None) -> None:
    """``thread`` may be inside native code (a torch call) when the interpreter exits.

    E.g. a waiter left in a Gloo wait by an aborted group (Gloo cannot interrupt an op in
    flight): if it is still alive at exit, the process leaves with ``os._exit``.
    """
    if thread is not None and thread.is_alive():
        with _lock:
            _native.add(thread)


def unregister_native_thread(thread: threading.Thread) -> None:
    """``thread`` is out of native code for good (or until it registers again)."""
    with _lock:
        _native.discard(thread)


def on_exit(stop: Callable[[], None]) -> None:
    """Call ``stop`` when the interpreter begins to exit (it ends the caller's threads)."""
    with _lock:
        _stoppers.append(stop)


def _first_word() -> None:
    _exiting.set()
    with _lock:
        stoppers = list(_stoppers)
    for stop in stoppers:
        stop()


def _last_word() -> None:
    _first_word()  # (anything a finalizer started meanwhile)
    with _lock:
        alive = [t for t in _native if t.is_alive() and t is not threading.current_thread()]
    if not alive:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more can be written
            pass
    last = getattr(sys, "last_value", None)
    os._exit(130 if isinstance(last, KeyboardInterrupt) else (1 if last is not None else 0))


class _Sentinel:
    """Lives as long as the interpreter: its finalizer runs at exit, after the others."""


_SENTINEL = _Sentinel()
weakref.finalize(_SENTINEL, _last_word)
atexit.register(_first_word)
