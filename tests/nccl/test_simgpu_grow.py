"""Growing an NCCL communicator (``ncclCommGrow``, non-blocking, polled) at the backend level,
on the simulated GPU: the members agree through the store (``NcclBackend.grow_agreed``),
the newcomers join (``nccl.join_grown``); the simulator holds NCCL's grow rules (roles,
one unique id consumed per grow, rank numbering, the child filled when the parent's job
ends; ``asynccoll/testing/simgpu/comm.py``)."""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

import asynccoll as ac
from asynccoll._backends import nccl
from asynccoll._base.ops import OpKind, OpSpec
from asynccoll.testing.simgpu import SimCluster
from asynccoll.testing.simgpu.runtime import standalone_sink

pytestmark = pytest.mark.timeout(120)
WAIT = 20.0


def together(*fns: Callable[[], Any]) -> list[Any]:
    """Run each function on its own thread (on cuda:i for the i-th); results or exceptions."""
    out: list[Any] = [None] * len(fns)

    def main(i: int) -> None:
        torch.cuda.set_device(i)
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out[i] = exc

    threads = [threading.Thread(target=main, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT * 2)
    assert not any(t.is_alive() for t in threads), "a rank is still growing"
    return out


def all_reduce(bes: list[Any], sim: SimCluster) -> list[float]:
    ts = [sim.gpu.tensor([float(be.rank + 1)], device=be.device) for be in bes]
    works = []
    for be, t in zip(bes, ts):
        w = ac.Work("all_reduce", 1)
        be.submit(OpSpec(OpKind.ALL_REDUCE, t, timeout=WAIT), w)
        works.append(w)
    for w in works:
        w.wait(WAIT)
    return [sim.gpu.host(t).item() for t in ts]


def test_two_members_grow_to_three_with_ncclcommgrow() -> None:
    with SimCluster() as sim:
        lib = sim.lib()
        old = sim.backends(2)
        store = dist.HashStore()
        grown = together(
            lambda: old[0].grow_agreed(store, 3, WAIT),
            lambda: old[1].grow_agreed(store, 3, WAIT),
            lambda: nccl.join_grown(store, 2, 3, None, WAIT, lib=lib),
        )
        assert all(isinstance(be, nccl.NcclBackend) for be in grown), grown
        grown[2].bind(standalone_sink(2))
        assert [(be.rank, be.world_size, be.device.index) for be in grown] == [
            (0, 3, 0),
            (1, 3, 1),
            (2, 3, 2),
        ]
        states = [sim.nccl.state(be.handle.communicator) for be in grown]
        assert len({s.world.key for s in states}) == 1 and states[0].world.key[1] == "grow"
        assert sim.nccl.module.Communicator.init.call_count == 2  # no fresh init: one grow
        assert all_reduce(grown, sim) == [6.0, 6.0, 6.0]
        for be in old + grown:
            be.close()
        assert sim.nccl.live() == [] and sim.gpu.errors == []


def test_without_ncclcommgrow_everyone_is_told_to_init_afresh() -> None:
    with SimCluster(grow=False) as sim:
        old = sim.backends(2)
        store = dist.HashStore()
        out = together(
            lambda: old[0].grow_agreed(store, 3, WAIT),
            lambda: old[1].grow_agreed(store, 3, WAIT),
            lambda: nccl.join_grown(store, 2, 3, None, WAIT, lib=sim.lib()),
        )
        assert out == [None, None, None]
        for be in old:
            be.close()


def test_an_aborted_member_makes_the_grow_a_fresh_init() -> None:
    with SimCluster() as sim:
        old = sim.backends(2)
        old[1].abort()
        store = dist.HashStore()
        out = together(
            lambda: old[0].grow_agreed(store, 3, WAIT),
            lambda: old[1].grow_agreed(store, 3, WAIT),
            lambda: nccl.join_grown(store, 2, 3, None, WAIT, lib=sim.lib()),
        )
        assert out == [None, None, None]
        assert "get_unique_id" not in sim.nccl.state(old[0].handle.communicator).calls
        for be in old:
            be.close()


def test_a_joiner_that_never_comes_times_out_and_nobody_hangs() -> None:
    with SimCluster() as sim:
        old = sim.backends(2)
        store = dist.HashStore()
        out = together(
            lambda: old[0].grow_agreed(store, 3, 1.0),
            lambda: old[1].grow_agreed(store, 3, 1.0),
        )
        assert all(isinstance(e, ac.CollectiveTimeout) for e in out), out
        for be in old:  # a parent left in ncclInProgress by its grow job: only abort remains
            assert be.handle.state == "aborted" and not be.can_shrink
            be.close()
        assert sim.nccl.live() == [] and sim.gpu.errors == []


def test_grow_is_refused_when_it_cannot_grow() -> None:
    with SimCluster() as sim:
        (be,) = sim.backends(1)
        with pytest.raises(ac.InvalidArgument):
            be.grow(1, None)
        be.abort()
        assert not be.can_grow
        with pytest.raises(ac.CommAborted):
            be.grow_id()
        be.close()
