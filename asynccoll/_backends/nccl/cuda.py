"""The CUDA side of the NCCL backend, behind one seam (the test kit substitutes a simulator).

Each :class:`CudaRuntime` (one per NCCL communicator) owns its own high-priority
comm stream: two communicators on one device never share a stream, so the order
of their kernels is never a race between their launcher threads.

``wait_stream`` needs a dependency that can be enqueued *before* the launcher
has issued the op (waiting on an event that is not recorded yet orders nothing in
CUDA). The runtime provides a *gate*: a 32-bit counter in mapped pinned memory.
The launcher enqueues ``cuStreamWriteValue32(gate, n)`` on the comm stream after
job ``n``'s NCCL kernels (or right away on the comm stream when job ``n`` fails),
and ``wait_stream`` enqueues ``cuStreamWaitValue32(gate >= n)`` on the target
stream, at once, from any thread. ``release_gate`` opens every wait from the host
after an abort (the Works have failed; nothing may stay blocked on the device).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch

_GATE_BYTES = 4
# CU_STREAM_WAIT_VALUE_GEQ is the cyclic comparison (int32)(*addr - value) >= 0.
_RELEASE_STEP = 1 << 30


class CudaRuntime:
    """Comm stream, event pool, caller streams (torch / CuPy) and the gate of one communicator."""

    def __init__(self, index: int) -> None:
        import streams

        self._streams = streams
        self.index = index
        # A StreamSet of its own: this communicator's stream, highest priority.
        self.comm_stream = streams.StreamSet().get(index)
        self.events = streams.EventPool(index)
        self._gate_lock = threading.Lock()
        self._gate_host = 0
        self._gate_dev = 0
        self._gate_last = 0

    def sibling(self) -> CudaRuntime:
        """A fresh runtime (own comm stream) on the same device, for a shrunk communicator."""
        return CudaRuntime(self.index)

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.index)

    def caller_stream(self, tensor: Any) -> Any:
        return self._streams.current_stream(self.index if tensor is None else tensor)

    def target_stream(self, stream: Any) -> Any:
        """The stream ``wait_stream(stream)`` should hold back (None: current)."""
        if stream is None:
            return torch.cuda.current_stream(self.index)
        if isinstance(stream, int) and not isinstance(stream, bool):
            return torch.cuda.ExternalStream(stream, device=self.index)
        return self._streams.current_stream(stream)

    def handle(self, stream: Any) -> int:
        return int(stream.cuda_stream)

    def protect(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(self.comm_stream)

    def on_comm_stream(self) -> Any:
        return torch.cuda.stream(self.comm_stream)

    def scratch(self) -> torch.Tensor:
        """A 1-element buffer owned by the comm stream (the barrier's all_reduce)."""
        with torch.cuda.stream(self.comm_stream):
            return torch.empty(1, dtype=torch.float32, device=torch.device("cuda", self.index))

    # ------------------------------------------------------------------ gate
    def _gate(self) -> int:
        from cuda.bindings import driver as cu

        with self._gate_lock:
            if self._gate_dev == 0:
                with torch.cuda.device(self.index):
                    torch.cuda.current_stream(self.index)  # the primary context is current
                    flags = int(cu.CU_MEMHOSTALLOC_DEVICEMAP) | int(cu.CU_MEMHOSTALLOC_PORTABLE)
                    err, host = cu.cuMemHostAlloc(_GATE_BYTES, flags)
                    _check(err, "cuMemHostAlloc")
                    ctypes.c_uint32.from_address(int(host)).value = 0
                    err, dev = cu.cuMemHostGetDevicePointer(host, 0)
                    _check(err, "cuMemHostGetDevicePointer")
                    self._gate_host, self._gate_dev = int(host), int(dev)
            return self._gate_dev

    def gate_wait(self, stream: Any, n: int) -> None:
        """Enqueue on ``stream``: wait until job ``n`` passed the comm stream. Never blocks."""
        from cuda.bindings import driver as cu

        dev = self._gate()
        with torch.cuda.device(self.index):
            (err,) = cu.cuStreamWaitValue32(
                int(stream.cuda_stream), dev, n & 0xFFFFFFFF,
                int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
            )
        _check(err, "cuStreamWaitValue32")

    def gate_signal(self, n: int) -> None:
        """Enqueue on the comm stream: job ``n`` is over (launcher thread only)."""
        from cuda.bindings import driver as cu

        dev = self._gate()
        (err,) = cu.cuStreamWriteValue32(
            int(self.comm_stream.cuda_stream), dev, n & 0xFFFFFFFF,
            int(cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT),
        )
        _check(err, "cuStreamWriteValue32")
        self._gate_last = n

    def release_gate(self, n: int) -> None:
        """Open every gate wait up to ``n`` from the host (after abort: the Works failed)."""
        with self._gate_lock:
            if self._gate_host:
                ctypes.c_uint32.from_address(self._gate_host).value = (n + _RELEASE_STEP) & 0xFFFFFFFF

    def close(self, clean: bool) -> None:
        """Free the gate memory, only when no stream can still wait on it (``clean``)."""
        from cuda.bindings import driver as cu

        with self._gate_lock:
            host, self._gate_host, self._gate_dev = self._gate_host, 0, 0
        if host and clean:
            cu.cuMemFreeHost(host)


def _check(err: Any, what: str) -> None:
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: CUDA error {int(err)} ({err})")
