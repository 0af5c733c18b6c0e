"""The NCCL backend: jobs, their launch on the device's lane, and their completion.

How one op travels (``submit`` runs on the caller's thread):

1. ``submit`` plans the NCCL calls (``encode.plan``: every argument checked and
   resolved, so nothing can fail inside an NCCL group), records a *ready* event on
   the caller's current stream (the op must see everything the caller queued before
   the call), protects the tensors from the caching allocator (``record_stream`` on
   the comm stream) and hands the job to the device's lane (``lanes.py``: one launch
   thread per device, shared by its communicators, launching in issue order).
2. The launch: the comm stream waits for the ready event, the NCCL
   call(s) are made through the handle (a batch or a P2P op inside one
   ``ncclGroupStart/End``), then ``ncclCommGetAsyncError`` is polled until the
   communicator leaves ``ncclInProgress``. Only then does the done event go on the
   comm stream: a non-blocking communicator may defer the kernel launch, and nothing
   may touch its stream before. The caller's thread (an event loop) never polls.
3. Completion (the backend's :class:`~..._core.completion.Completion`): one
   :class:`streams.EventWatcher` thread waits for done events in order; each time
   one fires it settles that op and every later one whose done event has fired, in
   one pass (one wake-up per loop). Whoever asks about or awaits a Work first settles,
   on its own thread, the launched ops whose done events have fired (no thread hop).

``work.wait_stream(s)`` makes ``s`` wait on the done event (``s.wait_event``, what
CUDA sees). For an op the lane has not launched yet, it first waits on the host for
the launch (microseconds; bounded by the op's deadline, ended by an abort): a
device-side wait enqueued before its producer can deadlock the device (``cuda.py``).

The communicator handle, its lock and its state belong to :class:`CommHandle`
(``handle.py``). Outcomes go to the communicator's ledger (``self.sink``).
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from typing import Any, Sequence

import torch

from ..._base.errors import CollectiveTimeout, CommAborted, InvalidArgument
from ..._base.foreign import nccl_kind, op_error, status_of
from ..._base.ops import OpSpec
from ..._core.backend import Backend
from ..._core.work import Bundle, Work
from . import encode, lanes
from .caps import CAPS
from .handle import CommHandle
from .lib import IN_PROGRESS, SUCCESS
from .renew import Renewal

_QUEUED, _LAUNCHED, _FAILED = 0, 1, 2


class _Job:
    """One launch: a single op, or a coalesced batch run as one NCCL group."""

    __slots__ = ("plan", "works", "ready", "done", "state", "timeout", "settled")

    def __init__(
        self, plan: encode.Plan | None, works: Sequence[Work], ready: Any, done: Any, timeout: float
    ) -> None:
        self.plan = plan
        self.works = works
        self.ready = ready
        self.done = done  # the done event, until it was returned to the pool
        self.state = _QUEUED
        self.timeout = timeout
        self.settled = (
            False  # launched, failed or dropped: wait_stream need not wait for the launch
        )


def _bind(index: int) -> None:
    torch.cuda.set_device(index)


class NcclBackend(Renewal, Backend):
    """Runs OpSpecs on one non-blocking nccl4py communicator, on one CUDA device."""

    name = "nccl"
    device_type = "cuda"
    caps = CAPS  # each instance: its device's table (fp8 reductions from sm_90)
    device: torch.device

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
        use_revoke: bool = True,
    ) -> None:
        import streams

        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.health_interval = health_interval
        self._lib = lib
        self._rt = runtime
        #: What this backend runs on its device (fp8 reductions from sm_90 only).
        self.caps = CAPS.for_device(runtime.capability)
        self._handle = CommHandle(
            comm,
            lib,
            rank=rank,
            bind=runtime.bind_thread,
            abort_timeout=abort_timeout,
            close_timeout=close_timeout,
            use_revoke=use_revoke,
        )
        self._watcher = watcher or streams.EventWatcher(
            f"nccl{device.index}", cuda_device=device.index
        )
        self._lock = threading.Lock()  # _pending, _inflight, _stuck, _closed, job states
        self._launches = threading.Condition(self._lock)  # a job settled (wait_stream waits on it)
        self._waiting = 0  # wait_stream calls waiting for a launch
        self._pending: collections.deque[_Job] = collections.deque()
        self._inflight: collections.deque[_Job] = collections.deque()
        # Jobs whose NCCL calls were issued but never completed (timeout, async error):
        # their tensors stay referenced until the communicator is aborted.
        self._stuck: list[_Job] = []
        self._launching: _Job | None = None  # popped from _pending, not in _inflight yet
        self._closed = False
        self._broken = False  # an NCCL error was seen: close() aborts instead of finalizing
        self._lane = lanes.join(device.index, self, _bind)

    def __repr__(self) -> str:
        state = "closed" if self._closed and self._handle.state == "ok" else self._handle.state
        return f"<NcclBackend rank={self.rank}/{self.world_size} {self.device} {state}>"

    @property
    def handle(self) -> CommHandle:
        """The owner of this backend's NCCL communicator (its state, lock, abort/shrink/grow)."""
        return self._handle

    @property
    def runtime(self) -> Any:
        """The CUDA side: device, comm stream, events (``cuda.CudaRuntime``)."""
        return self._rt

    @property
    def stuck(self) -> int:
        """Jobs issued to NCCL that failed before completing: their tensors stay referenced
        until the communicator is aborted."""
        return len(self._stuck)

    # --------------------------------------------------------------- submit
    def submit(self, spec: OpSpec, work: Work | Bundle) -> None:
        assert isinstance(
            work, Work
        )  # the communicator submits Works (Bundles are Gloo's flattening)
        self.submit_batch((spec,), (work,))

    def submit_batch(self, specs: Sequence[OpSpec], works: Sequence[Work]) -> None:
        """Queue ``specs`` as one launch: one NCCL group, one completion event."""
        if not specs:
            return
        if self._handle.stopping or self._closed:
            raise CommAborted(f"NCCL backend is {'aborted' if self._handle.stopping else 'closed'}")
        rt = self._rt
        plan = encode.plan(
            specs,
            device=self.device,
            rank=self.rank,
            ws=self.world_size,
            caps=self.caps,
            lib=self._lib,
            scratch=rt.scratch,
        )
        tensors = plan.tensors
        ready = rt.events.acquire()
        ready.record(rt.caller_stream(tensors[0] if tensors else None))
        for t in tensors:
            rt.protect(t)
        timeout = (specs[0].timeout if len(specs) == 1 else max(s.timeout for s in specs)) or 60.0
        job = _Job(plan, works, ready, rt.events.acquire(), timeout)
        hook = functools.partial(self._wait_stream, job)
        for work in works:
            work.set_stream_hook(hook)
            work.attach(self)
        with self._lock:
            self._pending.append(job)
        self._lane.post(self)

    # ---------------------------------------------------------- lane thread
    def busy(self) -> bool:
        return bool(self._inflight)

    def launch_next(self) -> None:
        """Launch the oldest queued job (the lane's turn; ``lanes.Member``)."""
        with self._lock:
            if not self._pending:
                return
            job = self._launching = self._pending.popleft()
        try:
            if self._handle.stopping:
                self._drop(job)
            elif self._broken:  # never call into a communicator that reported an error
                self._fail_job(
                    job, CommAborted("the NCCL communicator failed earlier"), issued=False
                )
            elif self._call(job):
                self._landed(job, self._handle.poll(self._by(job)))
        except Exception as exc:  # noqa: BLE001 - e.g. a CUDA error on the comm stream
            self._fail_job(job, self._translate(exc, job), issued=True)
        finally:
            self._launching = None

    @staticmethod
    def _by(job: _Job) -> float:
        return time.monotonic() + job.timeout

    def _call(self, job: _Job) -> bool:
        """Make the job's NCCL call(s); False if it failed or was dropped (nothing launched)."""
        rt = self._rt
        plan = job.plan
        assert plan is not None
        rt.comm_stream.wait_event(job.ready)
        # A stream wait already enqueued is not affected by re-recording the event.
        rt.events.release(job.ready)
        job.ready = None
        stream = rt.handle(rt.comm_stream)
        with self._handle.use() as comm:
            if comm is None:  # stopped meanwhile
                self._drop(job)
                return False
            if not plan.grouped:
                try:
                    plan.calls[0](comm, stream)
                except Exception as exc:  # noqa: BLE001 - NCCL refused the call: nothing was launched
                    self._fail_job(job, self._translate(exc, job), issued=False)
                    return False
            elif not self._grouped(comm, stream, job):
                return False
        return True

    def _landed(self, job: _Job, status: int | None) -> None:
        """The NCCL call(s) returned and the communicator left InProgress with ``status``
        (or stayed in it until the job's deadline): queue the done event, or fail."""
        rt = self._rt
        plan = job.plan
        assert plan is not None
        if status is None:  # stopped meanwhile
            return
        if status == IN_PROGRESS:
            w = job.works[0]
            self._fail_job(
                job,
                CollectiveTimeout(
                    f"{w.op} (seq {w.seq}): NCCL stayed in ncclInProgress for {job.timeout} s",
                    seq=w.seq,
                    op=w.op,
                ),
                issued=True,
            )
            return
        if status != SUCCESS:
            self._fail_job(job, self._handle.failure(status), issued=True)
            return
        if plan.post:  # local copies and integer-AVG fix-ups, after the NCCL kernels
            with rt.on_comm_stream():
                for fn in plan.post:
                    fn()
        job.done.record(rt.comm_stream)
        # _inflight keeps the job, hence its tensors, referenced until the done event
        # fires (CuPy memory is not covered by record_stream).
        with self._lock:
            self._inflight.append(job)
            job.state = _LAUNCHED
            self._settled(job)
        try:
            self._watcher.watch(
                job.done, self._completed, job, on_fail=functools.partial(self._watch_failed, job)
            )
        except Exception as exc:  # noqa: BLE001 - watcher closed by abort/close
            self._watch_failed(job, exc)

    def _grouped(self, comm: Any, stream: int, job: _Job) -> bool:
        """Make the calls of a group; False (job failed, nothing launched) if any failed."""
        plan = job.plan
        assert plan is not None
        lib = self._lib
        try:
            lib.group_start()
        except Exception as exc:  # noqa: BLE001 - NCCL refused to open the group
            self._fail_job(job, self._translate(exc, job), issued=False)
            return False
        failed: BaseException | None = None
        try:
            for call in plan.calls:
                call(comm, stream)
        except Exception as exc:  # noqa: BLE001 - the group must still be ended, see below
            failed = exc
            if status_of(exc) is None:
                # nccl4py refused before NCCL saw the call: NCCL has no group error, and
                # ncclGroupEnd would launch the rest on this rank alone. Give it one.
                lib.poison_group(comm, self._rt.scratch, stream, self.world_size)
        try:
            lib.group_end()
        except Exception as exc:  # noqa: BLE001 - the group error: NCCL launched nothing
            failed = failed or exc
        if failed is not None:
            self._broken = True  # a non-blocking communicator keeps the error (async error)
            self._fail_job(job, self._translate(failed, job), issued=False)
            return False
        return True

    def health_check(self) -> None:
        status = self._handle.status()
        if status is None or status in (SUCCESS, IN_PROGRESS):
            return
        with self._lock:
            jobs = list(self._inflight)
            self._inflight.clear()
        for job in jobs:
            self._fail_job(job, self._handle.failure(status), issued=True)

    # ------------------------------------------------------------ completion
    def settle_finished(self) -> None:
        """The completion protocol: settle here the launched ops whose done events fired."""
        try:
            done = self._inflight[0].done
        except IndexError:  # nothing launched is pending
            return
        # torch's Event.query has no device guard (ATen/cuda/CUDAEvent.h): on a thread whose
        # device is another, the watcher settles it instead.
        if done is not None and self._rt.current() and done.query():
            self._reap(None)

    def watch_unfinished(self) -> None:
        """The completion protocol: nothing to do, the watcher waits for every launched op."""

    def _completed(self, job: _Job) -> None:
        """Watcher thread: ``job``'s done event fired; its event goes back to the pool."""
        self._reap(job)
        with self._lock:
            done, job.done = job.done, None
        if done is not None:
            self._rt.events.release(done)  # only now: nothing queries it any more

    def _reap(self, fired: _Job | None) -> None:
        """Settle, in one pass, the launched ops at the head of ``_inflight`` whose done
        events fired (``fired``: one known to have); their events stay with the watcher."""
        jobs = []
        with self._lock:
            inflight = self._inflight
            while inflight:
                job = inflight[0]
                if job is not fired and not job.done.query():
                    break
                inflight.popleft()
                job.plan = None  # the Works' wait_stream hooks keep the job: drop its tensors
                jobs.append(job)
        if not jobs or self._handle.stopping:
            return  # never report success after abort (the op may have been cut short)
        if len(jobs) == 1:
            self.sink.succeed_all(jobs[0].works)
        else:
            self.sink.succeed_all([w for job in jobs for w in job.works])

    def _watch_failed(self, job: _Job, exc: BaseException) -> None:
        with self._lock:
            if job in self._inflight:
                self._inflight.remove(job)
        if self._handle.stopping:
            return
        err = CommAborted(f"waiting for NCCL completion failed: {exc}")
        err.__cause__ = exc
        self._fail_job(job, err, issued=True)

    def _settled(self, job: _Job) -> None:
        """``job`` launched, failed or dropped (``_lock`` held): wake wait_stream calls."""
        job.settled = True
        if self._waiting:
            self._launches.notify_all()

    def _drop(self, job: _Job) -> None:
        """A job the communicator never ran (stopped first): forget its tensors."""
        with self._lock:
            job.plan = None
            job.state = _FAILED
            self._settled(job)

    def _fail_job(self, job: _Job, exc: BaseException, *, issued: bool) -> None:
        """Fail a launch; ``issued``: NCCL may still run its kernels, keep the tensors."""
        self._broken = True
        with self._lock:
            job.state = _FAILED
            if issued and not self._handle.stopping:
                self._stuck.append(job)
            else:
                job.plan = None
            job.done = None
            self._settled(job)
        if self._handle.stopping:
            return
        works = list(job.works)
        self.sink.fail(works[0] if len(works) == 1 else Bundle(works, works[0].op), exc)

    def _wait_stream(self, job: _Job, stream: Any) -> None:
        """``work.wait_stream``: make ``stream`` wait for the op (see the module docstring)."""
        if job.works and job.works[0].done():
            return  # settled: the op's kernels are over (or it never ran)
        target = self._rt.target_stream(stream)
        with self._lock:
            if not job.settled:
                if threading.current_thread() is self._lane.thread:
                    raise InvalidArgument(
                        "wait_stream cannot be called from the NCCL launch thread"
                    )
                self._waiting += 1
                try:
                    launched = self._launches.wait_for(lambda: job.settled, job.timeout)
                finally:
                    self._waiting -= 1
                if not launched:
                    w = job.works[0]
                    raise CollectiveTimeout(
                        f"{w.op} (seq {w.seq}): not launched within {job.timeout} s",
                        seq=w.seq,
                        op=w.op,
                    )
            if job.state == _LAUNCHED and job.done is not None:
                target.wait_event(job.done)

    def _translate(self, exc: BaseException, job: _Job) -> BaseException:
        """The contract's error for a job that failed with ``exc`` (``foreign.op_error``)."""
        if isinstance(exc, InvalidArgument):
            return exc
        w = job.works[0]
        return op_error(exc, nccl_kind(exc), backend="NCCL", seq=w.seq, op=w.op)

    # ------------------------------------------------------------ lifecycle
    def _forget(self) -> None:
        """After the communicator stopped: drop every job (their kernels are over)."""
        with self._lock:
            jobs = list(self._pending) + list(self._inflight) + self._stuck
            self._pending.clear()
            self._inflight.clear()
            self._stuck.clear()
        for job in jobs:
            self._drop(job)

    def abort(self) -> None:
        """Stop the backend: bounded (``abort_timeout``), idempotent.

        Revokes the NCCL communicator where NCCL has ``ncclCommRevoke`` (it stays
        shrinkable until :meth:`close`/:meth:`release`), else aborts it.
        """
        with self._lock:  # queued jobs never run: drop them (and their tensors) now
            queued = list(self._pending)
            self._pending.clear()
            launching = self._launching
        first = not self._handle.stopping
        for job in queued:
            self._drop(job)
        if launching is not None:  # never recorded now: nothing for wait_stream to wait for
            with self._lock:
                self._settled(launching)
        if first:
            self._watcher.close(timeout=0, drain=False)
        self._handle.stop(after=self._forget)

    def release(self) -> None:
        """The communicator was garbage-collected: abort (bounded), nothing will shrink it."""
        self._handle.stop(revoke=False, after=self._forget)
        self._handle.discard()
        self._leave(reuse=False)

    def _leave(self, reuse: bool) -> None:
        with self._lock:
            if self._lane is None:
                return
            lane, self._lane = self._lane, None  # type: ignore[assignment]
        lanes.leave(lane, self)
        self._rt.close(reuse)

    @property
    def can_shrink(self) -> bool:
        """Whether :meth:`shrink` can still use ``ncclCommShrink`` (not ncclCommAbort-ed)."""
        return self._handle.can_shrink

    def close(self) -> None:
        """Finalize (polled, bounded) and destroy the communicator; leave the lane.

        After an NCCL error, or if finalize does not complete within ``close_timeout``,
        the communicator is aborted instead (NCCL's advice).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        lane = self._lane
        if lane is not None and not self._handle.stopping:
            lane.drained(5.0)  # jobs queued before close are launched first
        self._watcher.close(timeout=5.0, drain=not self._handle.stopping)
        clean = self._handle.close(broken=self._broken)
        self._forget()
        self._leave(reuse=clean)


backend_class = NcclBackend
