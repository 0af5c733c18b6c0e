"""Tests of the NCCL backend's binding, pinned to the real nccl4py (``asynccoll._backends.nccl``).

* CPU: ``missing()`` / ``create()`` say what is absent (never ModuleNotFoundError),
  ``backend="auto"`` falls back to Gloo without CUDA, device choice.
* Contract: the real :class:`NcclLib` over the real ``nccl.core`` (importable on a
  CPU machine): result codes, reduce ops, config, group and shrink entry points.
  These must run in CI (``make venv``: the ``test`` and ``nccl-cu12`` extras; ``make test-cu13``:
  ``nccl-cu13``); they do not skip.
The real-GPU tests are in ``test_gpu.py``, the simulated-GPU ones in ``test_simgpu_*.py``.
"""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
from typing import Any

import pytest
import torch

import asynccoll as ac
import streams
from asynccoll._backends import nccl
from tests.support.ports import unused_port

HAS_CUDA = torch.cuda.is_available()
NCCL_MISSING = nccl.missing()
needs_nccl = pytest.mark.skipif(
    NCCL_MISSING is not None, reason=f"needs CUDA + nccl4py: {NCCL_MISSING}"
)
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


def test_create_turns_an_unloadable_nccl4py_into_backend_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
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
        await ac.init(
            backend="nccl", rank=0, world_size=1, master_addr="127.0.0.1", master_port=unused_port()
        )

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
        comm = await ac.init(
            backend="auto", rank=0, world_size=1, master_addr="127.0.0.1", master_port=unused_port()
        )
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


def test_choose_device() -> None:
    cur = lambda: 1  # noqa: E731
    assert nccl.choose_device(None, 4, cur, env={}) == 1
    assert nccl.choose_device(None, 4, cur, env={"LOCAL_RANK": "3"}) == 3
    assert (
        nccl.choose_device(None, 1, cur, env={"LOCAL_RANK": "5"}) == 0
    )  # one visible GPU per process
    assert nccl.choose_device(2, 4, cur) == 2
    assert nccl.choose_device("cuda:3", 4, cur) == 3
    assert nccl.choose_device("cuda", 4, cur) == 1
    assert nccl.choose_device(torch.device("cuda", 0), 4, cur) == 0
    for bad in ("cpu", torch.device("cpu"), 9, True, 1.5, "nonsense"):
        with pytest.raises(ac.InvalidArgument):
            nccl.choose_device(bad, 4, cur)
    with pytest.raises(ac.InvalidArgument):
        nccl.choose_device(None, 2, cur, env={"LOCAL_RANK": "3"})
    with pytest.raises(ac.InvalidArgument):
        nccl.choose_device(None, 2, cur, env={"LOCAL_RANK": "x"})


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
    want = {
        ac.ReduceOp.SUM: nc.NcclRedOp.SUM,
        ac.ReduceOp.PROD: nc.NcclRedOp.PROD,
        ac.ReduceOp.MIN: nc.NcclRedOp.MIN,
        ac.ReduceOp.MAX: nc.NcclRedOp.MAX,
        ac.ReduceOp.AVG: nc.NcclRedOp.AVG,
    }
    for op in ac.ReduceOp:
        assert lib.redop(op) is want[op]


def test_contract_real_ncclib_config_is_non_blocking() -> None:
    import nccl.core as nc

    cfg = nccl.NcclLib().config()
    assert isinstance(cfg, nc.NCCLConfig) and cfg.blocking is False


def test_contract_real_ncclib_calls_bind_to_nccl4py_signatures() -> None:
    import nccl.core as nc

    C = nc.Communicator
    inspect.signature(C.init).bind(
        2, 0, nc.UniqueId.from_bytes(bytes(128)), nc.NCCLConfig(blocking=False)
    )
    inspect.signature(C.shrink).bind(
        None, [1], nc.NCCLConfig(blocking=False), nc.CommShrinkFlag.ABORT
    )
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
    for op in (ac.ReduceOp.SUM, ac.ReduceOp.PROD, ac.ReduceOp.MIN, ac.ReduceOp.MAX):
        assert torch.bool in caps.reduce[op] and caps.refusal(op, torch.bool) is None
    assert torch.bool not in caps.reduce[ac.ReduceOp.AVG]
    assert "AVG is not defined" in (caps.refusal(ac.ReduceOp.AVG, torch.bool) or "")
    assert (
        nccl.COMPLEX <= caps.reduce[ac.ReduceOp.SUM]
        and not nccl.COMPLEX & caps.reduce[ac.ReduceOp.MAX]
    )
    fp8 = torch.float8_e4m3fn
    assert fp8 in caps.for_device((9, 0)).reduce[ac.ReduceOp.SUM]
    old = caps.for_device((8, 9))
    assert fp8 not in old.reduce[ac.ReduceOp.SUM] and "sm_90" in (
        old.refusal(ac.ReduceOp.SUM, fp8) or ""
    )
    assert old.move is None  # every dtype still moves (as bytes where not native)


def test_backend_class_is_exported() -> None:
    assert nccl.backend_class is nccl.NcclBackend
    assert issubclass(nccl.NcclBackend, ac._core.backend.Backend) if hasattr(ac, "_core") else True
    assert streams.EventWatcher is not None
