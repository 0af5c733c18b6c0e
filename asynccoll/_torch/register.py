"""The ``"asynccoll"`` backend of ``torch.distributed``, and ``process_group(comm)``.

``register()`` (run by ``import asynccoll``) adds the name to torch's table of
backend plugins, for CPU and CUDA; ``dist.init_process_group("asynccoll")`` and
``dist.new_group(backend="asynccoll")`` then call :func:`create`, which builds a
communicator (``backend="auto"``: CPU tensors on Gloo, CUDA tensors on NCCL) through
the store, ranks and timeout that torch hands it.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, TypeVar

import torch.distributed as dist

from .._base.errors import InvalidArgument
from .._bootstrap.init import init
from .._core.communicator import Communicator
from .group import CommProcessGroup

NAME = "asynccoll"

T = TypeVar("T")


def process_group(comm: Communicator) -> CommProcessGroup:
    """A ``torch.distributed.ProcessGroup`` whose collectives run on ``comm``.

    Use it wherever torch takes a group: ``DistributedDataParallel(model,
    process_group=pg)``, ``DeviceMesh.from_group(pg, "cpu")``, ``dist.all_reduce(t,
    group=pg)``. Its ops share ``comm``'s issue order, deadlines, abort, flight record
    and fingerprint check; their c10d Works raise the contract's errors, which also
    derive from ``torch.distributed.DistBackendError``. The group does not own
    ``comm``: close the communicator yourself. After ``comm.shrink()`` or
    ``comm.grow()``, make a group of the new communicator.
    """
    if not isinstance(comm, Communicator):
        raise InvalidArgument(f"process_group() needs an asynccoll Communicator, got {comm!r}")
    return CommProcessGroup(comm)


def _blocking(awaitable: Awaitable[T]) -> T:
    """Run ``awaitable`` to completion from synchronous code, on a thread of its own
    (the caller may itself be running an event loop, as torch calls us synchronously)."""
    box: dict[str, Any] = {}

    async def main() -> None:
        box["value"] = await awaitable

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread below
            box["error"] = exc

    thread = threading.Thread(target=run, name="asynccoll-c10d-init")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def _close(comm: Communicator) -> None:
    _blocking(comm.close())


def create(options: Any, _backend_options: Any = None) -> CommProcessGroup:
    """torch's creator (``extended_api``): a communicator on the group's store and ranks."""
    comm = _blocking(
        init(
            "auto",
            store=options.store,
            rank=options.group_rank,
            world_size=options.group_size,
            timeout=options.timeout.total_seconds(),
        )
    )
    return CommProcessGroup(comm, close=_close)


def register() -> None:
    """Make ``"asynccoll"`` a torch.distributed backend name (idempotent)."""
    if NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(NAME, create, extended_api=True, devices=["cpu", "cuda"])
