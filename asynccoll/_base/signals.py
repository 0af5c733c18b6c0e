"""``comm.abort()`` from a signal handler that interrupted asynccoll itself.

A Python signal handler (``signal.signal``) runs on the main thread between two
bytecodes of whatever that thread was running. When it interrupted asynccoll's
own code there (an op being issued holds the communicator's lock; a Work taking
a waiter holds its own), an abort run inside the handler would wait for a lock
that its own thread holds, for good. Seen: SIGUSR1 while a loop issues
all_reduces, its handler calling ``comm.abort()``, hung in the ledger's lock
within seconds. Such an abort runs on a thread of its own instead
(:func:`call`), which takes the locks as soon as the interrupted code lets
them go, once the handler has returned: microseconds later.

An abort from anywhere else (a task, a ``loop.add_signal_handler`` callback, a
watchdog thread, a handler that interrupted the user's own code or the loop's
``select()``) stays synchronous: it has returned once every pending Work failed.
(A handler that interrupted ``select()`` is why an abort on a loop's thread also
writes the loop's wake-up fd: ``Resources.aborted``.)
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
from types import CodeType
from typing import Any, Callable

# asynccoll's own files, and those of ``streams`` beside it (the same distribution);
# not the test kit's, which holds no lock of ours while it runs a rank's code.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = (_PACKAGE + os.sep, os.path.join(os.path.dirname(_PACKAGE), "streams") + os.sep)
_KIT = os.path.join(_PACKAGE, "testing") + os.sep


def call(fn: Callable[[Any], object], arg: Any) -> None:
    """``fn(arg)``, here; or on a short-lived thread of its own (it ends with the
    call) when this is a signal handler that interrupted asynccoll (above). Not a
    daemon: a handler that aborts and then exits (``sys.exit``) has the interpreter
    wait for the abort, which is bounded, instead of finalizing under it."""
    if interrupted_us():
        threading.Thread(target=fn, args=(arg,), name="asynccoll-abort").start()
    else:
        fn(arg)


def interrupted_us() -> bool:
    """True if the caller (the first frame outside asynccoll) runs inside a Python
    signal handler that interrupted asynccoll's (or streams') code on this thread.

    The handler's frame is found by its code among the handlers installed now;
    the frame below it is the interrupted one (CPython calls a handler from the
    frame it interrupts). Cheap when no frame of ours is below the caller, the
    usual case (an abort from a task or a thread): one walk of the stack.
    """
    if threading.current_thread() is not threading.main_thread():
        return False  # Python runs signal handlers on the main thread only
    frame: Any = sys._getframe(1)
    while frame is not None and _ours(frame):  # the call's own frames (``comm.abort``)
        frame = frame.f_back
    if not _ours_below(frame):
        return False
    handlers = _handler_codes()
    while frame is not None:
        if frame.f_code in handlers:
            return _ours_below(frame.f_back)
        frame = frame.f_back
    return False


def _ours(frame: Any) -> bool:
    name = frame.f_code.co_filename
    return name.startswith(_OURS) and not name.startswith(_KIT)


def _ours_below(frame: Any) -> bool:
    while frame is not None:
        if _ours(frame):
            return True
        frame = frame.f_back
    return False


def _handler_codes() -> set[CodeType]:
    """The code objects of the Python signal handlers installed now."""
    codes: set[CodeType] = set()
    for sig in signal.valid_signals():
        try:
            handler: Any = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        while isinstance(handler, functools.partial):
            handler = handler.func
        handler = getattr(handler, "__func__", handler)  # a bound method
        code = getattr(handler, "__code__", None)
        if code is None:  # an instance of a class with a __call__ method
            call = type(handler).__dict__.get("__call__")
            code = getattr(call, "__code__", None)
        if isinstance(code, CodeType):
            codes.add(code)
    return codes
