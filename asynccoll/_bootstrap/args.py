"""Type and range checks of ``init()``'s own arguments, and torchrun's environment."""

from __future__ import annotations

import operator
import os
from typing import Any

import torch
import torch.distributed as dist

from .._base.errors import InvalidArgument
from .._core import validate

_BACKENDS = ("auto", "gloo", "nccl")


def _int(value: Any, what: str, low: int, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]``, or ``InvalidArgument`` saying what to pass."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{what} must be an int, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidArgument(
            f"{what} must be an int, got {value!r} ({type(value).__name__})"
        ) from None
    if number < low or (high is not None and number > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidArgument(f"{what} must be {bound}, got {number}")
    return number


def env_int(value: Any, var: str, what: str, low: int, high: int | None = None) -> int:
    if value is not None:
        return _int(value, what, low, high)
    raw = os.environ.get(var)
    if raw is None:
        raise InvalidArgument(
            f"{what} not given and ${var} is not set (launch with torchrun or pass {what}=)"
        )
    try:
        number = int(raw)
    except ValueError:
        raise InvalidArgument(f"${var}={raw!r} is not an integer") from None
    return _int(number, f"${var}", low, high)


def check_args(
    backend: Any, store: Any, master_addr: Any, device: Any, timeout: Any, heartbeat: Any
) -> float:
    """Type and range checks of ``init``'s own arguments; returns the timeout as a float."""
    if not isinstance(backend, str) or backend not in _BACKENDS:
        raise InvalidArgument(f"backend must be one of {_BACKENDS}, got {backend!r}")
    timeout = validate.seconds(timeout, "timeout")
    if heartbeat is not None:
        validate.seconds(heartbeat, "heartbeat", allow_zero=True)
    if store is not None and not isinstance(store, dist.Store):
        raise InvalidArgument(
            f"store must be a torch.distributed.Store (TCPStore, FileStore...), got {type(store).__name__}"
        )
    if master_addr is not None and (not isinstance(master_addr, str) or not master_addr):
        raise InvalidArgument(
            f"master_addr must be a host name or IP address (str), got {master_addr!r}"
        )
    if device is not None:
        if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
            raise InvalidArgument(
                f"device must be None, an int, a str or a torch.device, got {device!r}"
            )
        try:
            torch.device(device)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"device={device!r} is not a device: {exc}") from None
    return float(timeout)
