"""``comm.split()`` on NCCL: one ``ncclCommSplit`` per rank of the parent (simulated GPU).

The NCCL below is :class:`asynccoll.testing.simgpu.SimNccl` (autospecs of nccl4py's
real ``Communicator``, with NCCL's split rules: see ``simgpu/comm.py``); everything
above it is real: ``asynccoll.init``, the Communicator, ``_bootstrap/split.py``,
``NcclBackend`` and its handle, ``NcclLib``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import asynccoll as ac
from asynccoll.testing.simgpu import SimCluster

pytestmark = pytest.mark.timeout(120)
WAIT = 20.0


def nccl_state(sim: SimCluster, comm: Any) -> Any:
    return sim.nccl.state(comm._backends["cuda"].handle.communicator)


async def _sum(sim: SimCluster, comm: Any, value: float) -> float:
    t = sim.gpu.tensor([value])
    await asyncio.wait_for(comm.all_reduce(t), WAIT)
    return float(sim.gpu.host(t).item())


def test_split_makes_one_ncclcommsplit_per_rank_and_no_fresh_init() -> None:
    with SimCluster() as sim:

        async def body(comm: Any) -> Any:
            parent = nccl_state(sim, comm)
            sub = await asyncio.wait_for(comm.split([[2, 0], [1]]), WAIT)
            assert sub is not None
            child = nccl_state(sim, sub)
            value = await _sum(sim, sub, comm.rank + 1.0)
            none = await asyncio.wait_for(comm.split([[0, 1]]), WAIT)  # rank 2 in none
            if none is not None:
                await none.close()
            out = (
                (sub.rank, sub.world_size, value),
                parent.mock.split.call_args_list,
                child.world.key[1],
                child.rank,
                await _sum(sim, comm, 1.0),
            )
            await sub.close()
            return out

        out = sim.run_comms(3, body)
        assert [o[0] for o in out] == [(1, 2, 4.0), (0, 1, 2.0), (0, 2, 4.0)]
        for r, (_, calls, kind, child_rank, parent_sum) in enumerate(out):
            assert kind == "split" and parent_sum == 3.0
            assert child_rank == [1, 0, 0][r]  # NCCL's rank in the child: the list order
            assert len(calls) == 2  # one ncclCommSplit per split, on every rank
            color, key, config = calls[0].args
            assert (color, key) == [(0, 1), (1, 0), (0, 0)][r] and config.blocking is False
            second = calls[1].args
            assert second[0] == (None if r == 2 else 0)  # NCCL_SPLIT_NOCOLOR for rank 2
        assert sim.nccl.module.Communicator.init.call_count == 3  # the parents only
        assert sim.nccl.live() == []
        assert sim.gpu.errors == []


def test_an_nccl_subgroup_outlives_its_parent_aborted() -> None:
    with SimCluster() as sim:

        async def body(comm: Any) -> Any:
            sub = await asyncio.wait_for(comm.split([[0, 1]]), WAIT)
            comm.abort("the test aborts the parent")
            value = await _sum(sim, sub, 1.0)
            with pytest.raises(ac.CommAborted):
                await asyncio.wait_for(comm.split([[0, 1]]), WAIT)
            await sub.close()
            return value

        assert sim.run_comms(2, body) == [2.0, 2.0]
        assert sim.gpu.errors == []


def test_simulated_split_follows_ncclcommsplit_rules() -> None:
    """The simulator itself: ranks of one color ordered by key then parent rank, a
    null communicator for no color, and the parent InProgress until every rank split."""
    with SimCluster() as sim:
        import nccl.bindings.nccl as nb

        results: list[Any] = []

        async def body(comm: Any) -> Any:
            parent = comm._backends["cuda"].handle.communicator
            color, key = [(0, 5), (0, 5), (None, 0), (0, 1)][comm.rank]
            child = parent.split(color, key, sim.nccl.module.NCCLConfig(blocking=False))
            st = sim.nccl.state(child)
            while int(parent.get_async_error()) == int(nb.Result.InProgress):
                await asyncio.sleep(0.001)
            results.append((comm.rank, st.valid, st.rank if st.valid else None))
            if st.valid:
                st.mock.destroy()
            return None

        sim.run_comms(4, body)
        assert sorted(results) == [(0, True, 1), (1, True, 2), (2, False, None), (3, True, 0)]
