"""CUDA availability checks and device-argument normalisation.

Nothing here touches CUDA at import time; the checks run only when a function that needs a GPU
is called.
"""

from __future__ import annotations

from typing import Callable, Union

import torch

__all__ = [
    "CudaUnavailable",
    "DeviceLike",
    "InvalidDevice",
    "cuda_available",
    "device_index",
    "require_cuda",
]

#: What the public functions accept as a CUDA device.
DeviceLike = Union[int, str, torch.device, None]


class CudaUnavailable(RuntimeError):
    """Raised by a ``streams`` function that needs CUDA when CUDA cannot be used.

    The message says what is missing (a CUDA build of torch, or a visible CUDA device) and how
    to fix it. Functions that do not need CUDA (:class:`streams.LoopWaker`,
    :class:`streams.EventWatcher` with non-CUDA events) never raise it.
    """


class InvalidDevice(ValueError, TypeError):
    """A device argument that names no visible CUDA device.

    A ``ValueError``; also a ``TypeError``, which a device of the wrong type raised before
    this one type existed (callers that catch either keep working). asynccoll raises it
    again as its ``InvalidArgument`` at the call.
    """


def cuda_available() -> bool:
    """Return True when torch was built with CUDA and at least one CUDA device is visible."""
    return bool(torch.backends.cuda.is_built() and torch.cuda.is_available())


def require_cuda(what: str) -> None:
    """Raise :class:`CudaUnavailable` naming ``what`` if CUDA cannot be used.

    Args:
        what: a short description of the operation that needs CUDA, used in the message.
    """
    if not torch.backends.cuda.is_built():
        raise CudaUnavailable(
            f"{what} needs CUDA, but this torch ({torch.__version__}) was built without CUDA "
            "support (torch.version.cuda is None). Install a CUDA build of torch, e.g. "
            "`pip install torch --index-url https://download.pytorch.org/whl/cu128`, "
            "or avoid CUDA tensors, streams and events on this machine."
        )
    if not torch.cuda.is_available():
        raise CudaUnavailable(
            f"{what} needs CUDA, but no CUDA device is visible to torch "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"torch.cuda.device_count() == {torch.cuda.device_count()}). Check that a GPU is "
            "present (`nvidia-smi`), that the NVIDIA driver matches this CUDA version, and that "
            "CUDA_VISIBLE_DEVICES does not hide every device."
        )


def device_index(
    device: DeviceLike,
    what: str = "this operation",
    *,
    count: int | None = None,
    current: Callable[[], int] | None = None,
) -> int:
    """Normalise ``device`` to a CUDA device index: the one parser of device arguments.

    Args:
        device: an ``int`` index, a string such as ``"cuda"`` or ``"cuda:1"``, a
            :class:`torch.device` of type ``cuda``, or ``None`` for the current device.
        what: used in error messages.
        count, current: how many devices are visible and which one is current. Given,
            nothing is asked of CUDA (the NCCL backend passes its own, which do not
            initialise CUDA on the event loop's thread); left out, CUDA must be usable.

    Raises:
        CudaUnavailable: CUDA cannot be used (``count`` left out).
        InvalidDevice: not a CUDA device, an unsupported type, or out of range.
    """
    index = _parse_index(device)
    if count is None:
        require_cuda(what)
        count = torch.cuda.device_count()
    if index is None:
        return (current or torch.cuda.current_device)()
    if index >= count:
        raise InvalidDevice(f"CUDA device index {index} is out of range: {count} device(s) visible")
    return index


def _parse_index(device: DeviceLike) -> int | None:
    """Parse ``device`` without touching CUDA; None means "the current device"."""
    if device is None:
        return None
    if isinstance(device, bool):
        raise InvalidDevice(f"expected a CUDA device, got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise InvalidDevice(f"CUDA device index must be >= 0, got {device}")
        return device
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as exc:
            raise InvalidDevice(f"expected a CUDA device, got {device!r}: {exc}") from exc
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise InvalidDevice(f"expected a CUDA device, got {device}")
        return device.index
    raise InvalidDevice(
        f"expected a CUDA device (int, 'cuda:N' or torch.device), got {type(device).__name__}"
    )
