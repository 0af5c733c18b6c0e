"""The CUDA side of one NCCL communicator: its device, its own stream, its events.

Each :class:`CudaRuntime` (one per NCCL communicator) holds a comm stream of its
own (``streams.own_streams()``: created with ``cuStreamCreateWithPriority``, never
one of torch's 32 pooled streams, which FSDP and user code share), at the highest
priority, and a pool of completion events. Everything that needs the device is
done at creation (the barrier's scratch buffer, the compute capability), never
mid-traffic.

Ordering a caller's stream after an op (``work.wait_stream``) uses only what CUDA
sees: ``stream.wait_event(done)`` on the op's completion event, once the launcher
has recorded it. No device-side wait is ever enqueued before its producer: with one
hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``, more streams than queues, or an
implicit synchronisation) such a wait blocks the queue holding the kernel that
would release it (``cuStreamWaitValue32``: "not visible to CUDA"; the simulated GPU
proves the deadlock with ``hw_queues=1``).
"""

from __future__ import annotations

from typing import Any

import torch


class CudaRuntime:
    """Device, comm stream, event pool and caller streams (torch / CuPy) of one communicator.

    Created on a thread that may use the device (``create`` runs it under a device
    guard); the launcher, watcher and stop threads call :meth:`bind_thread` first.
    """

    def __init__(self, index: int) -> None:
        import streams

        self._streams = streams
        self.index = index
        self.device = torch.device("cuda", index)
        with torch.cuda.device(index):
            self.capability: tuple[int, int] = tuple(torch.cuda.get_device_capability(index))  # type: ignore[assignment]
            self.comm_stream = streams.own_streams().acquire(index)
            self.events = streams.EventPool(index)
            # The barrier's all_reduce buffer: allocated on the comm stream, now.
            with torch.cuda.stream(self.comm_stream):
                self.scratch = torch.empty(1, dtype=torch.float32, device=self.device)
        self._closed = False

    def sibling(self) -> CudaRuntime:
        """A fresh runtime (own comm stream) on the same device, for a shrunk or grown communicator."""
        return CudaRuntime(self.index)

    def bind_thread(self) -> None:
        """Make this device current on the calling thread (the CUDA runtime is per thread)."""
        torch.cuda.set_device(self.index)

    def current(self) -> bool:
        """Whether this device is the calling thread's current one."""
        return torch.cuda.current_device() == self.index

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

    def close(self, reuse: bool) -> None:
        """Give the comm stream back for reuse (``reuse``: nothing of this communicator can be
        left on it), or keep it out of circulation. Streams are never destroyed (see
        ``streams.OwnStreams``)."""
        if not self._closed:
            self._closed = True
            if reuse:
                self._streams.own_streams().release(self.comm_stream)
