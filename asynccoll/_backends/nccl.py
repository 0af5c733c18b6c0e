"""NCCL backend through nccl4py (non-blocking communicator, CUDA-event completion).

How one op travels (``submit`` runs on the caller's thread and stays cheap):

1. ``submit`` records a *ready* event on the caller's current stream (the op must
   see everything the caller queued before the call), protects the tensors from
   the caching allocator (``record_stream`` on the comm stream), and queues a job.
2. One *launcher* thread per backend takes jobs in submit order: the comm stream
   waits for the ready event, the NCCL call(s) are enqueued on the comm stream
   (a batch or a grouped op inside one ``ncclGroupStart/End``), then
   ``ncclCommGetAsyncError`` is polled until the communicator leaves
   ``ncclInProgress``. Only then is the *done* event recorded: a non-blocking
   communicator may defer the kernel launch, and an event recorded before that
   could fire before the collective ran.
3. One :class:`streams.EventWatcher` thread per backend waits for done events in
   order and settles the Works; never on the event loop.

The launcher also polls ``ncclCommGetAsyncError`` every ``health_interval``
seconds while ops are in flight, so an asynchronous NCCL error (a dead peer)
fails the pending Works with :class:`PeerFailure` / :class:`CommAborted`, the
NCCL error kept as ``__cause__``.

Everything that touches nccl4py goes through :class:`NcclLib`, everything that
touches CUDA through :class:`CudaRuntime` (both in ``nccl_runtime.py``); tests
substitute fakes for both.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import queue
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch

from .._core.backend import Backend
from .._core.errors import (
    BackendUnavailable,
    CollectiveTimeout,
    CommAborted,
    InvalidArgument,
    PeerFailure,
)
from .._core.ops import OpKind, OpSpec, ReduceOp
from .._core.work import Bundle, Work
from .nccl_runtime import (  # noqa: F401 - some re-exported for tests and callers
    _COMPLEX,
    _NCCL_DTYPES,
    _PEER_ERRORS,
    _REDUCING,
    IN_PROGRESS,
    REMOTE_ERROR,
    SUCCESS,
    CudaRuntime,
    NcclError,
    NcclLib,
    _abort_quietly,
    _raw,
    _wait_ready,
    device_index,
    missing,
)

# ------------------------------------------------------------------------- jobs
_QUEUED, _LAUNCHED, _FAILED = 0, 1, 2


class _Job:
    """One launch: a single op, or a coalesced batch run as one NCCL group."""

    __slots__ = ("specs", "works", "ready", "done", "state", "waiter", "timeout")

    def __init__(self, specs: Sequence[OpSpec], works: Sequence[Work], ready: Any, done: Any) -> None:
        self.specs = specs
        self.works = works
        self.ready = ready
        self.done = done
        self.state = _QUEUED
        self.waiter: threading.Event | None = None
        self.timeout = max((s.timeout for s in specs), default=0.0) or 60.0


_STOP = object()


class NcclBackend(Backend):
    """Runs OpSpecs on one non-blocking nccl4py communicator, on one CUDA device."""

    name = "nccl"
    device_type = "cuda"

    def __init__(
        self,
        comm: Any,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        lib: Any,
        runtime: Any,
        watcher: Any = None,
        health_interval: float = 0.1,
        abort_timeout: float = 2.0,
        close_timeout: float = 10.0,
    ) -> None:
        import streams

        self.rank = rank
        self.world_size = world_size
        self.device = device
        self._comm = comm
        self._lib = lib
        self._rt = runtime
        self._watcher = watcher or streams.EventWatcher(f"nccl{device.index}")
        self._health_interval = health_interval
        self._abort_timeout = abort_timeout
        self._close_timeout = close_timeout
        # Serialises every NCCL call on the communicator against abort(): the
        # launcher never touches a communicator that abort() has freed.
        self._nccl_lock = threading.Lock()
        self._lock = threading.Lock()  # _inflight, _closed
        self._inflight: collections.deque[_Job] = collections.deque()
        self._aborted = False
        self._closed = False
        self._broken = False  # an NCCL error was seen: close() aborts instead of finalizing
        self._abort_done: threading.Event | None = None
        self._barrier_buf: torch.Tensor | None = None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._launcher = threading.Thread(
            target=self._run, name=f"asynccoll-nccl-launcher-{device.index}", daemon=True
        )
        self._launcher.start()

    def __repr__(self) -> str:
        state = "aborted" if self._aborted else "closed" if self._closed else "ok"
        return f"<NcclBackend rank={self.rank}/{self.world_size} {self.device} {state}>"

    # --------------------------------------------------------------- submit
    def submit(self, spec: OpSpec, work: Work) -> None:
        self.submit_batch((spec,), (work,))

    def submit_batch(self, specs: Sequence[OpSpec], works: Sequence[Work]) -> None:
        """Queue ``specs`` as one launch: one NCCL group, one completion event."""
        if not specs:
            return
        if self._aborted or self._closed:
            raise CommAborted(f"NCCL backend is {'aborted' if self._aborted else 'closed'}")
        tensors: list[torch.Tensor] = []
        for spec in specs:
            self._check(spec, tensors)
        rt = self._rt
        ready = rt.events.acquire()
        ready.record(rt.caller_stream(tensors[0] if tensors else None))
        for t in tensors:
            rt.protect(t)
        job = _Job(list(specs), list(works), ready, rt.events.acquire())
        hook = lambda stream, job=job: self._wait_stream(job, stream)  # noqa: E731
        for work in works:
            work._stream_hook = hook
        self._queue.put(job)

    def _check(self, spec: OpSpec, tensors: list[torch.Tensor]) -> None:
        """Refuse (InvalidArgument) what NCCL cannot run, before anything starts."""
        for t in (spec.tensor, spec.output):
            if t is None:
                continue
            if t.device != self.device:
                raise InvalidArgument(f"{spec.kind.value}: tensor on {t.device}, but this NCCL communicator uses {self.device}")
            dt = t.dtype
            if spec.kind in _REDUCING:
                if dt in _COMPLEX and spec.reduce_op not in (ReduceOp.SUM, ReduceOp.AVG):
                    raise InvalidArgument(f"{spec.kind.value}: {spec.reduce_op.name} is not defined for {dt}")
                if dt not in _NCCL_DTYPES and dt not in _COMPLEX:
                    raise InvalidArgument(f"{spec.kind.value}: NCCL cannot reduce {dt}")
            tensors.append(t)

    # --------------------------------------------------------------- launcher
    def _run(self) -> None:
        try:
            self._rt.bind_thread()
        except Exception:
            pass
        get = self._queue.get
        while True:
            try:
                job = get(timeout=self._health_interval) if self._inflight else get()
            except queue.Empty:
                self._health_check()
                continue
            if job is _STOP or self._aborted:
                return
            if self._broken:  # never call into a communicator that reported an error
                self._fail_job(job, CommAborted("the NCCL communicator failed earlier"))
                continue
            try:
                self._launch(job)
            except Exception as exc:  # e.g. a CUDA error on the comm stream
                self._fail_job(job, self._translate(exc, job))

    def _launch(self, job: _Job) -> None:
        rt = self._rt
        rt.comm_stream.wait_event(job.ready)
        # A stream wait already enqueued is not affected by re-recording the event.
        rt.events.release(job.ready)
        job.ready = None
        post: list[Callable[[], object]] = []
        handle = rt.handle(rt.comm_stream)
        try:
            with self._nccl_lock:
                if self._aborted:
                    return
                grouped = len(job.specs) > 1
                if grouped:
                    self._lib.group_start()
                try:
                    for spec in job.specs:
                        self._enqueue(spec, handle, post)
                finally:
                    if grouped:
                        self._lib.group_end()
        except Exception as exc:
            self._fail_job(job, self._translate(exc, job))
            return
        status = self._poll(time.monotonic() + job.timeout)
        if status is None:  # aborted meanwhile
            return
        if status == IN_PROGRESS:
            w = job.works[0]
            self._fail_job(job, CollectiveTimeout(
                f"{w.op} (seq {w.seq}): NCCL stayed in ncclInProgress for {job.timeout} s",
                seq=w.seq, op=w.op))
            return
        if status != SUCCESS:
            self._fail_job(job, self._async_failure(status))
            return
        try:
            if post:  # local copies and integer-AVG fix-ups, after the NCCL kernels
                with rt.on_comm_stream():
                    for fn in post:
                        fn()
            job.done.record(rt.comm_stream)
        except Exception as exc:
            self._fail_job(job, self._translate(exc, job))
            return
        # _inflight keeps the job, hence its tensors, referenced until the done event
        # fires (CuPy memory is not covered by record_stream).
        with self._lock:
            self._inflight.append(job)
        self._mark(job, _LAUNCHED)
        try:
            self._watcher.watch(job.done, self._completed, job, on_fail=functools.partial(self._watch_failed, job))
        except Exception as exc:  # watcher closed by abort/close
            self._watch_failed(job, exc)

    def _enqueue(self, spec: OpSpec, stream: int, post: list[Callable[[], object]]) -> None:
        """Issue the NCCL call(s) of one op (the caller holds ``_nccl_lock``)."""
        comm, kind, ws = self._comm, spec.kind, self.world_size
        t, out = spec.tensor, spec.output
        if kind is OpKind.ALL_REDUCE:
            v, op = self._reducible(t, spec.reduce_op, post)
            comm.allreduce(v, v, op, stream=stream)
        elif kind is OpKind.REDUCE:
            v, op = self._reducible(t, spec.reduce_op, post if spec.peer == self.rank else [])
            comm.reduce(v, v, op, spec.peer, stream=stream)
        elif kind is OpKind.REDUCE_SCATTER:
            vi, op = self._reducible(t, spec.reduce_op, [])
            vo, _ = self._reducible(out, spec.reduce_op, post)
            comm.reduce_scatter(vi, vo, op, stream=stream)
        elif kind is OpKind.BROADCAST:
            v = _raw(t)
            comm.broadcast(v, v, spec.peer, stream=stream)
        elif kind is OpKind.ALL_GATHER:
            comm.allgather(_raw(t), _raw(out), stream=stream)
        elif kind is OpKind.ALL_TO_ALL:
            ins, outs = t.chunk(ws), out.chunk(ws)
            self._lib.group_start()
            try:
                for p in range(ws):
                    comm.send(_raw(ins[p]), p, stream=stream)
                    comm.recv(_raw(outs[p]), p, stream=stream)
            finally:
                self._lib.group_end()
        elif kind is OpKind.GATHER:
            root = spec.peer
            if self.rank != root:
                comm.send(_raw(t), root, stream=stream)
            else:
                outs = out.chunk(ws)
                self._lib.group_start()
                try:
                    for p in range(ws):
                        if p != root:
                            comm.recv(_raw(outs[p]), p, stream=stream)
                finally:
                    self._lib.group_end()
                post.append(functools.partial(outs[root].copy_, t))
        elif kind is OpKind.SCATTER:
            root = spec.peer
            if self.rank != root:
                comm.recv(_raw(out), root, stream=stream)
            else:
                ins = t.chunk(ws)
                self._lib.group_start()
                try:
                    for p in range(ws):
                        if p != root:
                            comm.send(_raw(ins[p]), p, stream=stream)
                finally:
                    self._lib.group_end()
                post.append(functools.partial(out.copy_, ins[root]))
        elif kind is OpKind.SEND:
            comm.send(_raw(t), spec.peer, stream=stream)
        elif kind is OpKind.RECV:
            comm.recv(_raw(t), spec.peer, stream=stream)
        elif kind is OpKind.BARRIER:
            buf = self._barrier_buf
            if buf is None:
                buf = self._barrier_buf = self._rt.scratch()
            comm.allreduce(buf, buf, self._lib.redop(ReduceOp.SUM), stream=stream)
        else:  # pragma: no cover - OpKind is closed
            raise InvalidArgument(f"unsupported op {kind}")

    def _reducible(self, t: torch.Tensor, op: ReduceOp, post: list[Callable[[], object]]) -> tuple[torch.Tensor, Any]:
        """The tensor view and NCCL op to reduce ``t`` with ``op``; queues fix-ups on ``post``."""
        if t.dtype is torch.bool:  # as uint8: SUM/MAX = logical or, PROD/MIN = logical and
            op = ReduceOp.MAX if op in (ReduceOp.SUM, ReduceOp.MAX) else ReduceOp.MIN
            return t.view(torch.uint8), self._lib.redop(op)
        if t.dtype in _COMPLEX:
            t = torch.view_as_real(t)
        if op is ReduceOp.AVG and not t.is_floating_point():
            ws = self.world_size
            post.append(lambda: t.div_(ws, rounding_mode="floor"))
            op = ReduceOp.SUM
        return t, self._lib.redop(op)

    def _poll(self, deadline: float) -> int | None:
        """Poll ``get_async_error`` until it leaves InProgress; None once aborted."""
        delay = 0.0
        while True:
            with self._nccl_lock:
                if self._aborted:
                    return None
                try:
                    status = int(self._comm.get_async_error())
                except Exception:  # the communicator is unusable
                    status = 3
            if status != IN_PROGRESS or time.monotonic() > deadline:
                return status
            time.sleep(delay)
            delay = min(max(delay * 2, 1e-5), 1e-3)

    def _health_check(self) -> None:
        with self._nccl_lock:
            if self._aborted:
                return
            try:
                status = int(self._comm.get_async_error())
            except Exception:
                status = 3
        if status not in (SUCCESS, IN_PROGRESS):
            with self._lock:
                jobs = list(self._inflight)
                self._inflight.clear()
            for job in jobs:
                self._fail_job(job, self._async_failure(status))

    # ------------------------------------------------------------ completion
    def _completed(self, job: _Job) -> None:
        """Watcher thread: the done event fired."""
        with self._lock:
            try:
                self._inflight.remove(job)
            except ValueError:
                return  # already failed by the health check
        job.specs = ()  # the Works' wait_stream hooks keep the job: drop its tensors
        if self._aborted:  # never report success after abort (the op may have been cut short)
            return
        self._rt.events.release(job.done)
        self.sink.succeed_all(job.works)

    def _watch_failed(self, job: _Job, exc: BaseException) -> None:
        with self._lock:
            if job in self._inflight:
                self._inflight.remove(job)
        if self._aborted:
            return
        err = CommAborted(f"waiting for NCCL completion failed: {exc}")
        err.__cause__ = exc
        self._fail_job(job, err)

    def _fail_job(self, job: _Job, exc: BaseException) -> None:
        self._broken = True
        job.specs = ()
        self._mark(job, _FAILED)
        if self._aborted:
            return
        works = list(job.works)
        self.sink.fail(works[0] if len(works) == 1 else Bundle(works, works[0].op), exc)

    def _mark(self, job: _Job, state: int) -> None:
        job.state = state
        waiter = job.waiter
        if waiter is not None:
            waiter.set()

    def _wait_stream(self, job: _Job, stream: Any) -> None:
        """``work.wait_stream``: make ``stream`` wait for the op's done event.

        The done event is recorded by the launcher, normally microseconds after
        ``submit``; if it has not been yet, this blocks the calling thread until it
        is (bounded by the op's timeout), since waiting on an unrecorded event
        would not order anything.
        """
        if job.works and job.works[0].done():
            return  # settled: the op has completed (or failed) already
        target = self._rt.target_stream(stream)
        if job.state == _QUEUED:
            with self._lock:
                if job.waiter is None:
                    job.waiter = threading.Event()
                waiter = job.waiter
            deadline = time.monotonic() + job.timeout
            while job.state == _QUEUED and not self._aborted:
                if not waiter.wait(min(0.05, max(0.0, deadline - time.monotonic()))) and time.monotonic() >= deadline:
                    break
        if job.state == _LAUNCHED:
            target.wait_event(job.done)

    # ------------------------------------------------------------------ errors
    def _async_failure(self, status: int) -> CommAborted:
        text = self._lib.error_string(status)
        last = ""
        with self._nccl_lock:
            if not self._aborted:
                try:
                    last = str(self._comm.get_last_error() or "")
                except Exception:
                    pass
        msg = f"NCCL reported error {status} ({text}) on rank {self.rank}" + (f": {last}" if last else "")
        exc: CommAborted = PeerFailure(msg) if status in _PEER_ERRORS else CommAborted(msg)
        exc.__cause__ = NcclError(status, text)
        return exc

    def _translate(self, exc: BaseException, job: _Job) -> BaseException:
        if isinstance(exc, (CommAborted, CollectiveTimeout)):
            return exc
        status = getattr(exc, "status", None)
        w = job.works[0]
        new: CommAborted
        if isinstance(status, int) and status in _PEER_ERRORS:
            new = PeerFailure(f"{w.op} (seq {w.seq}): a peer failed: {exc}")
        else:
            new = CommAborted(f"{w.op} (seq {w.seq}) failed in NCCL: {exc}")
        new.__cause__ = exc
        return new

    # ------------------------------------------------------------ lifecycle
    def abort(self) -> None:
        """Abort the NCCL communicator: bounded (``abort_timeout``), idempotent."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
        while True:  # drop queued jobs (and their tensors); the launcher never runs them
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not _STOP:
                job.specs = ()
        self._queue.put(_STOP)
        self._watcher.close(timeout=0, drain=False)
        with self._lock:
            for job in self._inflight:
                job.specs = ()
            self._inflight.clear()
        if self._closed or self._comm is None:
            return
        done = self._abort_done = threading.Event()
        threading.Thread(target=self._abort_comm, args=(done,), name="asynccoll-nccl-abort", daemon=True).start()
        done.wait(self._abort_timeout)

    def _abort_comm(self, done: threading.Event) -> None:
        # ncclCommAbort is made to unblock a hung NCCL call on another thread; do
        # not wait for the lock forever.
        got = self._nccl_lock.acquire(timeout=self._abort_timeout / 2)
        try:
            comm, self._comm = self._comm, None
            if comm is not None:
                comm.abort()
        except Exception:
            pass
        finally:
            if got:
                self._nccl_lock.release()
            done.set()

    def close(self) -> None:
        """Finalize (polled, bounded) and destroy the communicator; stop the threads.

        After an NCCL error, or if finalize does not complete within
        ``close_timeout``, the communicator is aborted instead (NCCL's advice).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(_STOP)
        if self._launcher is not threading.current_thread():
            self._launcher.join(5.0)
        self._watcher.close(timeout=5.0, drain=not self._aborted)
        self._barrier_buf = None
        if self._aborted:
            if self._abort_done is not None:
                self._abort_done.wait(self._abort_timeout)
            return
        comm = self._comm
        if comm is None:
            return
        if not self._broken:
            try:
                with self._nccl_lock:
                    comm.finalize()
                if self._poll(time.monotonic() + self._close_timeout) == SUCCESS:
                    with self._nccl_lock:
                        self._comm = None
                        comm.destroy()
                    return
            except Exception:
                pass
        with self._lock:
            self._aborted = True
        done = self._abort_done = threading.Event()
        threading.Thread(target=self._abort_comm, args=(done,), name="asynccoll-nccl-abort", daemon=True).start()
        done.wait(self._abort_timeout)

    def shrink(self, exclude: Sequence[int], *, timeout: float = 60.0) -> NcclBackend:
        """A new backend over ``ncclCommShrink`` without the ``exclude`` ranks (blocking).

        Every surviving rank must call it; excluded ranks must not. Ops still in
        flight here are aborted by NCCL (``CommShrinkFlag.ABORT``). Survivors are
        renumbered in order. Needs the NCCL communicator alive: after ``abort()``
        it has been freed, so build a fresh one with :func:`create` instead.
        Run it off the event loop.
        """
        if self._aborted or self._comm is None:
            raise CommAborted("the NCCL communicator was aborted; create a new one instead of shrinking")
        drop = sorted(set(int(r) for r in exclude))
        if self.rank in drop:
            raise InvalidArgument(f"rank {self.rank} cannot shrink a communicator it is excluded from")
        deadline = time.monotonic() + timeout
        with self._nccl_lock:
            new = self._lib.shrink(self._comm, drop, bool(self._inflight) or not self._queue.empty())
        # Non-blocking: both the parent and the child must leave ncclInProgress.
        status = self._poll(deadline)
        if status not in (SUCCESS, None):
            _abort_quietly(new)
            raise self._async_failure(status)
        _wait_ready(new, self._lib, deadline, "NCCL shrink")
        rank = self.rank - sum(1 for r in drop if r < self.rank)
        return NcclBackend(
            new, rank=rank, world_size=self.world_size - len(drop), device=self.device,
            lib=self._lib, runtime=self._rt, health_interval=self._health_interval,
            abort_timeout=self._abort_timeout,
        )


async def create(
    rdv: Any,
    prefix: str,
    device: Any,
    timeout: float,
    *,
    lib: Any = None,
    runtime_factory: Callable[[int], Any] | None = None,
    device_count: Callable[[], int] | None = None,
) -> NcclBackend:
    """Build the NCCL backend: unique id through the store, non-blocking init, polled.

    Rank 0 publishes the NCCL unique id under ``prefix`` in ``rdv``'s store; the
    others wait for it. Everything blocking (store waits, CUDA setup, the polled
    ``ncclCommInitRankConfig``) runs on an executor thread, bounded by ``timeout``
    (``CollectiveTimeout``). ``lib``/``runtime_factory``/``device_count`` are for tests.
    """
    if lib is None:
        reason = missing()
        if reason is not None:
            raise BackendUnavailable(reason)
        lib = NcclLib()
    store = rdv.prefixed(prefix)
    rank, ws = rdv.rank, rdv.world_size
    deadline = time.monotonic() + timeout
    cancel = threading.Event()

    def build() -> tuple[Any, Any, int]:
        count = (device_count or torch.cuda.device_count)()
        index = device_index(device, count, torch.cuda.current_device)
        runtime = (runtime_factory or CudaRuntime)(index)  # may create the CUDA context
        key = "unique_id"
        if rank == 0:
            store.set(key, lib.unique_id().hex())
        else:
            store.wait([key], timedelta(seconds=max(0.001, deadline - time.monotonic())))
        uid = bytes.fromhex(bytes(store.get(key)).decode())
        if cancel.is_set():
            raise CollectiveTimeout("NCCL init cancelled")
        ctx = torch.cuda.device(index) if runtime_factory is None else contextlib.nullcontext()
        with ctx:  # ncclCommInitRank binds to the calling thread's current device
            comm = lib.init(ws, rank, uid)
        _wait_ready(comm, lib, deadline, f"NCCL init (rank {rank}/{ws}, cuda:{index})", cancel)
        return comm, runtime, index

    def orphaned(f: asyncio.Future[Any]) -> None:
        # Nobody awaits it after a timeout: retrieve its outcome, abort a late communicator.
        if not f.cancelled() and f.exception() is None and cancel.is_set():
            threading.Thread(target=_abort_quietly, args=(f.result()[0],), daemon=True).start()

    loop = asyncio.get_running_loop()
    fut = loop.run_in_executor(None, build)
    fut.add_done_callback(orphaned)
    try:
        comm, runtime, index = await asyncio.wait_for(asyncio.shield(fut), timeout)
    except asyncio.TimeoutError:
        cancel.set()  # the executor thread aborts the half-built communicator
        raise CollectiveTimeout(f"NCCL init: peers did not arrive within {timeout} s") from None
    except asyncio.CancelledError:
        cancel.set()
        raise
    except (BackendUnavailable, CollectiveTimeout, CommAborted, InvalidArgument):
        raise
    except Exception as exc:
        low = str(exc).lower()
        if "timeout" in low or "timed out" in low:
            raise CollectiveTimeout(f"NCCL init: peers did not arrive within {timeout} s: {exc}") from exc
        raise BackendUnavailable(f"NCCL init failed on rank {rank}: {exc}") from exc
    return NcclBackend(
        comm, rank=rank, world_size=ws, device=torch.device("cuda", index), lib=lib, runtime=runtime
    )


backend_class = NcclBackend
