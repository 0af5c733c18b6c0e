"""Building NCCL backends and communicators on the simulated GPU and NCCL."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import torch

from .device import open_gpu
from .gpu import SimGPU
from .nccl import SimNccl

if TYPE_CHECKING:
    from ..._bootstrap.build import Factories


class Rdv:
    """The rendezvous ``nccl.create`` needs: a shared store, rank, world size."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size

    def prefixed(self, prefix: str) -> Any:
        import torch.distributed as dist

        return dist.PrefixStore(prefix, self.store)


class SimCluster:
    """A simulated GPU + NCCL, and ways to build NCCL backends/communicators on it.

    Rank ``r`` uses ``cuda:r`` (mod ``devices``), as a torchrun worker with
    ``LOCAL_RANK=r`` would; :func:`run_threads` makes that device current on the
    rank's thread. The real ``CudaRuntime``, ``streams`` and ``NcclLib`` run on the
    doubles of ``torch.cuda``, ``cuda.bindings.driver`` and ``nccl.core``.
    """

    def __init__(
        self,
        *,
        inprogress_polls: int = 2,
        abort_drains: bool = True,
        sync_limit: float = 30.0,
        revoke: bool = True,
        grow: bool = True,
        devices: int = 4,
        hw_queues: int | None = None,
        capability: tuple[int, int] = (9, 0),
        stream_mem_ops: bool = True,
    ) -> None:
        self.gpu = SimGPU(
            devices=devices,
            hw_queues=hw_queues,
            capability=capability,
            sync_limit=sync_limit,
            abort_drains=abort_drains,
            stream_mem_ops=stream_mem_ops,
        )
        self.nccl = SimNccl(self.gpu, inprogress_polls=inprogress_polls, revoke=revoke, grow=grow)

    def lib(self) -> Any:
        """The real :class:`NcclLib` over the simulated ``nccl.core``."""
        from ..._backends.nccl import NcclLib

        return NcclLib(self.nccl.module)

    async def create(
        self, rdv: Any, prefix: str = "nccl/", timeout: float = 10.0, **kw: Any
    ) -> Any:
        """``asynccoll._backends.nccl.create`` on the simulator; rank ``r`` on ``cuda:r``."""
        from ..._backends import nccl

        device = kw.pop("device", rdv.rank % self.gpu.devices)
        return await nccl.create(rdv, prefix, device, timeout, lib=self.lib(), **kw)

    def backends(self, world_size: int, timeout: float = 10.0) -> list[Any]:
        """One NCCL backend per rank over a shared HashStore (built concurrently)."""
        import torch.distributed as dist

        store = dist.HashStore()
        backends = run_threads(
            world_size, lambda r: self.create(Rdv(store, r, world_size), timeout=timeout)
        )
        for r, backend in enumerate(backends):
            backend.bind(standalone_sink(r))
        return backends

    def run_comms(
        self,
        world_size: int,
        fn: Callable[[Any], Awaitable[Any]],
        *,
        backend: str = "nccl",
        timeout: float = 20.0,
        heartbeat: float | None = 0,
        loop: str = "asyncio",
    ) -> list[Any]:
        """``async with asynccoll.init(backend, ...) as comm: await fn(comm)`` on every rank.

        Ranks are threads with their own event loops; rendezvous through one HashStore;
        NCCL is built on this simulator (:meth:`factories`); heartbeats are off unless
        ``heartbeat`` (seconds, or None for ``init``'s default) says otherwise. ``loop``:
        ``"asyncio"``, ``"uvloop"`` or ``"trio"``.
        """
        import torch.distributed as dist

        from ..._bootstrap.init import init_with

        store = dist.HashStore()
        factories = self.factories()

        async def rank_main(r: int) -> Any:
            async with init_with(
                factories,
                backend,
                rank=r,
                world_size=world_size,
                store=store,
                timeout=timeout,
                heartbeat=heartbeat,
            ) as comm:
                return await fn(comm)

        return run_threads(world_size, rank_main, timeout=timeout * 3, loop=loop)

    def factories(self) -> Factories:
        """The bootstrap's backend factories (``_bootstrap.build.Factories``) with CUDA and
        nccl4py seen as present and NCCL built on this simulator; Gloo is the real one."""
        from ..._bootstrap.build import Factories, join_nccl

        async def nccl(rdv: Any, prefix: str, device: Any, timeout: float) -> Any:
            return await self.create(rdv, prefix + "nccl/", timeout)

        async def nccl_join(
            store: Any, rank: int, new_size: int, device: Any, timeout: float
        ) -> Any:
            return await join_nccl(store, rank, new_size, device, timeout, lib=self.lib())

        return Factories(nccl=nccl, nccl_join=nccl_join, nccl_missing=lambda: None)

    def close(self) -> None:
        self.gpu.close()

    def __enter__(self) -> SimCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def run_threads(
    n: int, fn: Callable[[int], Awaitable[Any]], timeout: float = 60.0, loop: str = "asyncio"
) -> list[Any]:
    """Run ``await fn(rank)`` for every rank, each on its own thread and event loop
    (``loop``: ``"asyncio"``, ``"uvloop"`` or ``"trio"``)."""
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def main(r: int) -> None:
        try:
            _select_device(r)
            results[r] = _run_on(loop, fn, r)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors[r] = exc

    threads = [
        threading.Thread(target=main, args=(r,), name=f"simrank{r}", daemon=True) for r in range(n)
    ]
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


def _run_on(loop: str, fn: Callable[[int], Awaitable[Any]], rank: int) -> Any:
    if loop == "trio":
        import trio

        return trio.run(fn, rank)
    if loop == "uvloop":
        import uvloop

        runner = uvloop.new_event_loop()
        try:
            return runner.run_until_complete(fn(rank))
        finally:
            runner.close()
    return asyncio.run(fn(rank))  # type: ignore[arg-type]


def _select_device(rank: int) -> None:
    """On a simulated GPU, rank ``r``'s thread works on ``cuda:r`` (mod the device count)."""
    try:
        gpu = open_gpu()
    except RuntimeError:
        return
    torch.cuda.set_device(rank % gpu.devices)


def standalone_sink(rank: int) -> Any:
    """A ledger for a backend used without a communicator (its outcomes settle the Works;
    a failure marks it aborted, as it would the communicator)."""
    from ..._base.deadlines import service
    from ..._core.ledger import Ledger

    return Ledger(rank, deadlines=service(), on_abort=lambda exc: None)
