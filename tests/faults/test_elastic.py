"""Elastic membership (API.md §5) on real processes: ``ac.join``, ``waiting()``, ``grow()``,
``broadcast_state``; deaths and freezes inside a grow and inside a state transfer; the
store CLI. The end-to-end torchrun recipe is ``tests/project/test_examples.py``'s elastic test.

No timing assertions beyond generous bounds that tell detection from a deadline; how
fast is measured in ``bench/elastic.py``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

import tests.support.elastic_ranks as er
from asynccoll.testing import run_ranks


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_members_admit_a_joiner_and_share_state(loop: str) -> None:
    results = run_ranks(
        er.members_wait_then_grow, world_size=3, backend=None, timeout=60, args=(2,), loop=loop
    )
    for r, res in enumerate(results):
        assert res["rank"] == r and res["size"] == 3 and res["name"] == "g", (
            res
        )  # old ranks keep their numbers
        assert res["sum"] == [6.0] * 3, res
        assert res["w"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and res["step"] == 7, res


def test_two_joiners_get_ranks_in_arrival_order() -> None:
    results = run_ranks(
        er.members_wait_then_grow, world_size=4, backend=None, timeout=60, args=(2,)
    )
    assert sorted(res["rank"] for res in results) == [0, 1, 2, 3]
    assert [res["rank"] for res in results[:2]] == [0, 1]
    assert all(res["size"] == 4 and res["sum"] == [10.0] * 3 for res in results), results


def test_a_grow_deletes_its_keys_once_every_participant_is_done() -> None:
    """The plan, outcome, ``built`` marks, the watch's keys and the joiners' ticket records
    go once the grow is over; only the tickets' ``admit`` marks stay (the room's scan
    reads them). Before, each grow left about 24 keys in the store for good."""
    results = run_ranks(
        er.grow_then_look_at_keys, world_size=3, backend=None, timeout=60, args=(2,)
    )
    for res in results:
        assert res["checked"] >= 12 and res["left"] == [], res
        assert res["admits"] == [True], res


def test_joiner_that_dies_in_grow_is_named_and_the_members_carry_on() -> None:
    results = run_ranks(er.joiner_dies_in_grow, world_size=3, backend=None, timeout=60, lost=(2,))
    for r in (0, 1):
        res = results[r]
        assert res["type"] == "PeerFailure" and res["ranks"] == [2], (
            res
        )  # numbered as in the grown group
        assert res["after"] < 10, res  # detected, not the 30 s deadline
        assert res["old_state"] == "ok" and res["old_sum"] == [2.0, 2.0], res
        assert res["new"] == [r, 2] and res["new_sum"] == [2.0, 2.0] and res["name"] == "g", res


def test_frozen_joiner_is_named_by_heartbeats() -> None:
    # Alive on the process table, silent: only the watch's heartbeats and census can name it.
    results = run_ranks(
        er.joiner_freezes_in_grow, world_size=3, backend=None, timeout=60, lost=(2,)
    )
    for r in (0, 1):
        res = results[r]
        assert res["ranks"] == [2] and res["old_state"] == "ok", res
        assert res["after"] < 15, res


def test_member_that_dies_in_grow_survivors_shrink_and_the_joiner_gets_in() -> None:
    results = run_ranks(er.member_dies_in_grow, world_size=4, backend=None, timeout=90, lost=(2,))
    assert results[2] is None
    by_rank = {res["rank"]: res for res in (results[0], results[1], results[3])}
    assert sorted(by_rank) == [0, 1, 2], results  # the joiner waited on and became rank 2
    assert results[0]["rank"] == 0 and results[1]["rank"] == 1 and results[3]["rank"] == 2, results
    assert all(res["size"] == 3 and res["sum"] == [6.0, 6.0] for res in by_rank.values()), results


@pytest.mark.parametrize("victim", [2, 1], ids=["joiner", "member"])
def test_death_during_broadcast_state_is_a_peer_failure(victim: int) -> None:
    results = run_ranks(
        er.dies_in_broadcast_state,
        world_size=3,
        backend=None,
        timeout=60,
        args=(victim,),
        lost=(victim,),
    )
    survivors = [r for r in range(3) if r != victim]
    for new_rank, r in enumerate(survivors):
        res = results[r]
        assert res["ranks"] == [victim], res
        assert res["new"] == [new_rank, 2] and res["sum"] == [2.0] and res["name"] == "g", res


def test_grow_timeout_leaves_the_group_usable_then_a_late_joiner_gets_in() -> None:
    results = run_ranks(er.grow_timeout_and_late_joiner, world_size=3, backend=None, timeout=60)
    assert [res["rank"] for res in results] == [0, 1, 2], results
    assert all(res["size"] == 3 for res in results), results
    for res in results[:2]:
        assert res["old_sum"] == [2.0] and res["old_state"] == "closed", res


def test_bad_arguments_raise_invalid_argument_and_the_communicator_stays_usable() -> None:
    results = run_ranks(er.bad_arguments, world_size=2, backend=None, timeout=60)
    for res in results:
        assert all(text is not None for text in res["errors"].values()), res["errors"]
        assert "name" in res["errors"]["waiting unnamed"], res["errors"]
        assert res["sum"] == [2.0] and res["counts"] == [0, 0], res
        assert res["name"] == "g" and res["plain"] is None, res


def test_refused_and_timed_out_joiners_are_not_counted() -> None:
    results = run_ranks(er.join_refused_and_timed_out, world_size=3, backend=None, timeout=60)
    assert "runs backend 'gloo'" in results[2]["refused"], results[2]
    assert "did not admit" in results[2]["timed_out"], results[2]
    for res in results[:2]:
        assert res["after"] == 0 and res["max_seen"] <= 1, res


@pytest.mark.parametrize("src", [0, 1])
def test_broadcast_state_round_trip(src: int) -> None:
    results = run_ranks(er.state_round_trip, world_size=2, backend="gloo", timeout=60, args=(src,))
    assert results[src] == {"same_object": True}
    got = results[1 - src]
    assert got["model"] and got["opt_state"] and all(got["opt_state"]) and got["param_groups"], got
    assert got["aliased"] and got["namedtuple"] and got["order"], got
    assert got["tuple"] == "tuple:text:3.5", got
    assert all(got["dtypes"].values()), got["dtypes"]
    assert (
        got["param_grad"] is False and got["defaultdict"] == "defaultdict0" and got["step"] == 41
    ), got


def test_broadcast_state_refused_on_every_rank() -> None:
    results = run_ranks(er.state_refused, world_size=2, backend="gloo", timeout=60)
    for res in results:
        assert res["error"] and "pickle" in res["error"], res
        assert res["sum"] == [2.0] and res["state"] == "ok", res


def _serve(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "asynccoll.store", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(90)
def test_store_cli_serves_until_signalled_and_refuses_a_port_in_use() -> None:
    """Two stores on free ports (one stopped by SIGTERM, one by SIGINT) and a third on a
    taken port, started together (each is a Python process that imports torch)."""
    taken = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    procs = {signal.SIGTERM: _serve("--port", "0"), signal.SIGINT: _serve("--port", "0")}
    refused = _serve("--port", str(taken.port))
    try:
        for sig, proc in procs.items():
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("asynccoll store: listening on "), (
                line,
                proc.stderr.read() if proc.stderr else "",
            )
            port = int(line.rsplit(":", 1)[1])
            client = dist.TCPStore(
                "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)
            )
            client.set("k", "v")
            assert client.get("k") == b"v" and client.add("n", 2) == 2
            del client
            start = time.monotonic()
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=20)
            assert proc.returncode == 0 and "stopped" in out, (sig, out, err)
            assert time.monotonic() - start < 10, (sig, out, err)
        _, err = refused.communicate(timeout=50)
        assert refused.returncode == 1 and "cannot listen" in err, err
    finally:
        for proc in (*procs.values(), refused):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("native", [True, False], ids=["ncclCommGrow", "fresh-init"])
def test_grow_on_nccl_on_the_simulated_gpu(native: bool) -> None:
    """NCCL below is the simulated GPU's (nccl4py's real classes, autospecced); asynccoll above
    it is real. 2 members admit a joiner; the grown group's NCCL communicator of 3 comes from
    ncclCommGrow of the members' one (the joiner joins it with the grow's unique id), or, where
    the installed NCCL has no ncclCommGrow, from a fresh init; an all_reduce runs on it."""
    import asyncio

    from asynccoll._bootstrap.init import init_with, join_with
    from asynccoll.testing.simgpu import SimCluster, run_threads

    with SimCluster(grow=native) as sim:
        store = dist.HashStore()
        gpu = sim.gpu
        factories = sim.factories()  # NCCL on the simulator, for init and join alike

        async def rank_main(r: int) -> tuple[int, int, float, str, int]:
            if r == 2:
                comm = await join_with(factories, "nccl", store=store, name="g", timeout=30)
            else:
                old = await init_with(
                    factories,
                    "nccl",
                    rank=r,
                    world_size=2,
                    store=store,
                    name="g",
                    timeout=30,
                    heartbeat=0,
                )
                while (n := await old.waiting()) == 0:
                    await asyncio.sleep(0.01)
                comm = await old.grow(old.world_size + n)
                assert old.state == "closed"
            nccl_comm = comm.backends["cuda"].handle.communicator
            t = gpu.tensor([float(comm.rank + 1)])
            await asyncio.wait_for(comm.all_reduce(t), 20)
            world = sim.nccl.state(nccl_comm).world
            grown = (
                isinstance(world.key, tuple) and world.key[1] == "grow"
            )  # the simulator's child of a grow
            res = (
                comm.rank,
                comm.world_size,
                gpu.host(t).item(),
                comm.backend,
                world.nranks,
                grown,
            )
            await comm.close()
            return res

        results = run_threads(3, rank_main, timeout=90)
        inits = sim.nccl.module.Communicator.init.call_count
        assert sim.nccl.live() == [] and sim.gpu.errors == []
    assert results == [(r, 3, 6.0, "nccl", 3, native) for r in range(3)], results
    assert inits == (2 if native else 5)  # the members' first init; a fresh one of 3 without grow


def test_joiner_takes_the_members_options() -> None:
    results = run_ranks(er.joiner_takes_the_members_options, world_size=3, backend=None, timeout=60)
    assert results == [{"sum": [3.0, 3.0], "error": "CollectiveMismatch", "timeout": 25.0}] * 3, (
        results
    )


def test_a_joiner_frozen_in_a_failed_grow_gets_into_the_next_one() -> None:
    """Stopped from its admission until the members counted it out of the failed grow
    and deleted its plan: once resumed, it takes a new ticket (not a wait for the deleted
    plan until its join timeout)."""
    results = run_ranks(
        er.frozen_joiner_resumes_after_a_scan, world_size=3, backend=None, timeout=90
    )
    assert sorted(r["rank"] for r in results) == [0, 1, 2], results
    assert all(r["size"] == 3 for r in results), results
    # Resumed -> grown: a new ticket at once, not at the end of a wait for the old plan.
    assert all(r["after"] < 20.0 for r in results[:2]), results
