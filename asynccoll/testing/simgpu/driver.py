"""Doubles of ``cuda.bindings.driver`` on a :class:`SimGPU`.

Installed while the SimGPU is open: the functions of the real module are replaced
by doubles bound to their signatures (``_double.strict``) that return the real
result types (``CUresult`` members, ``CUstream``, ``CUcontext``, ``CUdeviceptr``).

Rules, with their source (CUDA Driver API reference unless named):

* Every call but ``cuInit``/``cuDevice*`` needs a current context on the calling
  thread, else ``CUDA_ERROR_INVALID_CONTEXT`` ("Context Management": a thread has
  no current context until one is made current; ``cudaSetDevice`` makes the
  device's primary context current, CUDA 12.0 runtime notes; ``cuCtxSetCurrent``).
* ``cuStreamCreateWithPriority`` creates a stream of the current context's device,
  with the priority clamped to ``cuCtxGetStreamPriorityRange`` (0, -5).
* ``cuMemHostAlloc`` is implicitly synchronising: page-locked host allocations wait
  for the device's pending work (CUDA C Programming Guide, "Implicit
  Synchronization"); one made while streams have work pending is recorded in
  ``gpu.errors``.
* Stream memory operations (``cuStreamWaitValue32``/``WriteValue32``) return
  ``CUDA_ERROR_NOT_SUPPORTED`` on a device without them (``SimGPU(stream_mem_ops=
  False)``; ``CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1`` reports it). The wait is
  the cyclic ``(int32_t)(*addr - value) >= 0`` (``cuStreamWaitValue32``) and is
  invisible to CUDA's ordering: only the hardware queues of ``device.py`` decide.
"""

from __future__ import annotations

import ctypes
from typing import Any

from cuda.bindings import driver as cu

from ._double import strict
from .device import Device, Item

R = cu.CUresult
_PRIORITIES = (0, -5)  # (least, greatest), as an H100 reports them
A = cu.CUdevice_attribute


class Driver:
    """The ``cuda.bindings.driver`` doubles of one SimGPU."""

    def __init__(self, gpu: Device) -> None:
        self.gpu = gpu
        self._mem: dict[int, ctypes.Array[ctypes.c_char]] = {}  # pinned host allocations by address
        self._saved: list[tuple[str, Any]] = []
        self.retained: dict[int, int] = {}  # primary-context refcounts by device
        self.host_allocs: list[str] = []  # thread names of cuMemHostAlloc calls
        self.value_waits = 0  # cuStreamWaitValue32 calls (waits CUDA's ordering does not see)

    # ------------------------------------------------------------ helpers
    def _ctx(self) -> int | None:
        ctx: int | None = self.gpu.runtime.tls.ctx
        return ctx

    def _stream_state(self, stream: Any) -> Any:
        dev = self._ctx()
        return self.gpu.state_by_handle(int(stream), 0 if dev is None else dev)

    # ----------------------------------------------------------- functions
    def cuInit(self, Flags: Any) -> tuple[Any]:
        return (R.CUDA_SUCCESS,)

    def cuDeviceGet(self, ordinal: Any) -> tuple[Any, Any]:
        if not 0 <= int(ordinal) < self.gpu.devices:
            return (R.CUDA_ERROR_INVALID_DEVICE, None)
        return (R.CUDA_SUCCESS, cu.CUdevice(int(ordinal)))

    def cuDeviceGetAttribute(self, attrib: Any, dev: Any) -> tuple[Any, Any]:
        d = int(dev)
        if not 0 <= d < self.gpu.devices:
            return (R.CUDA_ERROR_INVALID_DEVICE, None)
        major, minor = self.gpu.capability[d]
        values = {
            A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: major,
            A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: minor,
            A.CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: 1,
            A.CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1: int(self.gpu.stream_mem_ops),
            A.CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED: 1,
        }
        if attrib not in values:
            raise NotImplementedError(f"cuDeviceGetAttribute({attrib!r}) is not simulated")
        return (R.CUDA_SUCCESS, values[attrib])

    def cuDevicePrimaryCtxRetain(self, dev: Any) -> tuple[Any, Any]:
        d = int(dev)
        self.retained[d] = self.retained.get(d, 0) + 1
        return (R.CUDA_SUCCESS, cu.CUcontext(0xC000 + d))

    def cuDevicePrimaryCtxRelease(self, dev: Any) -> tuple[Any]:
        d = int(dev)
        if self.retained.get(d, 0) <= 0:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        self.retained[d] -= 1
        return (R.CUDA_SUCCESS,)

    def cuCtxSetCurrent(self, ctx: Any) -> tuple[Any]:
        h = int(ctx) if ctx is not None else 0
        t = self.gpu.runtime.tls
        t.ctx = None if h == 0 else h - 0xC000
        return (R.CUDA_SUCCESS,)

    def cuCtxPushCurrent(self, ctx: Any) -> tuple[Any]:
        t = self.gpu.runtime.tls
        t.ctx_stack.append(t.ctx)
        return self.cuCtxSetCurrent(ctx)

    def cuCtxPopCurrent(self) -> tuple[Any, Any]:
        t = self.gpu.runtime.tls
        if not t.ctx_stack:
            return (R.CUDA_ERROR_INVALID_CONTEXT, None)
        cur = t.ctx
        t.ctx = t.ctx_stack.pop()
        return (R.CUDA_SUCCESS, cu.CUcontext(0 if cur is None else 0xC000 + cur))

    def cuCtxGetCurrent(self) -> tuple[Any, Any]:
        d = self._ctx()
        return (R.CUDA_SUCCESS, cu.CUcontext(0 if d is None else 0xC000 + d))

    def cuCtxGetStreamPriorityRange(self) -> tuple[Any, Any, Any]:
        if self._ctx() is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT, None, None)
        return (R.CUDA_SUCCESS, _PRIORITIES[0], _PRIORITIES[1])

    def cuStreamCreateWithPriority(self, flags: Any, priority: Any) -> tuple[Any, Any]:
        d = self._ctx()
        if d is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT, None)
        p = min(max(int(priority), _PRIORITIES[1]), _PRIORITIES[0])
        state = self.gpu.new_stream(d, p, "")
        state.name = f"own{d}.{state.handle:#x}"
        return (R.CUDA_SUCCESS, cu.CUstream(state.handle))

    def cuStreamDestroy(self, hStream: Any) -> tuple[Any]:
        if self._ctx() is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        try:
            state = self._stream_state(hStream)
        except ValueError:
            return (R.CUDA_ERROR_INVALID_HANDLE,)
        state.destroyed = (
            True  # pending work still completes ("released ... once the device has completed")
        )
        return (R.CUDA_SUCCESS,)

    def cuMemHostAlloc(self, bytesize: Any, Flags: Any) -> tuple[Any, Any]:
        d = self._ctx()
        if d is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT, None)
        import threading

        name = threading.current_thread().name
        self.host_allocs.append(name)
        gpu = self.gpu
        with gpu.cv:
            busy = [s.name for s in gpu.states() if s.device == d and s.q]
            if busy:
                gpu.errors.append(
                    f"cuMemHostAlloc on thread {name!r} synchronises implicitly while {busy} "
                    "have work pending (allocate pinned memory before traffic)"
                )
            gpu.cv.wait_for(
                lambda: not any(s.q for s in gpu.states() if s.device == d), gpu.sync_limit
            )
        buf = ctypes.create_string_buffer(int(bytesize))
        addr = ctypes.addressof(buf)
        self._mem[addr] = buf
        return (R.CUDA_SUCCESS, addr)

    def cuMemHostGetDevicePointer(self, p: Any, Flags: Any) -> tuple[Any, Any]:
        if self._ctx() is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT, None)
        if int(p) not in self._mem:
            return (R.CUDA_ERROR_INVALID_VALUE, None)
        return (R.CUDA_SUCCESS, cu.CUdeviceptr(int(p)))  # unified addressing: the same address

    def cuMemFreeHost(self, p: Any) -> tuple[Any]:
        if self._ctx() is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        if self._mem.pop(int(p), None) is None:
            return (R.CUDA_ERROR_INVALID_VALUE,)
        return (R.CUDA_SUCCESS,)

    def _word(self, addr: Any) -> ctypes.c_uint32 | None:
        a = int(addr)
        if not any(base <= a < base + len(buf) for base, buf in self._mem.items()):
            return None
        return ctypes.c_uint32.from_address(a)

    def _value_op(self, addr: Any) -> tuple[Any, ctypes.c_uint32 | None]:
        """The checks a stream memory operation makes before it is queued: an error, or its word."""
        if self._ctx() is None:
            return R.CUDA_ERROR_INVALID_CONTEXT, None
        if not self.gpu.stream_mem_ops:
            return R.CUDA_ERROR_NOT_SUPPORTED, None
        word = self._word(addr)
        return (R.CUDA_ERROR_INVALID_VALUE, None) if word is None else (R.CUDA_SUCCESS, word)

    def cuStreamWaitValue32(self, stream: Any, addr: Any, value: Any, flags: Any) -> tuple[Any]:
        err, word = self._value_op(addr)
        if word is None:
            return (err,)
        n = int(value) & 0xFFFFFFFF
        state = self._stream_state(stream)
        self.value_waits += 1
        with self.gpu.cv:
            self.gpu.push(
                state,
                Item("wait_value", ready=lambda: ((word.value - n) & 0xFFFFFFFF) < 0x80000000),
            )
        return (R.CUDA_SUCCESS,)

    def cuStreamWriteValue32(self, stream: Any, addr: Any, value: Any, flags: Any) -> tuple[Any]:
        err, word = self._value_op(addr)
        if word is None:
            return (err,)
        n = int(value) & 0xFFFFFFFF
        state = self._stream_state(stream)

        def write() -> None:
            word.value = n

        with self.gpu.cv:
            self.gpu.push(state, Item("write_value", write))
        return (R.CUDA_SUCCESS,)

    # -------------------------------------------------------------- patching
    _NAMES = (
        "cuInit",
        "cuDeviceGet",
        "cuDeviceGetAttribute",
        "cuDevicePrimaryCtxRetain",
        "cuDevicePrimaryCtxRelease",
        "cuCtxSetCurrent",
        "cuCtxPushCurrent",
        "cuCtxPopCurrent",
        "cuCtxGetCurrent",
        "cuCtxGetStreamPriorityRange",
        "cuStreamCreateWithPriority",
        "cuStreamDestroy",
        "cuMemHostAlloc",
        "cuMemHostGetDevicePointer",
        "cuMemFreeHost",
        "cuStreamWaitValue32",
        "cuStreamWriteValue32",
    )

    def install(self) -> None:
        for name in self._NAMES:
            real = getattr(cu, name)
            self._saved.append((name, real))
            setattr(cu, name, strict(real, getattr(self, name)))

    def uninstall(self) -> None:
        while self._saved:
            name, real = self._saved.pop()
            setattr(cu, name, real)
