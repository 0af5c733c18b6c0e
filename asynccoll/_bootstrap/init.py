"""``init()`` and ``wrap()``: the public entry points.

Nothing here blocks the event loop: creating or connecting to the store, and
building each backend (Gloo's full-mesh connect, NCCL's polled init), run on
executor threads, bounded by ``timeout``.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Generator

import torch
import torch.distributed as dist

from .._backends import gloo
from .._backends.torch_pg import TorchGroupBackend
from .._base.errors import InvalidArgument
from .._core import validate
from .._core.backend import ANY
from .._core.communicator import Communicator, exit_scope
from .._faults.shrink import shrink
from . import elastic
from .build import REAL, Factories, build_communicator


class _Init:
    """What ``init()`` and ``join()`` return: awaitable, and an async context manager that closes."""

    def __init__(
        self,
        kwargs: dict[str, Any],
        make: Callable[..., Awaitable[Communicator]] = build_communicator,
    ) -> None:
        self._kwargs = kwargs
        self._make = make
        self._comm: Communicator | None = None

    def __await__(self) -> Generator[Any, None, Communicator]:
        return self._make(**self._kwargs).__await__()

    async def __aenter__(self) -> Communicator:
        self._comm = await self._make(**self._kwargs)
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
    name: str | None = None,
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

    ``name``: makes the group joinable (elastic membership): a process started later
    calls :func:`join` with the same name and store, and the members admit it with
    ``comm.waiting()`` and ``comm.grow()``. ``shrink()`` and ``grow()`` keep the
    name. Without a name the group is private to the ranks that create it.
    """
    return _Init(
        dict(
            backend=backend,
            rank=rank,
            world_size=world_size,
            master_addr=master_addr,
            master_port=master_port,
            store=store,
            device=device,
            timeout=timeout,
            check=check,
            trace_dir=trace_dir,
            heartbeat=heartbeat,
            name=name,
        ),
        _init_named,
    )


async def _init_named(*, name: Any, **kwargs: Any) -> Communicator:
    group = None
    if name is not None:
        options = elastic.Options(
            backend=kwargs["backend"],
            timeout=validate.seconds(kwargs["timeout"], "timeout"),
            check=kwargs["check"],
            heartbeat=kwargs["heartbeat"],
            trace_dir=str(kwargs["trace_dir"]) if kwargs["trace_dir"] is not None else None,
            device=kwargs["device"],
            factories=kwargs.get("factories", REAL),
        )
        group = elastic.Group(elastic.check_name(name), options)
    return await build_communicator(**kwargs, group=group)


def join(
    backend: str = "auto",
    *,
    name: str,
    store: Any = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    device: Any = None,
    timeout: float = 60.0,
    trace_dir: Any = None,
) -> _Init:
    """Join the running group ``name``: ``comm = await join(...)`` or ``async with join(...) as comm``.

    For a process started after the group (a replacement, or to scale out). It
    reaches the group's store (``store=``, or ``master_addr``/``master_port``,
    default ``$MASTER_ADDR``/``$MASTER_PORT``; a joiner never hosts the store) and
    waits, without blocking the loop, until the members call ``comm.grow()``. Returns
    a communicator of the grown group, with the members' options (backend, timeout,
    check, heartbeat, trace_dir unless given) and ranks ``old_size .. new_size - 1``
    in arrival order. ``backend`` must be the group's (else ``InvalidArgument``).
    Not admitted within ``timeout`` seconds: ``CollectiveTimeout``. If a participant
    dies while the group grows, the joiner waits for the members' next grow.
    """
    return _Init(
        dict(
            backend=backend,
            store=store,
            master_addr=master_addr,
            master_port=master_port,
            name=name,
            device=device,
            timeout=timeout,
            trace_dir=trace_dir,
        ),
        elastic.join,
    )


def init_with(factories: Factories, backend: str = "auto", **kwargs: Any) -> _Init:
    """``init(backend, **kwargs)`` with the backends that ``factories`` make (also in every
    ``shrink()`` and ``grow()``): the seam for the test kit's simulated GPU and for benches."""
    opening = init(backend, **kwargs)
    opening._kwargs["factories"] = factories
    return opening


def join_with(factories: Factories, backend: str = "auto", **kwargs: Any) -> _Init:
    """``join(backend, **kwargs)`` with the backends that ``factories`` make (see :func:`init_with`)."""
    opening = join(backend, **kwargs)
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
        raise InvalidArgument(
            f"wrap() needs a torch.distributed.ProcessGroup, got {type(process_group).__name__}"
        )
    timeout = validate.seconds(timeout, "timeout")
    if store is not None and not isinstance(store, dist.Store):
        raise InvalidArgument(
            f"store must be a torch.distributed.Store, got {type(store).__name__}"
        )
    ws = process_group.size()
    name = process_group.name() if hasattr(process_group, "name") else "torch"
    # A Gloo group declares Gloo's capability table; any other kind leaves the checks to torch.
    kind, caps = ("gloo", gloo.CAPS) if name == "gloo" else ("torch", ANY)
    backend = TorchGroupBackend(
        process_group, name=kind, device_type=None, world_size=ws, timeout=timeout, caps=caps
    )
    return Communicator(
        rank=process_group.rank(),
        world_size=ws,
        backends={None: backend},
        backend_name=f"torch:{name}",
        device=torch.device("cpu"),
        store=store,
        timeout=timeout,
        shrink=shrink,  # which refuses: no build_shrunk for a group made elsewhere
    )
