"""The NCCL backend: one non-blocking nccl4py communicator, one launcher thread.

How one op travels (``submit`` runs on the caller's thread and stays cheap):

1. ``submit`` records a *ready* event on the caller's current stream (the op must
   see everything the caller queued before the call), protects the tensors from
   the caching allocator (``record_stream`` on the comm stream), numbers the job
   (its *gate* number, see ``cuda.py``) and queues it.
2. The launcher thread takes jobs in submit order: the communicator's own comm
   stream waits for the ready event, the NCCL call(s) are enqueued (a batch or a
   P2P op inside one ``ncclGroupStart/End``), then ``ncclCommGetAsyncError`` is
   polled until the communicator leaves ``ncclInProgress``. Only then do the done
   event and the gate signal go on the comm stream: a non-blocking communicator
   may defer the kernel launch, and nothing may touch its stream before.
3. One :class:`streams.EventWatcher` thread waits for done events in order and
   settles the Works (then returns the events to the pool); never on the loop.

``work.wait_stream(s)`` never blocks: it enqueues a gate wait on ``s`` at once.
Outcomes go to the communicator's ledger (``self.sink``), never into Works directly.
"""

from __future__ import annotations

import collections
import functools
import queue
import threading
import time
from typing import Any, Callable, Sequence

import torch

from ..._base.errors import CollectiveTimeout, CommAborted, InvalidArgument, PeerFailure
from ..._base.ops import OpSpec
from ..._core.backend import Backend
from ..._core.work import Bundle, Work
from . import encode, lifecycle
from .caps import CAPS
from .lib import _PEER_ERRORS, IN_PROGRESS, INTERNAL_ERROR, SUCCESS, NcclError, poll_async_error
from .lifecycle import STOP as _STOP

_QUEUED, _LAUNCHED, _FAILED = 0, 1, 2


class _Job:
    """One launch: a single op, or a coalesced batch run as one NCCL group."""

    __slots__ = ("specs", "works", "ready", "done", "state", "n", "timeout")

    def __init__(self, specs: Sequence[OpSpec], works: Sequence[Work], ready: Any, done: Any, n: int) -> None:
        self.specs = specs
        self.works = works
        self.ready = ready
        self.done = done
        self.state = _QUEUED
        self.n = n
        self.timeout = max((s.timeout for s in specs), default=0.0) or 60.0


class NcclBackend(Backend):
    """Runs OpSpecs on one non-blocking nccl4py communicator, on one CUDA device."""

    name = "nccl"
    device_type = "cuda"
    caps = CAPS
    device: torch.device

    def __init__(
        self, comm: Any, *, rank: int, world_size: int, device: torch.device, lib: Any, runtime: Any,
        watcher: Any = None, health_interval: float = 0.1, abort_timeout: float = 2.0, close_timeout: float = 10.0,
        use_revoke: bool = True,
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
        # launcher never starts a call on a communicator that abort() has freed.
        self._nccl_lock = threading.Lock()
        self._lock = threading.Lock()  # _inflight, _stuck, _closed, _aborted, job numbers
        self._inflight: collections.deque[_Job] = collections.deque()
        # Jobs whose NCCL calls were issued but never completed (timeout, async error):
        # their tensors stay referenced until the communicator is aborted.
        self._stuck: list[_Job] = []
        self._aborted = False
        self._closed = False
        self._broken = False  # an NCCL error was seen: close() aborts instead of finalizing
        # abort() revokes (keeps the communicator shrinkable) where NCCL can; _revoked:
        # it did, and the communicator awaits a shrink or its ncclCommAbort.
        self._use_revoke = use_revoke
        self._revoked = False
        self._abort_done: threading.Event | None = None
        self._barrier_buf: torch.Tensor | None = None
        self._next = 0  # gate number of the last job submitted
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._launcher = threading.Thread(target=self._run, name=f"asynccoll-nccl-launcher-{device.index}", daemon=True)
        self._launcher.start()

    def __repr__(self) -> str:
        state = "revoked" if self._revoked and self._comm is not None else "aborted" if self._aborted else "closed" if self._closed else "ok"
        return f"<NcclBackend rank={self.rank}/{self.world_size} {self.device} {state}>"

    # --------------------------------------------------------------- submit
    def submit(self, spec: OpSpec, work: Work | Bundle) -> None:
        assert isinstance(work, Work)  # the communicator submits Works (Bundles are Gloo's flattening)
        self.submit_batch((spec,), (work,))

    def submit_batch(self, specs: Sequence[OpSpec], works: Sequence[Work]) -> None:
        """Queue ``specs`` as one launch: one NCCL group, one completion event."""
        if not specs:
            return
        if self._aborted or self._closed:
            raise CommAborted(f"NCCL backend is {'aborted' if self._aborted else 'closed'}")
        tensors: list[torch.Tensor] = []
        for spec in specs:
            encode.check(spec, self.device, tensors)
        rt = self._rt
        ready = rt.events.acquire()
        ready.record(rt.caller_stream(tensors[0] if tensors else None))
        for t in tensors:
            rt.protect(t)
        with self._lock:  # numbers follow queue order
            self._next += 1
            job = _Job(list(specs), list(works), ready, rt.events.acquire(), self._next)
            self._queue.put(job)
        hook = functools.partial(self._wait_stream, job)
        for work in works:
            work.set_stream_hook(hook)

    # --------------------------------------------------------------- launcher
    def _run(self) -> None:
        try:
            self._rt.bind_thread()
        except Exception:  # noqa: BLE001, S110 - a bad device shows up as the first op's error
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
                self._fail_job(job, CommAborted("the NCCL communicator failed earlier"), issued=False)
                continue
            try:
                self._launch(job)
            except Exception as exc:  # noqa: BLE001 - e.g. a CUDA error on the comm stream
                self._fail_job(job, self._translate(exc, job), issued=True)

    def _launch(self, job: _Job) -> None:
        rt = self._rt
        rt.comm_stream.wait_event(job.ready)
        # A stream wait already enqueued is not affected by re-recording the event.
        rt.events.release(job.ready)
        job.ready = None
        post: list[Callable[[], object]] = []
        handle = rt.handle(rt.comm_stream)
        grouped = encode.needs_group(job.specs)
        with self._nccl_lock:
            if self._aborted:
                return
            try:
                if grouped:
                    self._lib.group_start()
                for spec in job.specs:
                    encode.enqueue(spec, self._comm, self._lib, handle, self.rank, self.world_size, post, self._scratch)
            except Exception as exc:  # noqa: BLE001 - any failure here is reported, not raised (see the surrounding code)
                if grouped:  # close the half-built group without launching it here alone
                    self._discard_group()
                self._fail_job(job, self._translate(exc, job), issued=False)
                return
            if grouped:
                try:
                    self._lib.group_end()
                except Exception as exc:  # noqa: BLE001 - NCCL refused the group: nothing was launched
                    self._fail_job(job, self._translate(exc, job), issued=False)
                    return
        status = self._poll(time.monotonic() + job.timeout)
        if status is None:  # aborted meanwhile
            return
        if status == IN_PROGRESS:
            w = job.works[0]
            self._fail_job(job, CollectiveTimeout(
                f"{w.op} (seq {w.seq}): NCCL stayed in ncclInProgress for {job.timeout} s", seq=w.seq, op=w.op),
                issued=True)
            return
        if status != SUCCESS:
            self._fail_job(job, self._async_failure(status), issued=True)
            return
        if post:  # local copies and integer-AVG fix-ups, after the NCCL kernels
            with rt.on_comm_stream():
                for fn in post:
                    fn()
        job.done.record(rt.comm_stream)
        rt.gate_signal(job.n)
        # _inflight keeps the job, hence its tensors, referenced until the done event
        # fires (CuPy memory is not covered by record_stream).
        with self._lock:
            self._inflight.append(job)
        job.state = _LAUNCHED
        try:
            self._watcher.watch(job.done, self._completed, job, on_fail=functools.partial(self._watch_failed, job))
        except Exception as exc:  # noqa: BLE001 - watcher closed by abort/close
            self._watch_failed(job, exc)

    def _scratch(self) -> torch.Tensor:
        buf = self._barrier_buf
        if buf is None:
            buf = self._barrier_buf = self._rt.scratch()
        return buf

    def _discard_group(self) -> None:
        try:
            self._lib.group_discard()
        except Exception:  # noqa: BLE001 - the group state is lost anyway; the comm is marked broken
            self._broken = True

    def _poll(self, deadline: float) -> int | None:
        """Poll ``get_async_error`` until it leaves InProgress; None once aborted."""
        return poll_async_error(self._nccl_lock, lambda: None if self._aborted else self._comm, deadline)

    def _health_check(self) -> None:
        with self._nccl_lock:
            if self._aborted:
                return
            try:
                status = int(self._comm.get_async_error())
            except Exception:  # noqa: BLE001 - NcclInvalid: the communicator is unusable
                status = INTERNAL_ERROR
        if status not in (SUCCESS, IN_PROGRESS):
            with self._lock:
                jobs = list(self._inflight)
                self._inflight.clear()
            for job in jobs:
                self._fail_job(job, self._async_failure(status), issued=True)

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
        self.sink.succeed_all(job.works)
        self._rt.events.release(job.done)  # only now: nothing queries it any more

    def _watch_failed(self, job: _Job, exc: BaseException) -> None:
        with self._lock:
            if job in self._inflight:
                self._inflight.remove(job)
        if self._aborted:
            return
        err = CommAborted(f"waiting for NCCL completion failed: {exc}")
        err.__cause__ = exc
        self._fail_job(job, err, issued=True)

    def _fail_job(self, job: _Job, exc: BaseException, *, issued: bool) -> None:
        """Fail a launch; ``issued``: NCCL may still run its kernels, keep the tensors."""
        self._broken = True
        job.state = _FAILED
        with self._lock:
            if issued and not self._aborted:
                self._stuck.append(job)
            else:
                job.specs = ()
        if not issued:
            try:  # let wait_stream waiters pass: the op will never run
                self._rt.gate_signal(job.n)
            except Exception:  # noqa: BLE001, S110 - abort() releases the gate from the host
                pass
        if not self._aborted:
            works = list(job.works)
            self.sink.fail(works[0] if len(works) == 1 else Bundle(works, works[0].op), exc)

    def _wait_stream(self, job: _Job, stream: Any) -> None:
        """``work.wait_stream``: make ``stream`` wait for the op, never blocking the host."""
        if self._aborted or (job.works and job.works[0].done()):
            return  # settled (or the gate was released by abort)
        self._rt.gate_wait(self._rt.target_stream(stream), job.n)

    # ------------------------------------------------------------------ errors
    def _async_failure(self, status: int) -> CommAborted:
        text = self._lib.error_string(status)
        last = ""
        with self._nccl_lock:
            if not self._aborted:
                try:
                    last = str(self._comm.get_last_error() or "")
                except Exception:  # noqa: BLE001, S110 - the status code alone is reported
                    pass
        msg = f"NCCL reported error {status} ({text}) on rank {self.rank}" + (f": {last}" if last else "")
        exc: CommAborted = PeerFailure(msg) if status in _PEER_ERRORS else CommAborted(msg)
        exc.__cause__ = NcclError(status, text)
        return exc

    def _translate(self, exc: BaseException, job: _Job) -> BaseException:
        if isinstance(exc, (CommAborted, CollectiveTimeout, InvalidArgument)):
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
        """Stop the backend: bounded (``abort_timeout``), idempotent.

        Revokes the NCCL communicator where NCCL has ``ncclCommRevoke`` (it stays
        shrinkable until :meth:`close`/:meth:`release`), else aborts it; see
        :func:`lifecycle.abort_backend`.
        """
        lifecycle.abort_backend(self)

    def release(self) -> None:
        """The communicator was garbage-collected: abort (bounded), nothing will shrink it."""
        self._use_revoke = False
        lifecycle.abort_backend(self)
        lifecycle.discard_revoked(self)

    @property
    def can_shrink(self) -> bool:
        """Whether :meth:`shrink` can still use ``ncclCommShrink`` (not ncclCommAbort-ed)."""
        return lifecycle.can_shrink(self)

    def shrink_agreed(
        self, store: Any, new_rank: int, new_size: int, exclude: Sequence[int], abort_pending: bool | None,
        timeout: float,
    ) -> NcclBackend | None:
        """:meth:`shrink` when every survivor can, else None; see :func:`lifecycle.shrink_agreed`."""
        return lifecycle.shrink_agreed(self, store, new_rank, new_size, exclude, abort_pending, timeout)

    def close(self) -> None:
        """Finalize (polled, bounded) and destroy the communicator; stop the threads.

        After an NCCL error, or if finalize does not complete within
        ``close_timeout``, the communicator is aborted instead (NCCL's advice).
        """
        lifecycle.close_backend(self)

    def shrink(self, exclude: Sequence[int], abort_pending: bool | None = None, *, timeout: float = 60.0) -> NcclBackend:
        """A new backend over ``ncclCommShrink`` without the ``exclude`` ranks (blocking).

        See :func:`lifecycle.shrink_backend`. Every surviving rank calls it; run it
        off the event loop.
        """
        new = lifecycle.shrink_backend(self, exclude, abort_pending, timeout)
        new.bind(self.sink)  # until the new communicator binds its own ledger
        return new

backend_class = NcclBackend
