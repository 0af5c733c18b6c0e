"""The NCCL backend's CUDA seam on the simulated GPU, and helpers that build backends on it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import torch

from .device import SimGPU, SimStream
from .nccl import SimNccl

if TYPE_CHECKING:
    from ..._bootstrap.build import Factories


class SimCudaRuntime:
    """``asynccoll._backends.nccl.CudaRuntime`` on a :class:`SimGPU` (same methods)."""

    def __init__(self, gpu: SimGPU, index: int = 0) -> None:
        import streams

        self.gpu = gpu
        self.index = index
        self.comm_stream = gpu.stream(f"comm{len(gpu._streams)}")
        # The real EventPool, creating simulated events.
        self.events = streams.EventPool(index, factory=gpu.event)
        self.gate = gpu.gate()
        self.closed: bool | None = None

    def sibling(self) -> SimCudaRuntime:
        return SimCudaRuntime(self.gpu, self.index)

    def bind_thread(self) -> None:
        """Nothing to bind: one simulated device."""

    def caller_stream(self, tensor: Any) -> SimStream:
        return self.gpu.current_stream()

    def target_stream(self, stream: Any) -> SimStream:
        if stream is None:
            return self.gpu.current_stream()
        if isinstance(stream, SimStream):
            return stream
        if isinstance(stream, int) and not isinstance(stream, bool):
            return self.gpu.stream_by_handle(stream)
        raise TypeError(f"not a simulated stream: {stream!r}")

    def handle(self, stream: SimStream) -> int:
        return int(stream.cuda_stream)

    def protect(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(self.comm_stream)  # type: ignore[arg-type]

    def on_comm_stream(self) -> Any:
        return self.gpu.use_stream(self.comm_stream)

    def scratch(self) -> torch.Tensor:
        return self.gpu.empty(1, stream=self.comm_stream)

    def gate_wait(self, stream: SimStream, n: int) -> None:
        self.gate.wait(stream, n)

    def gate_signal(self, n: int) -> None:
        self.gate.signal(self.comm_stream, n)

    def release_gate(self, n: int) -> None:
        self.gate.host_write(n + (1 << 30))

    def close(self, clean: bool) -> None:
        self.closed = clean


class Rdv:
    """The rendezvous ``nccl.create`` needs: a shared store, rank, world size."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size

    def prefixed(self, prefix: str) -> Any:
        import torch.distributed as dist

        return dist.PrefixStore(prefix, self.store)


class SimCluster:
    """A simulated GPU + NCCL, and ways to build NCCL backends/communicators on it."""

    def __init__(
        self, *, inprogress_polls: int = 2, abort_drains: bool = True, sync_limit: float = 30.0, revoke: bool = True,
    ) -> None:
        self.gpu = SimGPU(sync_limit=sync_limit, abort_drains=abort_drains)
        self.nccl = SimNccl(self.gpu, inprogress_polls=inprogress_polls, revoke=revoke)
        self.runtimes: list[SimCudaRuntime] = []

    def lib(self) -> Any:
        """The real :class:`NcclLib` over the simulated ``nccl.core``."""
        from ..._backends.nccl import NcclLib

        return NcclLib(self.nccl.module)

    def runtime(self, index: int = 0) -> SimCudaRuntime:
        rt = SimCudaRuntime(self.gpu, index)
        self.runtimes.append(rt)
        return rt

    async def create(self, rdv: Any, prefix: str = "nccl/", timeout: float = 10.0, **kw: Any) -> Any:
        """``asynccoll._backends.nccl.create`` wired to the simulator."""
        from ..._backends import nccl

        return await nccl.create(
            rdv, prefix, 0, timeout, lib=self.lib(), runtime_factory=self.runtime,
            device_count=lambda: 1, device_guard=lambda i: contextlib.nullcontext(), **kw,
        )

    def backends(self, world_size: int, timeout: float = 10.0) -> list[Any]:
        """One NCCL backend per rank over a shared HashStore (built concurrently)."""
        import torch.distributed as dist

        store = dist.HashStore()
        backends = run_threads(world_size, lambda r: self.create(Rdv(store, r, world_size), timeout=timeout))
        for r, backend in enumerate(backends):
            backend.bind(standalone_sink(r))
        return backends

    def run_comms(self, world_size: int, fn: Callable[[Any], Awaitable[Any]], *, backend: str = "nccl",
                  timeout: float = 20.0, heartbeat: float | None = 0) -> list[Any]:
        """``async with asynccoll.init(backend, ...) as comm: await fn(comm)`` on every rank.

        Ranks are threads with their own event loops; rendezvous through one HashStore;
        NCCL is built on this simulator (:meth:`factories`); heartbeats are off unless
        ``heartbeat`` (seconds, or None for ``init``'s default) says otherwise.
        """
        import torch.distributed as dist

        from ..._bootstrap.init import init_with

        store = dist.HashStore()
        factories = self.factories()

        async def rank_main(r: int) -> Any:
            async with init_with(factories, backend, rank=r, world_size=world_size, store=store, timeout=timeout,
                                 heartbeat=heartbeat) as comm:
                return await fn(comm)

        return run_threads(world_size, rank_main, timeout=timeout * 3)

    def factories(self) -> Factories:
        """The bootstrap's backend factories (``_bootstrap.build.Factories``) with CUDA and
        nccl4py seen as present and NCCL built on this simulator; Gloo is the real one."""
        from ..._bootstrap.build import Factories

        async def nccl(rdv: Any, prefix: str, device: Any, timeout: float) -> Any:
            return await self.create(rdv, prefix + "nccl/", timeout)

        return Factories(nccl=nccl, nccl_missing=lambda: None)

    def close(self) -> None:
        self.gpu.close()

    def __enter__(self) -> SimCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def run_threads(n: int, fn: Callable[[int], Awaitable[Any]], timeout: float = 60.0) -> list[Any]:
    """Run ``await fn(rank)`` for every rank, each on its own thread and event loop."""
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def main(r: int) -> None:
        try:
            results[r] = asyncio.run(fn(r))  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors[r] = exc

    threads = [threading.Thread(target=main, args=(r,), name=f"simrank{r}", daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"simulated ranks still running after {timeout} s")
    for exc in errors:
        if exc is not None:
            raise exc
    return results


def standalone_sink(rank: int) -> Any:
    """A ledger for a backend used without a communicator (its outcomes settle the Works;
    a failure marks it aborted, as it would the communicator)."""
    from ..._base.deadlines import service
    from ..._core.ledger import Ledger

    return Ledger(rank, deadlines=service(), on_abort=lambda exc: None)
