"""Tests of the NCCL backend (``asynccoll._backends.nccl``).

CPU tests drive the real launcher / watcher / Work machinery with a fake nccl4py
communicator, a fake nccl4py module facade and fake CUDA streams and events, and
check what this machine can: ``init(backend="nccl")`` without CUDA, the Gloo
fall-back of ``"auto"``. GPU tests (world size 1, one GPU) run only where torch
sees CUDA and nccl4py is installed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import asynccoll as ac
import streams
from asynccoll._backends import nccl
from asynccoll._core.communicator import Communicator
from asynccoll._core.deadlines import service as deadline_service
from asynccoll._core.ledger import Ledger
from asynccoll._core.ops import OpKind, OpSpec, ReduceOp
from asynccoll._core.work import Work

HAS_CUDA = torch.cuda.is_available()
NCCL_MISSING = nccl.missing()
needs_nccl = pytest.mark.skipif(NCCL_MISSING is not None, reason=f"needs CUDA + nccl4py: {NCCL_MISSING}")
no_cuda = pytest.mark.skipif(HAS_CUDA, reason="checks behaviour without CUDA")

WAIT = 5.0


# ============================================================================ fakes
class Log:
    """Thread-safe ordered record of what the fakes saw."""

    def __init__(self) -> None:
        self._items: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()

    def add(self, *item: Any) -> None:
        with self._lock:
            self._items.append(item)

    @property
    def items(self) -> list[tuple[Any, ...]]:
        with self._lock:
            return list(self._items)

    def index(self, *item: Any) -> int:
        return self.items.index(item)

    def kinds(self, *names: str) -> list[tuple[Any, ...]]:
        return [i for i in self.items if i[0] in names]


class FakeStream:
    def __init__(self, name: str, log: Log) -> None:
        self.name = name
        self._log = log

    def wait_event(self, event: "FakeEvent") -> None:
        self._log.add("wait", self.name, event.name)


class FakeEvent:
    """Completes at record time (``auto``) or when :meth:`fire` is called."""

    def __init__(self, name: str, log: Log, auto: bool) -> None:
        self.name = name
        self._log = log
        self._auto = auto
        self._done = threading.Event()

    def record(self, stream: FakeStream) -> None:
        self._log.add("record", self.name, stream.name)
        if self._auto:
            self._done.set()

    def fire(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


class FakePool:
    def __init__(self, log: Log, auto: bool) -> None:
        self._log = log
        self.auto = auto
        self.made: list[FakeEvent] = []
        self.released: list[str] = []

    def acquire(self) -> FakeEvent:
        ev = FakeEvent(f"ev{len(self.made)}", self._log, self.auto)
        self.made.append(ev)
        return ev

    def release(self, ev: FakeEvent) -> None:
        self.released.append(ev.name)


class FakeRuntime:
    """Stands in for :class:`nccl.CudaRuntime`."""

    def __init__(self, log: Log, auto: bool = True) -> None:
        self.log = log
        self.comm_stream = FakeStream("comm", log)
        self.caller = FakeStream("caller", log)
        self.events = FakePool(log, auto)

    def bind_thread(self) -> None:
        pass

    def caller_stream(self, tensor: Any) -> FakeStream:
        return self.caller

    def target_stream(self, stream: Any) -> FakeStream:
        return stream if stream is not None else FakeStream("current", self.log)

    def handle(self, stream: FakeStream) -> int:
        return 0xC0FFEE

    def protect(self, tensor: torch.Tensor) -> None:
        self.log.add("protect", tensor.data_ptr())

    def on_comm_stream(self) -> Any:
        return contextlib.nullcontext()

    def scratch(self) -> torch.Tensor:
        return torch.zeros(1)


class FakeComm:
    """The nccl4py ``Communicator`` methods the backend calls, simulating one rank."""

    def __init__(self, log: Log, statuses: Any = (), default: int = nccl.SUCCESS) -> None:
        self.log = log
        self.statuses = collections.deque(statuses)
        self.default = default
        self.gate: threading.Event | None = None
        self.raise_on_op: BaseException | None = None
        self.abort_delay = 0.0
        self.aborted = False
        self.destroyed = False
        self.finalized = False

    def _op(self, name: str, *args: Any, stream: int) -> None:
        assert stream == 0xC0FFEE
        if self.gate is not None:
            assert self.gate.wait(WAIT)
        if self.raise_on_op is not None:
            raise self.raise_on_op
        self.log.add(name, *args)

    def allreduce(self, s: torch.Tensor, r: torch.Tensor, op: Any, *, stream: int) -> None:
        self._op("allreduce", op, s.dtype, s.flatten()[0].item() if s.numel() else None, stream=stream)

    def reduce(self, s: torch.Tensor, r: torch.Tensor, op: Any, root: int, *, stream: int) -> None:
        self._op("reduce", op, root, stream=stream)

    def broadcast(self, s: torch.Tensor, r: torch.Tensor, root: int, *, stream: int) -> None:
        self._op("broadcast", root, s.dtype, stream=stream)

    def allgather(self, s: torch.Tensor, r: torch.Tensor, *, stream: int) -> None:
        self._op("allgather", stream=stream)
        r.copy_(s.repeat(r.numel() // s.numel()).view_as(r))

    def reduce_scatter(self, s: torch.Tensor, r: torch.Tensor, op: Any, *, stream: int) -> None:
        self._op("reduce_scatter", op, stream=stream)
        r.copy_(s.flatten()[: r.numel()].view_as(r))

    def send(self, b: torch.Tensor, peer: int, *, stream: int) -> None:
        self._op("send", peer, b.numel(), stream=stream)

    def recv(self, b: torch.Tensor, peer: int, *, stream: int) -> None:
        self._op("recv", peer, b.numel(), stream=stream)
        b.fill_(100 + peer)

    def get_async_error(self) -> int:
        status = self.statuses.popleft() if self.statuses else self.default
        self.log.add("poll", status)
        return status

    def get_last_error(self) -> str:
        return "fake last error"

    def abort(self) -> None:
        self.log.add("abort")
        if self.abort_delay:
            time.sleep(self.abort_delay)
        self.aborted = True

    def finalize(self) -> None:
        self.log.add("finalize")
        self.finalized = True

    def destroy(self) -> None:
        self.log.add("destroy")
        self.destroyed = True

    def shrink(self, exclude: list[int], config: Any, flag: Any) -> "FakeComm":
        self.log.add("shrink", tuple(exclude), flag)
        return FakeComm(self.log)


class FakeLib:
    """Stands in for :class:`nccl.NcclLib` (the nccl4py module functions)."""

    def __init__(self, log: Log, comm: FakeComm | None = None) -> None:
        self.log = log
        self.comm = comm
        self.inits: list[tuple[int, int, bytes]] = []

    def unique_id(self) -> bytes:
        return bytes(range(128))

    def init(self, nranks: int, rank: int, uid: bytes) -> FakeComm:
        self.inits.append((nranks, rank, uid))
        assert self.comm is not None
        return self.comm

    def redop(self, op: ReduceOp) -> str:
        return op.name

    def group_start(self) -> None:
        self.log.add("group_start")

    def group_end(self) -> None:
        self.log.add("group_end")

    def error_string(self, status: int) -> str:
        return f"fake error text {status}"

    def shrink(self, comm: FakeComm, exclude: list[int], abort_pending: bool) -> FakeComm:
        return comm.shrink(exclude, None, "ABORT" if abort_pending else "DEFAULT")


_backends: list[nccl.NcclBackend] = []


@pytest.fixture(autouse=True)
def _close_backends() -> Any:
    yield
    while _backends:
        be = _backends.pop()
        be.abort() if be._aborted else be.close()


def make(
    *, ws: int = 2, rank: int = 0, statuses: Any = (), default: int = nccl.SUCCESS,
    auto: bool = True, **kw: Any,
) -> tuple[nccl.NcclBackend, FakeComm, FakeRuntime, Log]:
    log = Log()
    comm = FakeComm(log, statuses, default)
    rt = FakeRuntime(log, auto)
    be = nccl.NcclBackend(
        comm, rank=rank, world_size=ws, device=torch.device("cpu"), lib=FakeLib(log, comm),
        runtime=rt, **kw,
    )
    be.bind(Ledger(rank, deadlines=deadline_service(), waker_for=lambda loop: None, on_abort=lambda exc: None))
    _backends.append(be)
    return be, comm, rt, log


def issue(be: nccl.NcclBackend, spec: OpSpec, value: Any = None, seq: int = 1) -> Work:
    if not spec.timeout:
        spec.timeout = 10.0
    work = Work(spec.kind.value, seq, value=value)
    be.submit(spec, work)
    return work


def until(pred: Any, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@no_cuda
def test_init_nccl_without_cuda_is_backend_unavailable() -> None:
    async def main() -> None:
        await ac.init(backend="nccl", rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())

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
        comm = await ac.init(backend="auto", rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())
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


class Rdv:
    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size

    def prefixed(self, prefix: str) -> Any:
        return dist.PrefixStore(prefix, self.store)


def test_create_exchanges_unique_id_and_polls_init() -> None:
    log = Log()
    store = dist.HashStore()
    comm0 = FakeComm(log, statuses=[nccl.IN_PROGRESS] * 5)
    lib0 = FakeLib(log, comm0)
    comm1 = FakeComm(log)
    lib1 = FakeLib(log, comm1)

    async def main() -> tuple[nccl.NcclBackend, nccl.NcclBackend]:
        kw: dict[str, Any] = dict(runtime_factory=lambda i: FakeRuntime(log), device_count=lambda: 2)
        b1 = asyncio.ensure_future(nccl.create(Rdv(store, 1, 2), "c/nccl/", 1, 5.0, lib=lib1, **kw))
        await asyncio.sleep(0.05)
        assert not b1.done()  # rank 1 waits for rank 0's id, off the loop
        b0 = await nccl.create(Rdv(store, 0, 2), "c/nccl/", 0, 5.0, lib=lib0, **kw)
        return b0, await b1

    b0, b1 = asyncio.run(main())
    _backends.extend([b0, b1])
    assert lib0.inits == [(2, 0, bytes(range(128)))] and lib1.inits == [(2, 1, bytes(range(128)))]
    assert not comm0.statuses  # polled until InProgress cleared
    assert (b0.name, b0.device_type, b0.device, b1.device) == ("nccl", "cuda", torch.device("cuda", 0), torch.device("cuda", 1))


def test_create_times_out_and_aborts_the_half_built_comm() -> None:
    log = Log()
    comm = FakeComm(log, default=nccl.IN_PROGRESS)
    lib = FakeLib(log, comm)
    t0 = time.monotonic()
    with pytest.raises(ac.CollectiveTimeout):
        asyncio.run(nccl.create(Rdv(dist.HashStore(), 0, 2), "x/", 0, 0.3, lib=lib,
                                runtime_factory=lambda i: FakeRuntime(log), device_count=lambda: 1))
    assert time.monotonic() - t0 < 3
    until(lambda: comm.aborted)


def test_create_peer_never_publishes_id_times_out() -> None:
    log = Log()
    lib = FakeLib(log, FakeComm(log))
    with pytest.raises(ac.CollectiveTimeout):
        asyncio.run(nccl.create(Rdv(dist.HashStore(), 1, 2), "x/", 0, 0.3, lib=lib,
                                runtime_factory=lambda i: FakeRuntime(log), device_count=lambda: 1))
    assert lib.inits == []


def test_create_bad_device_is_invalid_argument() -> None:
    log = Log()
    lib = FakeLib(log, FakeComm(log))
    with pytest.raises(ac.InvalidArgument):
        asyncio.run(nccl.create(Rdv(dist.HashStore(), 0, 1), "x/", "cpu", 5.0, lib=lib,
                                runtime_factory=lambda i: FakeRuntime(log), device_count=lambda: 1))
    assert lib.inits == []


def test_create_init_error_is_backend_unavailable_with_cause() -> None:
    log = Log()
    comm = FakeComm(log, statuses=[nccl.IN_PROGRESS, 3])
    with pytest.raises(ac.BackendUnavailable) as info:
        asyncio.run(nccl.create(Rdv(dist.HashStore(), 0, 1), "x/", 0, 5.0, lib=FakeLib(log, comm),
                                runtime_factory=lambda i: FakeRuntime(log), device_count=lambda: 1))
    assert isinstance(info.value.__cause__, nccl.NcclError) and info.value.__cause__.status == 3
    assert comm.aborted


# ========================================================================= launcher
def test_launches_in_submit_order_and_settles() -> None:
    be, comm, rt, log = make()
    works = [issue(be, OpSpec(OpKind.ALL_REDUCE, torch.full((3,), float(i))), seq=i) for i in range(50)]
    for w in works:
        w.wait(WAIT)
    assert [e[3] for e in log.kinds("allreduce")] == [float(i) for i in range(50)]
    assert all(w.done() and w.exception() is None for w in works)


def test_submit_order_across_threads_follows_the_issue_lock() -> None:
    be, comm, rt, log = make()
    lock = threading.Lock()
    issued: list[float] = []
    works: list[Work] = []

    def worker(k: int) -> None:
        for i in range(20):
            with lock:  # the communicator's lock
                v = float(k * 100 + i)
                works.append(issue(be, OpSpec(OpKind.ALL_REDUCE, torch.full((1,), v))))
                issued.append(v)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w in works:
        w.wait(WAIT)
    assert [e[3] for e in log.kinds("allreduce")] == issued


def test_stream_order_ready_event_and_done_after_in_progress_clears() -> None:
    be, comm, rt, log = make(statuses=[nccl.IN_PROGRESS] * 4)
    t = torch.ones(4)
    w = issue(be, OpSpec(OpKind.ALL_REDUCE, t), value=t)
    assert w.wait(WAIT) is t
    items = log.items
    ready, done = rt.events.made[0].name, rt.events.made[1].name
    i_rec_ready = items.index(("record", ready, "caller"))  # on the caller's stream, at call time
    i_wait = items.index(("wait", "comm", ready))
    i_op = next(i for i, e in enumerate(items) if e[0] == "allreduce")
    polls = [i for i, e in enumerate(items) if e[0] == "poll"]
    i_done = items.index(("record", done, "comm"))
    assert i_rec_ready < i_wait < i_op < polls[0]
    assert [items[i][1] for i in polls[:5]] == [nccl.IN_PROGRESS] * 4 + [nccl.SUCCESS]
    assert polls[4] < i_done  # never recorded while NCCL could still defer the launch
    assert ("protect", t.data_ptr()) in items
    assert ready in rt.events.released and done in rt.events.released


def test_async_error_fails_work_with_comm_aborted_and_cause() -> None:
    be, comm, rt, log = make(statuses=[nccl.IN_PROGRESS, 3])
    w = issue(be, OpSpec(OpKind.ALL_REDUCE, torch.ones(2)))
    with pytest.raises(ac.CommAborted) as info:
        w.wait(WAIT)
    assert not isinstance(info.value, ac.PeerFailure)
    assert isinstance(info.value.__cause__, nccl.NcclError) and info.value.__cause__.status == 3
    assert "fake last error" in str(info.value) and "fake error text 3" in str(info.value)
    assert not log.kinds("record") or all(e[2] != "comm" for e in log.kinds("record"))


def test_remote_error_is_peer_failure() -> None:
    be, comm, rt, log = make(statuses=[nccl.REMOTE_ERROR])
    w = issue(be, OpSpec(OpKind.ALL_REDUCE, torch.ones(2)))
    with pytest.raises(ac.PeerFailure):
        w.wait(WAIT)


def test_error_raised_by_the_call_fails_work_with_cause() -> None:
    be, comm, rt, log = make()
    comm.raise_on_op = RuntimeError("boom")
    w = issue(be, OpSpec(OpKind.ALL_REDUCE, torch.ones(2)))
    with pytest.raises(ac.CommAborted, match="boom") as info:
        w.wait(WAIT)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_stuck_in_progress_is_collective_timeout() -> None:
    be, comm, rt, log = make(default=nccl.IN_PROGRESS)
    w = issue(be, OpSpec(OpKind.ALL_REDUCE, torch.ones(2), timeout=0.2), seq=7)
    with pytest.raises(ac.CollectiveTimeout) as info:
        w.wait(WAIT)
    assert (info.value.seq, info.value.op) == (7, "all_reduce")


def test_async_error_while_in_flight_is_noticed_by_the_health_check() -> None:
    be, comm, rt, log = make(auto=False, health_interval=0.02)
    w = issue(be, OpSpec(OpKind.ALL_REDUCE, torch.ones(2)))
    until(lambda: len(log.kinds("record")) == 2)  # launched, kernel "running" forever
    comm.default = nccl.REMOTE_ERROR
    with pytest.raises(ac.PeerFailure):
        w.wait(WAIT)
    rt.events.made[1].fire()  # a late completion must not turn it into a success
    time.sleep(0.05)
    assert isinstance(w.exception(), ac.PeerFailure)


def test_batch_is_one_group_and_one_done_event() -> None:
    be, comm, rt, log = make()
    specs = [OpSpec(OpKind.ALL_REDUCE, torch.full((2,), float(i)), timeout=10.0) for i in range(3)]
    works = [Work("all_reduce", i + 1) for i in range(3)]
    be.submit_batch(specs, works)
    for w in works:
        w.wait(WAIT)
    names = [e[0] for e in log.items if e[0] in ("group_start", "group_end", "allreduce", "record")]
    assert names == ["record", "group_start", "allreduce", "allreduce", "allreduce", "group_end", "record"]
    assert len(rt.events.made) == 2


def test_integer_avg_is_sum_then_floor_divide_after_the_kernel() -> None:
    be, comm, rt, log = make(ws=2)
    t = torch.tensor([5, -3, 8], dtype=torch.int32)
    w = issue(be, OpSpec(OpKind.ALL_REDUCE, t, reduce_op=ReduceOp.AVG), value=t)
    assert w.wait(WAIT).tolist() == [2, -2, 4]  # the fake "sum" is the identity
    assert log.kinds("allreduce")[0][1] == "SUM"
    f = torch.tensor([5.0, -3.0])
    issue(be, OpSpec(OpKind.ALL_REDUCE, f, reduce_op=ReduceOp.AVG)).wait(WAIT)
    assert log.kinds("allreduce")[1][1] == "AVG" and f.tolist() == [5.0, -3.0]  # native ncclAvg


def test_reduce_scatter_and_reduce_avg_fixups() -> None:
    be, comm, rt, log = make(ws=2, rank=1)
    inp, out = torch.tensor([7, 9, 1, 1]), torch.zeros(2, dtype=torch.int64)
    issue(be, OpSpec(OpKind.REDUCE_SCATTER, inp, out, reduce_op=ReduceOp.AVG)).wait(WAIT)
    assert out.tolist() == [3, 4]
    t = torch.tensor([9])
    issue(be, OpSpec(OpKind.REDUCE, t, reduce_op=ReduceOp.AVG, peer=0)).wait(WAIT)
    assert t.tolist() == [9]  # not the root: no fix-up
    issue(be, OpSpec(OpKind.REDUCE, t, reduce_op=ReduceOp.AVG, peer=1)).wait(WAIT)
    assert t.tolist() == [4]


def test_bool_and_complex_reductions() -> None:
    be, comm, rt, log = make()
    issue(be, OpSpec(OpKind.ALL_REDUCE, torch.tensor([True, False]), reduce_op=ReduceOp.SUM)).wait(WAIT)
    issue(be, OpSpec(OpKind.ALL_REDUCE, torch.tensor([True, False]), reduce_op=ReduceOp.PROD)).wait(WAIT)
    issue(be, OpSpec(OpKind.ALL_REDUCE, torch.ones(2, dtype=torch.complex64), reduce_op=ReduceOp.SUM)).wait(WAIT)
    ops = [(e[1], e[2]) for e in log.kinds("allreduce")]
    assert ops == [("MAX", torch.uint8), ("MIN", torch.uint8), ("SUM", torch.float32)]


def test_unsupported_dtype_is_refused_at_the_call() -> None:
    be, comm, rt, log = make()
    w = Work("all_reduce", 1)
    with pytest.raises(ac.InvalidArgument):
        be.submit(OpSpec(OpKind.ALL_REDUCE, torch.ones(2, dtype=torch.int16), timeout=1.0), w)
    with pytest.raises(ac.InvalidArgument):
        be.submit(OpSpec(OpKind.ALL_REDUCE, torch.ones(2, dtype=torch.complex64), reduce_op=ReduceOp.MAX, timeout=1.0), w)
    assert rt.events.made == [] and log.items == []
    # data movement works for any dtype (as bytes)
    issue(be, OpSpec(OpKind.BROADCAST, torch.ones(3, dtype=torch.int16), peer=0)).wait(WAIT)
    assert log.kinds("broadcast") == [("broadcast", 0, torch.uint8)]


def test_wrong_device_is_refused() -> None:
    be, comm, rt, log = make()
    with pytest.raises(ac.InvalidArgument, match="meta"):
        be.submit(OpSpec(OpKind.ALL_REDUCE, torch.empty(2, device="meta"), timeout=1.0), Work("x", 1))


def test_all_to_all_gather_scatter_are_grouped_p2p() -> None:
    be, comm, rt, log = make(ws=2, rank=0)
    inp, out = torch.arange(4.0), torch.zeros(4)
    issue(be, OpSpec(OpKind.ALL_TO_ALL, inp, out)).wait(WAIT)
    seq = [e for e in log.items if e[0] in ("group_start", "group_end", "send", "recv")]
    assert seq == [("group_start",), ("send", 0, 2), ("recv", 0, 2), ("send", 1, 2), ("recv", 1, 2), ("group_end",)]

    be, comm, rt, log = make(ws=3, rank=1)
    inp, out = torch.full((2,), 7.0), torch.zeros(6)
    issue(be, OpSpec(OpKind.GATHER, inp, out, peer=1)).wait(WAIT)
    assert out.tolist() == [100, 100, 7, 7, 102, 102]  # own chunk copied locally, after the recvs
    seq = [e for e in log.items if e[0] in ("group_start", "group_end", "send", "recv")]
    assert seq == [("group_start",), ("recv", 0, 2), ("recv", 2, 2), ("group_end",)]

    be, comm, rt, log = make(ws=3, rank=2)
    out = torch.zeros(2)
    issue(be, OpSpec(OpKind.SCATTER, None, out, peer=0)).wait(WAIT)
    assert out.tolist() == [100, 100] and log.kinds("recv") == [("recv", 0, 2)]
    issue(be, OpSpec(OpKind.GATHER, torch.ones(2), None, peer=0)).wait(WAIT)
    assert log.kinds("send") == [("send", 0, 2)]

    be, comm, rt, log = make(ws=3, rank=0)
    inp, out = torch.arange(6.0), torch.zeros(2)
    issue(be, OpSpec(OpKind.SCATTER, inp, out, peer=0)).wait(WAIT)
    assert out.tolist() == [0.0, 1.0] and log.kinds("send") == [("send", 1, 2), ("send", 2, 2)]


def test_other_ops_and_barrier() -> None:
    be, comm, rt, log = make(ws=2, rank=0)
    inp, out = torch.tensor([1.0, 2.0]), torch.zeros(4)
    assert issue(be, OpSpec(OpKind.ALL_GATHER, inp, out), value=out).wait(WAIT).tolist() == [1, 2, 1, 2]
    issue(be, OpSpec(OpKind.SEND, torch.ones(3), peer=1)).wait(WAIT)
    r = torch.zeros(3)
    issue(be, OpSpec(OpKind.RECV, r, peer=1)).wait(WAIT)
    assert r.tolist() == [101, 101, 101]
    assert issue(be, OpSpec(OpKind.BARRIER)).wait(WAIT) is None
    assert log.kinds("allreduce")[-1][1:3] == ("SUM", torch.float32)


# ======================================================================= wait_stream
def test_wait_stream_before_launch_waits_for_the_recorded_event() -> None:
    be, comm, rt, log = make(auto=False)
    comm.gate = threading.Event()  # the launcher is stuck in the NCCL call
    w = issue(be, OpSpec(OpKind.ALL_REDUCE, torch.ones(2)))
    user = FakeStream("user", log)
    returned = threading.Event()
    th = threading.Thread(target=lambda: (w.wait_stream(user), returned.set()))
    th.start()
    time.sleep(0.1)
    assert not returned.is_set()  # an unrecorded event would order nothing
    comm.gate.set()
    assert returned.wait(WAIT)
    th.join()
    done = rt.events.made[1].name
    assert log.index("record", done, "comm") < log.index("wait", "user", done)
    rt.events.made[1].fire()
    w.wait(WAIT)


def test_wait_stream_after_launch_and_after_done() -> None:
    be, comm, rt, log = make(auto=False)
    w = issue(be, OpSpec(OpKind.ALL_REDUCE, torch.ones(2)))
    done = rt.events.made[1]
    until(lambda: ("record", done.name, "comm") in log.items)
    w.wait_stream()  # default: the current stream
    assert ("wait", "current", done.name) in log.items
    done.fire()
    w.wait(WAIT)
    n = len(log.kinds("wait"))
    w.wait_stream(FakeStream("late", log))
    assert len(log.kinds("wait")) == n  # settled: nothing left to wait for


# ============================================================================= abort
def test_abort_stops_launcher_and_never_settles_success() -> None:
    be, comm, rt, log = make(auto=False)
    w1 = issue(be, OpSpec(OpKind.ALL_REDUCE, torch.ones(2)))
    until(lambda: len(log.kinds("record")) == 2)
    t0 = time.monotonic()
    be.abort()
    assert time.monotonic() - t0 < 1.0
    assert comm.aborted and log.kinds("abort") == [("abort",)]
    for ev in rt.events.made:
        ev.fire()
    time.sleep(0.1)
    assert not w1.done()  # the communicator fails it; the backend never reports success
    with pytest.raises(ac.CommAborted):
        be.submit(OpSpec(OpKind.ALL_REDUCE, torch.ones(2), timeout=1.0), Work("all_reduce", 2))
    until(lambda: not be._launcher.is_alive())
    be.abort()  # idempotent
    be.close()
    assert len(log.kinds("abort")) == 1 and not comm.finalized


def test_abort_drops_queued_jobs_unlaunched() -> None:
    be, comm, rt, log = make()
    comm.gate = threading.Event()
    works = [issue(be, OpSpec(OpKind.ALL_REDUCE, torch.full((1,), float(i)))) for i in range(5)]
    time.sleep(0.05)
    threading.Timer(0.1, comm.gate.set).start()
    be.abort()
    until(lambda: not be._launcher.is_alive())
    assert len(log.kinds("allreduce")) <= 1
    assert not any(w.done() and w.exception() is None for w in works)


def test_abort_is_bounded_when_nccl_abort_hangs() -> None:
    be, comm, rt, log = make(abort_timeout=0.3)
    comm.abort_delay = 3.0
    t0 = time.monotonic()
    be.abort()
    assert time.monotonic() - t0 < 1.0


def test_close_finalizes_destroys_and_stops_threads() -> None:
    before = threading.active_count()
    be, comm, rt, log = make()
    issue(be, OpSpec(OpKind.ALL_REDUCE, torch.ones(2))).wait(WAIT)
    watcher_thread = be._watcher.thread
    be.close()
    be.close()  # idempotent
    assert comm.finalized and comm.destroyed and not comm.aborted
    assert log.index("finalize") < log.index("destroy")
    assert not be._launcher.is_alive() and not watcher_thread.is_alive()
    assert threading.active_count() == before


def test_close_falls_back_to_abort_when_finalize_fails() -> None:
    be, comm, rt, log = make()
    comm.default = 3
    be.close()
    assert comm.aborted and not comm.destroyed


def test_shrink_renumbers_and_uses_nccl_shrink() -> None:
    be, comm, rt, log = make(ws=4, rank=2)
    new = be.shrink([1])
    new.bind(be.sink)  # the new communicator's ledger, in a real shrink
    _backends.append(new)
    assert (new.rank, new.world_size) == (1, 3)
    assert log.kinds("shrink") == [("shrink", (1,), "DEFAULT")]
    issue(new, OpSpec(OpKind.ALL_REDUCE, torch.ones(1))).wait(WAIT)
    with pytest.raises(ac.InvalidArgument):
        be.shrink([2])
    be.abort()
    with pytest.raises(ac.CommAborted):
        be.shrink([1])


# ===================================================== through the real Communicator
def _communicator(be: nccl.NcclBackend, timeout: float = 10.0) -> Communicator:
    from streams import loop_waker

    return Communicator(
        rank=be.rank, world_size=be.world_size, backends={"cpu": be}, backend_name="nccl",
        device=torch.device("cpu"), timeout=timeout, waker_factory=loop_waker,
    )


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_communicator_awaits_and_aborts(loop: str) -> None:
    be, comm, rt, log = make(auto=False)

    async def main() -> None:
        c = _communicator(be)
        t = torch.ones(3)
        w = c.all_reduce(t)
        until(lambda: len(log.kinds("record")) == 2)
        rt.events.made[1].fire()
        assert await asyncio.wait_for(w, WAIT) is t
        w2 = c.all_reduce(t)
        until(lambda: len(log.kinds("record")) == 4)
        c.abort("test")
        with pytest.raises(ac.CommAborted):
            await w2
        assert comm.aborted and be._aborted
        rt.events.made[3].fire()
        await asyncio.sleep(0.05)
        assert isinstance(w2.exception(), ac.CommAborted)
        await c.close()

    if loop == "uvloop":
        pytest.importorskip("uvloop").run(main())
    else:
        asyncio.run(main())


def test_communicator_deadline_aborts_the_nccl_comm() -> None:
    be, comm, rt, log = make(default=nccl.IN_PROGRESS)

    async def main() -> None:
        c = _communicator(be, timeout=0.3)
        w = c.all_reduce(torch.ones(2))
        with pytest.raises(ac.CollectiveTimeout):
            await asyncio.wait_for(w, WAIT)
        until(lambda: comm.aborted)
        assert c.state == "aborted"
        await c.close()

    asyncio.run(main())


def test_communicator_close_releases_everything() -> None:
    before = threading.active_count()
    be, comm, rt, log = make()

    async def main() -> None:
        c = _communicator(be)
        await c.all_reduce(torch.ones(2))
        await c.close()

    asyncio.run(main())
    assert comm.destroyed and threading.active_count() <= before + 1  # + the default executor's idle worker, if any


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
        port = free_port()
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
            async with ac.init(backend="nccl", rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port()) as c:
                assert c.device == torch.device("cuda", 0) and c.backend == "nccl"
        finally:
            del os.environ["LOCAL_RANK"]

    asyncio.run(main())


def test_backend_class_is_exported() -> None:
    assert nccl.backend_class is nccl.NcclBackend
    assert issubclass(nccl.NcclBackend, ac._core.backend.Backend) if hasattr(ac, "_core") else True
    assert streams.EventWatcher is not None
