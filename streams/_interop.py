"""The current stream of torch or CuPy, and CuPy / DLPack arrays as torch tensors."""

from __future__ import annotations

from typing import Any

import torch

from ._errors import device_index, require_cuda

__all__ = ["as_torch_tensor", "current_stream"]

# DLPack device types (dlpack.h, DLDeviceType) that denote CUDA memory.
_DL_CUDA = 2
_DL_CUDA_HOST = 3
_DL_CUDA_MANAGED = 13
_DL_CUDA_TYPES = (_DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED)


def current_stream(obj: Any = None) -> torch.cuda.Stream:
    """Return the stream that work on ``obj`` is currently ordered on.

    ``obj`` may be:

    * ``None``, an ``int``, ``"cuda:N"`` or a :class:`torch.device`: torch's current stream of
      that device (None: the current device);
    * a CUDA :class:`torch.Tensor`: torch's current stream of the tensor's device;
    * a :class:`torch.cuda.Stream`: returned unchanged;
    * an object with ``__cuda_stream__`` (a CuPy / ``cuda.core`` stream; returns
      ``(version, ptr)``): that stream, wrapped as :class:`torch.cuda.ExternalStream`;
    * a CuPy array or any object with ``__cuda_array_interface__`` or ``__dlpack_device__``:
      CuPy's current stream for the array's device when ``cupy`` is importable; otherwise the
      ``"stream"`` field of ``__cuda_array_interface__`` (v3) when present; otherwise torch's
      current stream of that device.

    The result is a :class:`torch.cuda.Stream` (or ``ExternalStream``), usable with
    ``event.record(stream)`` and ``stream.wait_event(event)``.

    Raises:
        CudaUnavailable: CUDA cannot be used.
        ValueError: ``obj`` lives in host memory.
        TypeError: ``obj`` has none of the forms above.
    """
    if obj is None or isinstance(obj, (int, str, torch.device)):
        return torch.cuda.current_stream(device_index(obj, "current_stream"))
    if isinstance(obj, torch.Tensor):
        device = obj.device
        if device.type != "cuda":
            raise ValueError(f"a tensor on {device} has no CUDA stream")
        return torch.cuda.current_stream(device)  # a CUDA tensor exists: CUDA is usable
    if _is_torch_stream(obj):
        stream: torch.cuda.Stream = obj
        return stream
    if hasattr(obj, "__cuda_stream__"):
        require_cuda("current_stream")
        ptr = _stream_ptr(obj)
        return torch.cuda.ExternalStream(ptr)
    if hasattr(obj, "__cuda_array_interface__") or hasattr(obj, "__dlpack_device__"):
        index = _array_device(obj)
        require_cuda("current_stream")
        return _array_stream(obj, index)
    raise TypeError(
        "current_stream() expects None, a CUDA device, a torch CUDA tensor, a stream with "
        "__cuda_stream__, or an array with __cuda_array_interface__ / __dlpack_device__; "
        f"got {type(obj).__name__}"
    )


def as_torch_tensor(obj: Any) -> torch.Tensor:
    """Return ``obj`` as a :class:`torch.Tensor` that shares its memory.

    Torch tensors are returned unchanged. Objects with ``__dlpack__`` (CuPy, NumPy, JAX, ...)
    go through :func:`torch.from_dlpack`, which also orders the producer's stream before
    torch's current stream; objects with only ``__cuda_array_interface__`` go through
    :func:`torch.as_tensor` (zero-copy).

    Raises:
        CudaUnavailable: ``obj`` is CUDA memory and CUDA cannot be used.
        TypeError: ``obj`` supports neither protocol.
    """
    if isinstance(obj, torch.Tensor):
        return obj
    if hasattr(obj, "__dlpack__"):
        if hasattr(obj, "__dlpack_device__") and _dlpack_device(obj)[0] in _DL_CUDA_TYPES:
            require_cuda("as_torch_tensor")
        return torch.from_dlpack(obj)
    if hasattr(obj, "__cuda_array_interface__"):
        require_cuda("as_torch_tensor")
        return torch.as_tensor(obj, device="cuda")
    raise TypeError(
        "as_torch_tensor() expects a torch.Tensor or an object with __dlpack__ or "
        f"__cuda_array_interface__; got {type(obj).__name__}"
    )


def _is_torch_stream(obj: Any) -> bool:
    """True for torch CUDA streams (checked without touching CUDA on CPU-only builds)."""
    return isinstance(obj, torch.cuda.Stream)


def _stream_ptr(obj: Any) -> int:
    """The raw ``cudaStream_t`` of an object implementing ``__cuda_stream__``."""
    proto = obj.__cuda_stream__
    if callable(proto):
        proto = proto()
    try:
        _version, ptr = proto
    except (TypeError, ValueError):
        raise TypeError(
            f"__cuda_stream__ of {type(obj).__name__} must give (version, ptr), got {proto!r}"
        ) from None
    return int(ptr)


def _dlpack_device(obj: Any) -> tuple[int, int]:
    device_type, device_id = obj.__dlpack_device__()
    return int(device_type), int(device_id)


def _array_device(obj: Any) -> int | None:
    """The CUDA device index of an array (None: unknown, use the current device)."""
    if hasattr(obj, "__dlpack_device__"):
        device_type, device_id = _dlpack_device(obj)
        if device_type not in _DL_CUDA_TYPES:
            raise ValueError(
                f"{type(obj).__name__} lives on DLPack device type {device_type}, not CUDA; "
                "it has no CUDA stream"
            )
        return device_id
    device = getattr(obj, "device", None)  # CuPy arrays: cupy.cuda.Device with .id
    dev_id = getattr(device, "id", None)
    return dev_id if isinstance(dev_id, int) else None


def _array_stream(obj: Any, index: int | None) -> torch.cuda.Stream:
    """The stream for a CUDA array on device ``index``: CuPy's, the interface's, or torch's."""
    if index is None:
        index = torch.cuda.current_device()
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None:
        with cupy.cuda.Device(index):
            ptr = int(cupy.cuda.get_current_stream().ptr)
        return _wrap_ptr(ptr, index)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if isinstance(cai, dict) and cai.get("stream") is not None:
        return _wrap_ptr(int(cai["stream"]), index)
    return torch.cuda.current_stream(index)


def _wrap_ptr(ptr: int, index: int) -> torch.cuda.Stream:
    """Wrap a raw stream pointer; 0 and 1 (legacy default stream) map to torch's default."""
    if ptr in (0, 1):
        return torch.cuda.default_stream(index)
    return torch.cuda.ExternalStream(ptr, device=index)
