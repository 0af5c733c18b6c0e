"""``init()`` and ``wrap()``: the public entry points (API.md §1).

Nothing here blocks the event loop: creating or connecting to the store, and
building each backend (Gloo's full-mesh connect, NCCL's polled init), run on
executor threads, bounded by ``timeout``.
"""

from __future__ import annotations

from typing import Any, Generator

import torch
import torch.distributed as dist

from .._backends import gloo
from .._backends.torch_pg import TorchGroupBackend
from .._base.errors import InvalidArgument
from .._core import validate
from .._core.backend import ANY
from .._core.communicator import Communicator, exit_scope
from .._faults.shrink import shrink
from .build import Factories, build_communicator


class _Init:
    """What ``init()`` returns: awaitable, and an async context manager that closes."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self._kwargs = kwargs
        self._comm: Communicator | None = None

    def __await__(self) -> Generator[Any, None, Communicator]:
        return build_communicator(**self._kwargs).__await__()

    async def __aenter__(self) -> Communicator:
        self._comm = await build_communicator(**self._kwargs)
        return self._comm

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._comm is not None:
            await exit_scope(self._comm, exc)


def init(
    backend: str = "auto",
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    store: Any = None,
    device: Any = None,
    timeout: float = 60.0,
    check: str | None = None,
    trace_dir: Any = None,
    heartbeat: float | None = None,
) -> _Init:
    """Create a communicator: ``comm = await init(...)`` or ``async with init(...) as comm``.

    ``rank``/``world_size``/``master_addr``/``master_port`` default to torchrun's
    environment; ``store`` rendezvous through an existing torch Store instead.
    ``backend``: ``"gloo"`` (CPU), ``"nccl"`` (CUDA via nccl4py) or ``"auto"`` (both,
    dispatching each op by its tensors' device). Peers that do not arrive within
    ``timeout`` seconds raise ``CollectiveTimeout``; nothing blocks the event loop.

    ``heartbeat`` (an asynccoll extension): seconds between liveness beats through
    the store. ``None`` (default): NCCL detects dead peers with 1 s beats; Gloo
    reports a dead peer's closed connection by itself, and an immediate census
    names the failed rank (the 0.25 s beats only back it up where no answer
    settles it). A number turns detection on for every backend (a peer silent
    for 3 beats, and then to a census, raises ``PeerFailure``); ``0`` turns
    heartbeats and the census off.
    """
    return _Init(
        dict(
            backend=backend, rank=rank, world_size=world_size, master_addr=master_addr,
            master_port=master_port, store=store, device=device, timeout=timeout,
            check=check, trace_dir=trace_dir, heartbeat=heartbeat,
        )
    )


def init_with(factories: Factories, backend: str = "auto", **kwargs: Any) -> _Init:
    """``init(backend, **kwargs)`` with the backends that ``factories`` make (also in every
    ``shrink()``): the seam for the test kit's simulated GPU and for benches."""
    opening = init(backend, **kwargs)
    opening._kwargs["factories"] = factories
    return opening


def wrap(process_group: Any, *, store: Any = None, timeout: float = 60.0) -> Communicator:
    """A Communicator over an existing ``torch.distributed.ProcessGroup`` (any backend).

    A backend object such as ``ProcessGroupGloo`` built directly is accepted too.

    Ops are dispatched to the group as they are; ``await`` follows the group's own
    futures (for NCCL groups that means stream-ordered completion, as in torch).
    Object collectives need ``store`` (any torch Store shared by the group's ranks).
    """
    from torch._C._distributed_c10d import Backend as _TorchBackend

    if not isinstance(process_group, (dist.ProcessGroup, _TorchBackend)):
        raise InvalidArgument(f"wrap() needs a torch.distributed.ProcessGroup, got {type(process_group).__name__}")
    timeout = validate.seconds(timeout, "timeout")
    if store is not None and not isinstance(store, dist.Store):
        raise InvalidArgument(f"store must be a torch.distributed.Store, got {type(store).__name__}")
    ws = process_group.size()
    name = process_group.name() if hasattr(process_group, "name") else "torch"
    # A Gloo group declares Gloo's capability table; any other kind leaves the checks to torch.
    kind, caps = ("gloo", gloo.CAPS) if name == "gloo" else ("torch", ANY)
    backend = TorchGroupBackend(process_group, name=kind, device_type=None, world_size=ws, timeout=timeout, caps=caps)
    return Communicator(
        rank=process_group.rank(),
        world_size=ws,
        backends={None: backend},
        backend_name=f"torch:{name}",
        device=torch.device("cpu"),
        store=store,
        timeout=timeout,
        recover=shrink,  # which refuses: no rebuild for a group made elsewhere
    )
