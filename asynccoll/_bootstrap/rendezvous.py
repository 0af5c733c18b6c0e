"""Where a communicator's ranks meet: the store, and a prefix unique to the communicator."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch.distributed as dist

from .._backends.common import kind_of
from .._base.aio import run_in_thread
from .._base.errors import AsyncCollError, CollectiveTimeout, CommAborted, InvalidArgument, PeerFailure
from .args import env_int
from .stores import tcp_store


class Rendezvous:
    """Where a communicator's ranks meet: a store, and a prefix unique to this communicator.

    ``key``: the ``(master_addr, master_port)`` of a store from the process's cache
    (this rendezvous holds one reference to it), or None for a store given by the user.
    """

    def __init__(self, store: Any, rank: int, world_size: int, key: tuple[str, int] | None = None) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.key = key

    def prefixed(self, prefix: str) -> Any:
        return dist.PrefixStore(prefix, self.store)


async def off_loop(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """Run blocking ``fn`` on an executor thread; ``CollectiveTimeout`` after ``timeout``."""
    try:
        return await run_in_thread(fn, timeout)
    except AsyncCollError:
        raise
    except TimeoutError:
        raise CollectiveTimeout(f"{what}: peers did not arrive within {timeout} s") from None
    except RuntimeError as exc:  # torch gives no finer type for these (torch 2.13)
        kind = kind_of(exc)
        if kind == "timeout":
            raise CollectiveTimeout(f"{what}: peers did not arrive within {timeout} s: {exc}") from exc
        if kind == "peer":
            raise PeerFailure(f"{what}: a peer failed while the communicator was created: {exc}") from exc
        raise CommAborted(f"{what} failed: {exc}") from exc


async def rendezvous(
    *,
    rank: int | None,
    world_size: int | None,
    master_addr: str | None,
    master_port: int | None,
    store: Any,
    timeout: float,
) -> Rendezvous:
    """Resolve the torchrun environment and meet the other ranks' store.

    Without ``store=``, the store for ``master_addr:master_port`` is the process's
    shared one (``STORES``): the returned rendezvous holds one reference to it.
    """
    world_size = env_int(world_size, "WORLD_SIZE", "world_size", 1)
    rank = env_int(rank, "RANK", "rank", 0)
    if rank >= world_size:
        raise InvalidArgument(f"rank {rank} is out of range for world_size {world_size}")
    if store is not None:
        return Rendezvous(store, rank, world_size)
    master_addr = master_addr or os.environ.get("MASTER_ADDR")
    if not master_addr or (master_port is None and os.environ.get("MASTER_PORT") is None):
        raise InvalidArgument(
            "no store: pass store=, or master_addr/master_port (or set $MASTER_ADDR/$MASTER_PORT)"
        )
    port = env_int(master_port, "MASTER_PORT", "master_port", 1, 65535)
    tcp, key = await tcp_store(master_addr, port, rank, world_size, timeout)
    return Rendezvous(tcp, rank, world_size, key)


async def comm_prefix(rdv: Rendezvous, timeout: float) -> str:
    # The n-th communicator a rank creates on a store pairs with every other rank's
    # n-th one (creation order must match across ranks, as in torch and NCCL).
    key = f"asynccoll/count/{rdv.rank}"
    n = await off_loop(lambda: rdv.store.add(key, 1), timeout, "store")
    return f"asynccoll/{n}/"


