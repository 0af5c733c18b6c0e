"""Tests of the NCCL backend's seams, pinned to the real nccl4py (``asynccoll._backends.nccl``).

* CPU: ``missing()`` / ``create()`` say what is absent (never ModuleNotFoundError),
  ``backend="auto"`` falls back to Gloo without CUDA, device choice.
* Contract: the real :class:`NcclLib` over the real ``nccl.core`` (importable on a
  CPU machine): result codes, reduce ops, config, group and shrink entry points.
  These must run in CI (``make venv``: the ``test`` and ``nccl-cu12`` extras; ``make test-cu13``:
  ``nccl-cu13``); they do not skip.
* GPU (world size 1, one GPU): run only where torch sees CUDA and nccl4py works
  (``make gpu-test``). The simulated-GPU tests are in ``test_simgpu_*.py``.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch
from ports import unused_port

import asynccoll as ac
import streams
from asynccoll._backends import nccl
from asynccoll._base.ops import ReduceOp

HAS_CUDA = torch.cuda.is_available()
NCCL_MISSING = nccl.missing()
needs_nccl = pytest.mark.skipif(NCCL_MISSING is not None, reason=f"needs CUDA + nccl4py: {NCCL_MISSING}")
no_cuda = pytest.mark.skipif(HAS_CUDA, reason="checks behaviour without CUDA")


# ===================================================================== import, init
def test_import_is_lazy_and_cheap() -> None:
    code = (
        "import sys, asynccoll._backends.nccl as n; "
        "assert 'nccl' not in sys.modules and 'nccl.core' not in sys.modules, sorted(sys.modules); "
        "import threading; assert threading.active_count() == 1; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@no_cuda
def test_missing_names_cuda_and_how_to_fix() -> None:
    reason = nccl.missing()
    assert reason is not None and "CUDA" in reason and "gloo" in reason


def test_nccl4py_cuda_bindings_and_libnccl_are_usable_here() -> None:
    # The test extra installs them; the contract tests below rely on it.
    assert nccl.library_problem() is None


@pytest.mark.parametrize("absent", ["nccl.core", "cuda.bindings.driver"])
def test_missing_checks_each_import_with_cuda_present(absent: str) -> None:
    import importlib

    def importer(name: str) -> Any:
        if name == absent:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return importlib.import_module(name)

    reason = nccl.missing(cuda_available=lambda: True, importer=importer)
    assert reason is not None and absent in reason and "asynccoll[nccl-cu1" in reason


def test_missing_checks_that_libnccl_loads() -> None:
    import importlib

    class NoLib:
        def get_version(self) -> None:
            raise OSError("libnccl.so.2: cannot open shared object file")

    def importer(name: str) -> Any:
        return NoLib() if name == "nccl.core" else importlib.import_module(name)

    reason = nccl.missing(cuda_available=lambda: True, importer=importer)
    assert reason is not None and "libnccl" in reason
    assert nccl.missing(cuda_available=lambda: True) is None  # everything is installed here


def test_create_turns_an_unloadable_nccl4py_into_backend_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    from asynccoll._backends.nccl import creation

    monkeypatch.setattr(creation, "missing", lambda: None)  # as on a GPU machine

    def broken(*a: Any, **k: Any) -> Any:
        raise ModuleNotFoundError("No module named 'cuda.bindings'")

    monkeypatch.setattr(creation, "NcclLib", broken)
    with pytest.raises(ac.BackendUnavailable, match="cuda.bindings"):
        asyncio.run(nccl.create(None, "p/", 0, 1.0))


@no_cuda
def test_init_nccl_without_cuda_is_backend_unavailable() -> None:
    async def main() -> None:
        await ac.init(backend="nccl", rank=0, world_size=1, master_addr="127.0.0.1", master_port=unused_port())

    with pytest.raises(ac.BackendUnavailable, match="CUDA"):
        asyncio.run(main())


@no_cuda
def test_create_without_cuda_is_backend_unavailable() -> None:
    with pytest.raises(ac.BackendUnavailable, match="CUDA"):
        asyncio.run(nccl.create(None, "p/", None, 1.0))


@no_cuda
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_auto_falls_back_to_gloo(loop: str) -> None:
    async def main() -> None:
        comm = await ac.init(backend="auto", rank=0, world_size=1, master_addr="127.0.0.1", master_port=unused_port())
        try:
            assert "cuda" not in comm._backends and comm.device == torch.device("cpu")
            t = torch.arange(4.0)
            assert torch.equal(await comm.all_reduce(t), torch.arange(4.0))
            with pytest.raises(ac.InvalidArgument):  # no backend serves non-CPU devices here
                comm.all_reduce(torch.empty(4, device="meta"))
            assert comm.state == "ok"
            await comm.barrier()
        finally:
            await comm.close()

    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(main())
    else:
        asyncio.run(main())


def test_device_index() -> None:
    cur = lambda: 1  # noqa: E731
    assert nccl.device_index(None, 4, cur, env={}) == 1
    assert nccl.device_index(None, 4, cur, env={"LOCAL_RANK": "3"}) == 3
    assert nccl.device_index(None, 1, cur, env={"LOCAL_RANK": "5"}) == 0  # one visible GPU per process
    assert nccl.device_index(2, 4, cur) == 2
    assert nccl.device_index("cuda:3", 4, cur) == 3
    assert nccl.device_index("cuda", 4, cur) == 1
    assert nccl.device_index(torch.device("cuda", 0), 4, cur) == 0
    for bad in ("cpu", torch.device("cpu"), 9, True, 1.5, "nonsense"):
        with pytest.raises(ac.InvalidArgument):
            nccl.device_index(bad, 4, cur)
    with pytest.raises(ac.InvalidArgument):
        nccl.device_index(None, 2, cur, env={"LOCAL_RANK": "3"})
    with pytest.raises(ac.InvalidArgument):
        nccl.device_index(None, 2, cur, env={"LOCAL_RANK": "x"})


# ============================================================ contract: real nccl4py
def test_contract_result_codes_are_nccl4py_s() -> None:
    from nccl.bindings.nccl import Result

    assert nccl.SUCCESS == int(Result.Success)
    assert nccl.IN_PROGRESS == int(Result.InProgress)
    assert nccl.REMOTE_ERROR == int(Result.RemoteError)
    assert nccl.SYSTEM_ERROR == int(Result.SystemError)
    assert nccl.INVALID_ARGUMENT == int(Result.InvalidArgument)
    assert set(nccl.PEER_ERRORS) == {int(Result.SystemError), int(Result.RemoteError)}


def test_contract_inprogress_is_not_raised_by_nccl4py() -> None:
    # group_end()/collectives return normally on ncclInProgress: the backend must poll.
    from nccl.bindings.nccl import NCCLError, check_status

    assert check_status(nccl.IN_PROGRESS) is None
    with pytest.raises(NCCLError) as info:
        check_status(nccl.REMOTE_ERROR)
    assert info.value.status == nccl.REMOTE_ERROR


def test_contract_real_ncclib_maps_every_reduce_op() -> None:
    import nccl.core as nc

    lib = nccl.NcclLib()
    want = {ReduceOp.SUM: nc.NcclRedOp.SUM, ReduceOp.PROD: nc.NcclRedOp.PROD, ReduceOp.MIN: nc.NcclRedOp.MIN,
            ReduceOp.MAX: nc.NcclRedOp.MAX, ReduceOp.AVG: nc.NcclRedOp.AVG}
    for op in ReduceOp:
        assert lib.redop(op) is want[op]


def test_contract_real_ncclib_config_is_non_blocking() -> None:
    import nccl.core as nc

    cfg = nccl.NcclLib().config()
    assert isinstance(cfg, nc.NCCLConfig) and cfg.blocking is False


def test_contract_real_ncclib_calls_bind_to_nccl4py_signatures() -> None:
    import nccl.core as nc

    C = nc.Communicator
    inspect.signature(C.init).bind(2, 0, nc.UniqueId.from_bytes(bytes(128)), nc.NCCLConfig(blocking=False))
    inspect.signature(C.shrink).bind(None, [1], nc.NCCLConfig(blocking=False), nc.CommShrinkFlag.ABORT)
    inspect.signature(nc.group_end).bind(simulate=True)  # group_discard
    assert nc.CommShrinkFlag.ABORT != nc.CommShrinkFlag.DEFAULT
    uid = nccl.NcclLib().unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128
    assert bytes(nc.UniqueId.from_bytes(uid)) == uid
    assert "progress" in nccl.NcclLib().error_string(nccl.IN_PROGRESS).lower()


def test_contract_native_dtypes_are_exactly_those_nccl4py_maps() -> None:
    # nccl4py 0.6 interop/torch.py _to_nccl_dtype: every other dtype raises NcclInvalid.
    import nccl.core as nc
    from nccl.core.interop.torch import _to_nccl_dtype

    from asynccoll._backends.nccl import encode

    every = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    mapped = set()
    for dt in every:
        try:
            _to_nccl_dtype(dt)
        except nc.NcclInvalid:
            continue
        mapped.add(dt)
    assert mapped == set(nccl.NATIVE)
    assert _to_nccl_dtype(torch.bool) == nc.NcclDataType.UINT8  # NCCL has no bool
    for dt in (torch.complex64, torch.complex128, torch.int16, torch.uint16, torch.float8_e4m3fnuz):
        assert dt not in mapped
        assert encode.raw(torch.zeros(2, dtype=dt)).dtype == torch.uint8  # moved as bytes


def test_caps_bool_reduces_except_avg_and_fp8_needs_sm90() -> None:
    # NCCL has no bool (nccl.h ncclDataType_t); nccl4py sends it as uint8. A uint8 SUM
    # would store 2 in a bool, so the backend reduces bool with MAX/MIN (or/and); AVG
    # has no meaning for bool. This table is the one validate.py must agree with.
    caps = nccl.CAPS
    for op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX):
        assert torch.bool in caps.reduce[op] and caps.refusal(op, torch.bool) is None
    assert torch.bool not in caps.reduce[ReduceOp.AVG]
    assert "AVG is not defined" in (caps.refusal(ReduceOp.AVG, torch.bool) or "")
    assert nccl.COMPLEX <= caps.reduce[ReduceOp.SUM] and not nccl.COMPLEX & caps.reduce[ReduceOp.MAX]
    fp8 = torch.float8_e4m3fn
    assert fp8 in caps.for_device((9, 0)).reduce[ReduceOp.SUM]
    old = caps.for_device((8, 9))
    assert fp8 not in old.reduce[ReduceOp.SUM] and "sm_90" in (old.refusal(ReduceOp.SUM, fp8) or "")
    assert old.move is None  # every dtype still moves (as bytes where not native)


# ============================================================== GPU (world size 1)
def _run_ranks(fn: Any, **kw: Any) -> list[Any]:
    try:
        from asynccoll.testing import run_ranks
    except ImportError as exc:  # pragma: no cover - written concurrently
        pytest.skip(f"asynccoll.testing.run_ranks unavailable: {exc}")
    return run_ranks(fn, world_size=1, backend="nccl", timeout=120, **kw)


async def gpu_all_collectives(comm: Any) -> list[str]:
    """Every collective at world size 1; returns the list of mismatches."""
    dev = comm.device
    bad: list[str] = []
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64,
              torch.int8, torch.uint8, torch.int32, torch.int64]
    for dt in dtypes:
        for op in ac.ReduceOp:
            t = torch.arange(1, 9, device=dev).to(dt)
            want = t.clone()
            got = await comm.all_reduce(t, op)
            if not torch.equal(got, want):
                bad.append(f"all_reduce {dt} {op}: {got.tolist()}")
        x = torch.arange(6, device=dev).to(dt)
        if not torch.equal(await comm.broadcast(x.clone(), 0), x):
            bad.append(f"broadcast {dt}")
        r = x.clone()
        await comm.reduce(r, 0, ac.ReduceOp.MAX)
        if not torch.equal(r, x):
            bad.append(f"reduce {dt}")
        out = torch.empty_like(x)
        if not torch.equal(await comm.all_gather(out, x), x):
            bad.append(f"all_gather {dt}")
        out = torch.empty_like(x)
        if not torch.equal(await comm.reduce_scatter(out, x, ac.ReduceOp.SUM), x):
            bad.append(f"reduce_scatter {dt}")
        out = torch.empty_like(x)
        if not torch.equal(await comm.all_to_all(out, x), x):
            bad.append(f"all_to_all {dt}")
        out = torch.empty_like(x)
        if not torch.equal(await comm.gather(x, 0, out), x):
            bad.append(f"gather {dt}")
        out = torch.empty_like(x)
        if not torch.equal(await comm.scatter(out, 0, x), x):
            bad.append(f"scatter {dt}")
    b = torch.tensor([True, False, True], device=dev)
    if not torch.equal(await comm.all_reduce(b), b):
        bad.append("all_reduce bool")
    await comm.barrier()
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        a = cupy.arange(4, dtype=cupy.float32)
        await comm.all_reduce(a)
        cupy.cuda.get_current_stream().synchronize()
        if a.tolist() != [0.0, 1.0, 2.0, 3.0]:
            bad.append("cupy all_reduce")
    return bad


async def gpu_stream_order(comm: Any) -> dict[str, Any]:
    """The op waits for the caller's stream at call time; wait_stream orders without a host block."""
    dev = comm.device
    n = 1 << 20
    x = torch.zeros(n, device=dev)
    out = torch.empty(n, device=dev)
    torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU time on the current stream
    x.fill_(3.0)  # queued behind the sleep
    t0 = time.monotonic()
    w = comm.all_gather(out, x)  # out-of-place: running early would copy zeros
    side = torch.cuda.Stream(dev)
    w.wait_stream(side)
    issue_s = time.monotonic() - t0
    with torch.cuda.stream(side):
        y = out * 2
    early = w.done()
    await w
    side.synchronize()
    return {"gather_ok": bool((out == 3).all()), "y_ok": bool((y == 6).all()), "issue_s": issue_s, "early": early}


async def gpu_allocator_safety(comm: Any) -> bool:
    dev = comm.device
    n = 1 << 22
    x = torch.full((n,), 7.0, device=dev)
    out = torch.empty(n, device=dev)
    torch.cuda._sleep(int(2e8))
    w = comm.all_gather(out, x)
    del x  # the backend and the Work keep it alive until the op completes
    junk = [torch.full((n,), -1.0, device=dev) for _ in range(8)]
    r = await w
    del junk
    return bool((r == 7).all())


async def gpu_abort_stuck(comm: Any) -> dict[str, Any]:
    dev = comm.device
    t = torch.ones(16, device=dev)
    torch.cuda._sleep(int(5e9))  # seconds of GPU time: the all_reduce is stuck behind it
    w = comm.all_reduce(t)
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    comm.abort("test")
    try:
        await asyncio.wait_for(w, 5)
        raised = None
    except BaseException as exc:  # noqa: BLE001
        raised = type(exc).__name__
    return {"elapsed": time.monotonic() - t0, "raised": raised, "is_aborted": isinstance(w.exception(), ac.CommAborted)}


async def gpu_init_close_cycles(comm: Any) -> dict[str, Any]:
    import gc

    dev = comm.device
    await comm.all_reduce(torch.ones(4, device=dev))
    torch.cuda.synchronize()
    threads0 = threading.active_count()
    mem0 = torch.cuda.memory_allocated(dev)
    for _ in range(3):
        port = unused_port()
        async with ac.init(backend="nccl", rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, device=dev) as c:
            t = torch.ones(1024, device=dev)
            await c.all_reduce(t)
            await c.barrier()
            del t
    gc.collect()
    torch.cuda.synchronize()
    return {"threads": threading.active_count() - threads0, "mem": torch.cuda.memory_allocated(dev) - mem0}


@needs_nccl
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_gpu_every_collective(loop: str) -> None:
    (bad,) = _run_ranks(gpu_all_collectives, loop=loop)
    assert bad == []


@needs_nccl
def test_gpu_stream_ordering_and_wait_stream() -> None:
    (res,) = _run_ranks(gpu_stream_order)
    assert res["gather_ok"] and res["y_ok"], res
    assert res["issue_s"] < 0.05 and not res["early"], res  # no host block behind the GPU sleep


@needs_nccl
def test_gpu_allocator_safety() -> None:
    assert _run_ranks(gpu_allocator_safety) == [True]


@needs_nccl
def test_gpu_abort_while_stuck_is_bounded() -> None:
    (res,) = _run_ranks(gpu_abort_stuck)
    assert res["elapsed"] < 5.0 and res["raised"] == "CommAborted" and res["is_aborted"], res


@needs_nccl
def test_gpu_init_close_cycles_leak_nothing() -> None:
    (res,) = _run_ranks(gpu_init_close_cycles)
    assert res == {"threads": 0, "mem": 0}, res


@needs_nccl
def test_gpu_init_picks_local_rank_device() -> None:
    async def main() -> None:
        os.environ["LOCAL_RANK"] = "0"
        try:
            async with ac.init(backend="nccl", rank=0, world_size=1, master_addr="127.0.0.1", master_port=unused_port()) as c:
                assert c.device == torch.device("cuda", 0) and c.backend == "nccl"
        finally:
            del os.environ["LOCAL_RANK"]

    asyncio.run(main())


def test_backend_class_is_exported() -> None:
    assert nccl.backend_class is nccl.NcclBackend
    assert issubclass(nccl.NcclBackend, ac._core.backend.Backend) if hasattr(ac, "_core") else True
    assert streams.EventWatcher is not None
