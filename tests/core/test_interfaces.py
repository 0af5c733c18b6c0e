"""The interfaces between the rooms: what backends declare, what the wrappers forward,
the bootstrap's backend factories, and the public replacements of old private reaches."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import asynccoll as ac
from asynccoll._backends import gloo
from asynccoll._backends.torch_pg import TorchGroupBackend
from asynccoll._bootstrap.build import Factories, build_gloo
from asynccoll._bootstrap.init import init_with
from asynccoll._core import validate
from asynccoll._core.backend import ANY, Backend
from asynccoll._diag.fingerprint import FingerprintChecker
from asynccoll._faults.liveness import Liveness


def _gloo_backend() -> TorchGroupBackend:
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))
    return TorchGroupBackend(
        pg, name="gloo", device_type="cpu", world_size=1, timeout=10.0, caps=gloo.CAPS
    )


def test_backend_declares_its_features_with_defaults() -> None:
    assert Backend.caps is ANY and Backend.device is None and Backend.census is None
    inner = _gloo_backend()
    try:
        assert inner.caps is gloo.CAPS
        assert inner.shrink_agreed(None, 0, 1, [1], True, 1.0) is None  # no native shrink
        # validate asks the table it is given: Gloo's refuses what the permissive one lets through.
        u16 = torch.zeros(2, dtype=torch.uint16)
        assert validate.reduce_op(ac.ReduceOp.SUM, u16.dtype, ANY) is ac.ReduceOp.SUM
        try:
            validate.reduce_op(ac.ReduceOp.SUM, u16.dtype, inner.caps)
        except ac.InvalidArgument as exc:
            assert "gloo cannot reduce torch.uint16" in str(exc)
        else:
            raise AssertionError("Gloo's table let uint16 through")
        assert validate.movable(u16, inner.caps, "broadcast").dtype == torch.uint8  # as bytes
    finally:
        inner.abort()
        inner.close()


def test_checked_backend_forwards_each_declared_attribute() -> None:
    inner = _gloo_backend()
    checker = FingerprintChecker(0, 1, {}, {})
    wrapped = checker.wrap(inner)
    try:
        assert (wrapped.name, wrapped.device_type, wrapped.caps, wrapped.device) == (
            "gloo",
            "cpu",
            gloo.CAPS,
            inner.device,
        )

        def census() -> tuple[int, ...]:
            return (1,)

        wrapped.census = census
        assert inner.census is census and wrapped.census is census
        assert wrapped.shrink_agreed(None, 0, 1, [1], True, 1.0) is None
    finally:
        wrapped.release()  # the checker's thread ends and the inner backend is released
    assert inner._aborted and inner._pg is None, (
        "release() must reach the inner backend's release()"
    )


def test_work_stream_hook_is_set_through_a_method() -> None:
    work = ac.Work("all_reduce", 1)
    work.wait_stream()  # no hook: a no-op (CPU ops)
    seen: list[Any] = []
    work.set_stream_hook(seen.append)
    work.wait_stream("s")
    assert seen == ["s"]


def test_liveness_hold_keeps_the_service_until_release() -> None:
    def service_ends(hold: bool) -> bool:
        live = Liveness(dist.HashStore(), 0, 2, interval=0.05, detect=False)
        live.publish()
        live.start(lambda exc: None)
        beater = live._service._beater
        if hold:
            live.hold()
        live.stop()
        time.sleep(0.3)  # six intervals: an unheld service has ended by now
        alive = beater.is_alive()
        if hold:
            live.release()
            beater.join(5)
            assert not beater.is_alive(), "release() must let the service end"
        return not alive

    assert service_ends(hold=False)
    assert not service_ends(hold=True)


def test_init_with_uses_the_factories_for_every_build_shrink_included() -> None:
    built: list[int] = []

    def counting_gloo(store: Any, rank: int, world_size: int, timeout: float) -> Backend:
        built.append(world_size)
        return build_gloo(store, rank, world_size, timeout)

    async def main() -> float:
        store = dist.HashStore()
        comm = await init_with(
            Factories(gloo=counting_gloo), "gloo", rank=0, world_size=1, store=store, timeout=10
        )
        new = await comm.shrink(exclude=())
        t = torch.ones(2)
        await new.all_reduce(t)
        await new.close()
        await comm.close()
        return float(t.sum())

    assert asyncio.run(asyncio.wait_for(main(), 60)) == 2.0
    assert built == [1, 1]
