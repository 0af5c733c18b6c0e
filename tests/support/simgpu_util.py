"""What the simulated-GPU backend tests share: polling for a condition, submitting one op, the
NCCL communicator under a backend, closing backends."""

from __future__ import annotations

import threading
from typing import Any

import asynccoll as ac
from asynccoll._base.ops import OpKind, OpSpec

WAIT = 20.0


def until(pred: Any, timeout: float = WAIT) -> None:
    ev = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if pred():
            return
        ev.wait(0.01)
    raise AssertionError("condition not reached")


def submit(be: Any, kind: OpKind, t: Any, timeout: float = 30.0, **kw: Any) -> ac.Work:
    w = ac.Work(kind.value, 1)
    be.submit(OpSpec(kind, t, timeout=timeout, **kw), w)
    return w


def comm_of(be: Any) -> Any:
    """The (simulated) nccl4py communicator under an NCCL backend."""
    return be.handle.communicator


def close_all(*bes: Any) -> None:
    for be in bes:
        be.close()
