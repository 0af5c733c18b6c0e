"""One simulated ``ncclComm_t`` behind an autospec of nccl4py's real ``Communicator``.

Every method the code under test calls goes through :meth:`CommState.call`, which
binds the arguments to the real method's signature, applies nccl4py's own Python
checks (``NcclInvalid``) and then NCCL's (``NCCLError`` with a real ``Result``).
The NCCL rules, each with the line of the NCCL 2.30 source (NVIDIA/nccl) it follows:

* ``ncclEnqueueCheck`` (enqueue.cc:3124-3171): a failed argument check inside a
  group sets the group error (group.h ``ncclGroupErrCheck``), so ``ncclGroupEnd``
  fails and launches nothing (group.cc:788); on a non-blocking communicator it also
  sets the communicator's async error (enqueue.cc:3170). nccl4py's own checks
  (``NcclInvalid``, before NCCL is called) leave the group as it was.
* fp8 reductions below sm_90 are ``ncclInvalidArgument`` ("FP8 reduction support
  begins with sm90 capable devices", enqueue.cc:3025-3030); an fp8 AVG is
  ``ncclInvalidArgument`` on any device (enqueue.cc ``hostToDevRedOp``: ncclAvg maps
  the integer and f16/bf16/f32/f64 types only; measured on an H100, NCCL 2.28.9).
* ``ncclCommRevoke`` (init.cc:2965-3022): flags must be 0; a second revoke, or one
  after finalize/destroy, is ``ncclInvalidArgument``; the communicator reads
  ``ncclInProgress`` until its device work has drained (commRevokeAsync synchronises
  the device stream) and then ``ncclSuccess``; finalize after revoke is invalid
  (nccl.h); data calls on a revoked communicator are ``ncclInvalidUsage``
  (enqueue.cc:3128).
* ``ncclCommAbort`` (init.cc:3026, commReclaim → commDestroySync): sets the abort
  flag — and a child's still initialising (``setCommAbortFlags``: childAbortFlag) —
  then waits for the communicator's device stream (its kernels must reach the device
  and exit) and joins the proxy thread: the call blocks until then.
* A launch stuck inside NCCL (:meth:`SimNccl.block_calls`). A *blocking* communicator
  launches on the caller's thread (``ncclGroupEndInternal`` calls ``groupLaunch``
  itself, group.cc:858-864), so each of its calls blocks. A *non-blocking* one only
  checks and appends the task on the caller's thread (enqueue.cc:3137-3167); the
  launch — connection setup, ``doLaunches`` — runs on a thread NCCL starts
  (group.cc:825-857, ``STDTHREADCREATE_GOTO`` at 855; 2.28.9: group.cc:706-738), so its
  data calls return and the communicator stays ``ncclInProgress`` until the latch
  opens. What joins that thread blocks: abort and revoke set the abort flag and then
  ``ncclCommEnsureReady`` → ``ncclGroupJobAbort`` joins it (init.cc:3036-3041,
  2987-2989, 422-426; group.cc:902-908, 85-87) — the worst case, a launch stuck in
  something that does not watch the abort flag. A data call while the last launch is
  still InProgress is ``ncclInvalidArgument`` (``ncclCommEnsureReady``, init.cc:428-433).
* ``ncclCommShrink`` (init.cc:3074-3170): an empty exclusion list, or a caller that
  is in it, is ``ncclInvalidArgument``; ``*newcomm`` is NULL "until comm split fully
  complete" — the child handle is filled when the parent's async job ends, and
  nccl4py's getters raise ``NcclInvalid`` on it before.
* ``ncclCommSplit`` (init.cc:3391 → ``ncclCommInitChildComm`` 3067-3130, ``commGetSplitInfo``
  1768-1800): a collective of every rank of the parent (the job all-gathers each rank's
  color and key over the parent's bootstrap); the ranks of one color form a child,
  ordered by key, equal keys by parent rank; ``NCCL_SPLIT_NOCOLOR`` (nccl4py: ``color``
  None) makes no child (3100) and nccl4py returns a null communicator. As for a shrink,
  ``*newcomm`` is NULL until the split completes: the parent's job ends once every
  parent rank called it.
* ``ncclCommGetUniqueId``/``ncclCommGrow`` (init.cc:3204-3370, nccl.h): one existing
  rank (the root) gets the id and passes it, the others pass none; new ranks call it
  on a null ``Communicator()`` with their rank (< nRanks); nRanks must exceed the
  parent's; existing ranks keep their numbers; "the UID is consumed upon successful
  grow and cannot be reused", and a new one cannot be made while one is unconsumed.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import nccl.bindings.nccl as _b
import nccl.core as _nc
import torch
from nccl.core.interop.torch import resolve_tensor

from ._double import strict
from .device import Latch, SimTensor, StreamState, plain
from .world import COLL, DATA, Launch, Op, World

Result = _b.Result
REAL = _nc.Communicator
SIG = {
    name: inspect.signature(getattr(REAL, name))
    for name in dir(REAL)
    if not name.startswith("_") and callable(getattr(REAL, name, None))
}
_FP8 = {
    d
    for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
    if d is not None
}
_MANAGE = ("abort", "destroy", "finalize")
# What a stuck launch of a non-blocking communicator blocks (block_calls): ncclCommAbort
# and ncclCommRevoke set the abort flag, then ncclCommEnsureReady joins the group job's
# thread (init.cc:3036-3041, 2987-2989 → 422-426 → group.cc:902-908, ncclThreadJoin at 87).
_JOINS = ("abort", "revoke")
# Methods called per op: bound to the real signature without a mock's call recording
# (a mock's call list keeps every tensor alive; resetting it per call cost 200 µs).
FAST = (*DATA, "get_async_error", "get_last_error")


def nccl_error(code: Any) -> _b.NCCLError:
    return _b.NCCLError(int(code))


class CommState:
    """What one simulated ``ncclComm_t`` knows; its ``mock`` is what the code under test holds."""

    def __init__(
        self, sim: Any, world: World | None, rank: int, blocking: bool, device: int
    ) -> None:
        self.sim = sim
        self.world: World = world  # type: ignore[assignment]  # None only for a null communicator
        self.rank = rank
        self.blocking = blocking
        self.device = device
        self.valid = world is not None  # a null Communicator() is not
        self.filled = True  # False: a child whose parent's job has not ended (ncclCommShrink/Grow)
        self.aborted = False
        self.destroyed = False
        self.finalizing = False
        self.dead = False
        self.hung = False
        self.error = 0
        self.polls_left = 0
        self.deferred: list[Launch] = []
        self.launches: list[Launch] = []
        self.colls = 0
        self.p2p: dict[tuple[int, int, str], int] = {}
        self.calls: list[str] = []
        self.block: Latch | None = None
        self.fail: dict[str, BaseException] = {}
        self.revoked = False
        self.revoke_polls = 0  # polls left before a revoke reads Success
        self.revoke_stalled = False  # stall_revoke(): never quiescent
        self.shrink_flags: list[Any] = []  # the flag of every shrink on this communicator
        self.child: CommState | None = None  # the child of a shrink/grow/split job still running
        self.split_of: Any = None  # the split (SimNccl.split) that makes this child
        m = sim.new_mock()
        for name in SIG:
            if not hasattr(m, name):
                continue
            if name in FAST:  # called per op: checked against the signature, not recorded
                setattr(
                    m,
                    name,
                    strict(getattr(REAL, name), functools.partial(self.call, name), method=True),
                )
            else:
                getattr(m, name).side_effect = functools.partial(self.call, name)
        self.mock = m

    def __repr__(self) -> str:
        n = self.world.nranks if self.world is not None else 0
        return f"<SimComm rank={self.rank}/{n} cuda:{self.device} valid={self.valid}>"

    # -------------------------------------------------------------- dispatch
    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        bound = SIG[name].bind(None, *args, **kwargs)  # the mock already checked arity
        bound.apply_defaults()
        a = dict(bound.arguments)
        a.pop("self", None)
        latch = self.block
        gpu = self.sim.gpu
        if latch is not None and (self.blocking or name in _JOINS):  # stuck inside NCCL
            with gpu.cv:
                gpu.cv.wait_for(lambda: latch.is_open, gpu.sync_limit)
        with gpu.cv:
            if name not in ("get_async_error", "get_last_error"):  # polls: too many to keep
                self.calls.append(name)
            try:
                if name == "grow" and self.world is None:
                    return self._grow(**a)  # a null Communicator() joining (new rank)
                if name in _MANAGE and not (self.valid and self.filled):
                    return None  # nccl4py: a null communicator makes these no-ops
                if not (self.valid and self.filled):
                    raise _nc.NcclInvalid(f"Cannot {name}: Communicator not initialized")
                if name in self.fail:
                    raise self.fail.pop(name)
                if self.revoked:
                    self._check_revoked(name)
                if name in DATA and not self.blocking and self.deferred:
                    # ncclCommEnsureReady (init.cc:422-433): "Attempt to use communicator
                    # before the previous operation returned ncclSuccess".
                    gpu.errors.append(f"{self!r}: {name}() while its last launch is InProgress")
                    raise nccl_error(Result.InvalidArgument)
                fn = getattr(self, "_" + name, None)
                if fn is None:
                    raise NotImplementedError(f"nccl4py Communicator.{name} is not simulated")
                return fn(**a)
            except _b.NCCLError as exc:
                if (
                    name in DATA
                ):  # enqueue.cc: the group error, and the async error when non-blocking
                    self.sim.group_error(exc)
                    if not self.blocking:
                        self.error = int(exc.status)
                raise

    # ------------------------------------------------------------- buffers
    def _buffer(self, t: Any, what: str) -> torch.Tensor:
        """nccl4py's ``NcclBuffer`` + ``_validate_buffer_device`` (communicator.py)."""
        if not isinstance(t, torch.Tensor):
            raise _nc.NcclInvalid(f"{what} must be a tensor here, got {type(t).__name__}")
        resolve_tensor(t)  # nccl4py's own (NcclBuffer): NcclInvalid for complex, int16, ...
        if not isinstance(t, SimTensor):
            self.sim.gpu.errors.append(
                f"{what}: a host tensor was passed to NCCL (not a simulated CUDA tensor)"
            )
        elif t.device.index != self.device:
            raise _nc.NcclInvalid(
                f"{what} is on device {t.device.index}, but communicator is on device {self.device}"
            )
        if not t.is_contiguous():
            self.sim.gpu.errors.append(f"{what}: a non-contiguous tensor was passed to NCCL")
        return plain(t)  # like a device pointer: does not keep the caller's tensor alive

    def _stream(self, stream: Any) -> StreamState:
        if isinstance(stream, bool):
            raise TypeError("stream must not be a bool")
        handle = (
            0
            if stream is None
            else stream
            if isinstance(stream, int)
            else int(stream.__cuda_stream__()[1])
        )
        gpu = self.sim.gpu
        if handle == 0:
            gpu.errors.append("an NCCL op was enqueued on the default stream (stream=None/0)")
        state: StreamState = gpu.state_by_handle(handle, self.device)
        if state.device != self.device:
            gpu.errors.append(f"{self!r}: an op was enqueued on {state!r} of another device")
        return state

    def _redop(self, op: Any, dtype: Any) -> int:
        if not isinstance(op, _nc.NcclRedOp):
            raise TypeError(f"op must be an nccl.core.NcclRedOp, got {op!r}")
        if dtype in _FP8 and self.sim.gpu.capability[self.device] < (9, 0):
            raise nccl_error(Result.InvalidArgument)  # enqueue.cc: FP8 reduction needs sm90
        if dtype in _FP8 and op == _nc.NcclRedOp.AVG:
            raise nccl_error(Result.InvalidArgument)  # enqueue.cc hostToDevRedOp: no fp8 ncclAvg
        return int(op)

    def _root(self, root: Any) -> int:
        if isinstance(root, (bool, _nc.NcclRedOp)) or not isinstance(root, int):
            raise TypeError(f"root must be a rank (int), got {root!r}")
        if not 0 <= root < self.world.nranks:
            raise nccl_error(Result.InvalidArgument)
        return root

    # ----------------------------------------------------------- collectives
    def _allreduce(self, sendbuf: Any, recvbuf: Any, op: Any, stream: Any, config: Any) -> None:
        self._reduce(sendbuf, recvbuf, op, None, stream, config)

    def _reduce(
        self, sendbuf: Any, recvbuf: Any, op: Any, root: Any, stream: Any, config: Any
    ) -> None:
        s = self._buffer(sendbuf, "sendbuf")
        r = None
        if root is None or self._root(root) == self.rank:
            r = self._buffer(recvbuf, "recvbuf")
            if r.dtype != s.dtype:
                raise _nc.NcclInvalid(
                    f"Dtype mismatch: sendbuf has dtype {s.dtype}, recvbuf has dtype {r.dtype}"
                )
            if r.numel() < s.numel():
                raise _nc.NcclInvalid("Buffer count mismatch")
        kind = "allreduce" if root is None else "reduce"
        red = self._redop(op, s.dtype)
        self._issue(Op(kind, self, send=s, recv=r, op=red, root=root), self._stream(stream))

    def _broadcast(self, sendbuf: Any, recvbuf: Any, root: Any, stream: Any, config: Any) -> None:
        root = self._root(root)
        r = self._buffer(recvbuf, "recvbuf")
        s = None
        if root == self.rank:
            s = self._buffer(sendbuf, "sendbuf")
            if s.dtype != r.dtype or s.numel() != r.numel():
                raise _nc.NcclInvalid("broadcast: sendbuf and recvbuf differ")
        op = Op("broadcast", self, send=s, recv=r, root=root)
        op.count, op.dtype = int(r.numel()), r.dtype
        self._issue(op, self._stream(stream))

    def _allgather(self, sendbuf: Any, recvbuf: Any, stream: Any, config: Any) -> None:
        s, r = self._buffer(sendbuf, "sendbuf"), self._buffer(recvbuf, "recvbuf")
        if r.numel() < s.numel() * self.world.nranks or r.dtype != s.dtype:
            raise _nc.NcclInvalid("allgather: recvbuf too small or of another dtype")
        self._issue(Op("allgather", self, send=s, recv=r), self._stream(stream))

    def _reduce_scatter(
        self, sendbuf: Any, recvbuf: Any, op: Any, stream: Any, config: Any
    ) -> None:
        s, r = self._buffer(sendbuf, "sendbuf"), self._buffer(recvbuf, "recvbuf")
        if s.numel() < r.numel() * self.world.nranks or r.dtype != s.dtype:
            raise _nc.NcclInvalid("reduce_scatter: sendbuf too small or of another dtype")
        o = Op("reduce_scatter", self, send=s, recv=r, op=self._redop(op, s.dtype))
        o.count = int(r.numel())
        self._issue(o, self._stream(stream))

    def _send(self, sendbuf: Any, peer: Any, stream: Any) -> None:
        s = self._buffer(sendbuf, "sendbuf")
        self._issue(Op("send", self, send=s, peer=self._root(peer)), self._stream(stream))

    def _recv(self, recvbuf: Any, peer: Any, stream: Any) -> None:
        r = self._buffer(recvbuf, "recvbuf")
        self._issue(Op("recv", self, recv=r, peer=self._root(peer)), self._stream(stream))

    def _issue(self, op: Op, stream: StreamState) -> None:
        if self.sim.in_group():
            self.sim.group_add(op, stream)
        else:
            self.launch([op], stream)

    def launch(self, ops: list[Op], stream: StreamState) -> None:
        """Number the ops (issue order) and launch them now or after InProgress clears."""
        for op in ops:
            if op.kind in COLL:
                op.key = self.colls
                self.colls += 1
                self.world.colls[op.key][self.rank] = op
            else:
                src, dst = (self.rank, op.peer) if op.kind == "send" else (op.peer, self.rank)
                k = self.p2p.get((src, dst, op.kind), 0)
                self.p2p[(src, dst, op.kind)] = k + 1
                op.key = (src, dst, k)
                self.world.p2p[op.key][op.kind] = op
        la = Launch(self, ops, stream)
        self.launches.append(la)
        self.sim.device.check_order(la)  # host launch order: this call
        if self.blocking:
            self.sim.device.push(la)
        else:
            self.deferred.append(la)
            self.polls_left = max(self.polls_left, self.sim.inprogress_polls)

    # ------------------------------------------------------------- state
    def _check_revoked(self, name: str) -> None:
        """After revoke: only shrink/split/abort/destroy, once quiescent (nccl.h, enqueue.cc:3128)."""
        if name in ("get_async_error", "get_last_error", "abort", "destroy", "revoke"):
            return
        why = None
        if name == "finalize":
            why = "finalize() after revoke() (invalid)"
        elif name not in ("shrink", "split"):
            why = f"{name}() on a revoked communicator"
        elif self._revoking():
            why = f"{name}() before the revoke was polled to ncclSuccess"
        if why is not None:
            self.sim.gpu.errors.append(f"{self!r}: {why}")
            raise nccl_error(Result.InvalidUsage)

    def _revoking(self) -> bool:
        return (
            self.revoke_stalled
            or self.revoke_polls > 0
            or any(la.pushed and not la.left for la in self.launches)
        )

    def _revoke(self, flags: int = 0) -> None:
        if isinstance(flags, bool) or not isinstance(flags, int):
            raise TypeError(f"flags must be an int, got {flags!r}")
        if flags != 0 or self.revoked or self.finalizing:
            raise nccl_error(Result.InvalidArgument)  # init.cc:2971-2983
        self.revoked = True
        self._abort_launches()  # in-flight ops stop (their Works fail upstream)
        self.revoke_polls = max(1, self.sim.revoke_polls)

    def _get_async_error(self) -> Any:
        if self.revoked and self._revoking():
            if not self.revoke_stalled and self.revoke_polls > 0:
                self.revoke_polls -= 1
            if self._revoking():
                return Result.InProgress
            self.error = 0  # quiescent: ncclSuccess
        if self.error:
            return Result(self.error)
        if not self.world.complete():
            return Result.InProgress
        if (
            self.child is not None
        ):  # a shrink/grow/split job: ends when the child's world is complete
            if not self.sim.child_done(self.child):
                return Result.InProgress
            self.child.filled = True
            self.child = None
        if self.deferred and self.block is not None and not self.block.is_open:
            return Result.InProgress  # block_calls: NCCL's launch thread is stuck
        if self.deferred or self.polls_left > 0:
            self.polls_left -= 1
            if self.polls_left > 0:
                return Result.InProgress
            for la in self.deferred:
                self.sim.device.push(la)
            self.deferred.clear()
        if self.finalizing and any(not la.finished() for la in self.launches):
            return Result.InProgress
        return Result.Success

    def _get_last_error(self) -> str:
        return f"simulated NCCL error {self.error}" if self.error else ""

    def _finalize(self) -> None:
        self.finalizing = True

    def _destroy(self) -> None:
        if self.finalizing and any(not la.finished() for la in self.launches):
            self.sim.gpu.errors.append(f"{self!r}: destroy() before finalize completed")
        self._free()
        self.destroyed = True

    def _abort(self) -> None:
        child, self.child = self.child, None
        if (
            child is not None
        ):  # init.cc setCommAbortFlags: the child's init is aborted too (childAbortFlag)
            child._free()
            child.aborted = True
        self._abort_launches()
        gpu = self.sim.gpu
        # commDestroySync: wait for the device stream (the aborted kernels must leave it).
        if not gpu.cv.wait_for(
            lambda: all(la.left or not la.pushed for la in self.launches), gpu.sync_limit
        ):
            gpu.errors.append(
                f"{self!r}: ncclCommAbort still waiting for its kernels after {gpu.sync_limit} s"
            )
        self._free()
        self.aborted = True

    def _abort_launches(self) -> None:
        self.sim.device.stopped.add(self.world.key)
        for la in self.launches:
            if not la.finished():
                la.aborted = True
        self.deferred.clear()
        self.sim.gpu.cv.notify_all()

    def _free(self) -> None:
        self.valid = False
        self.mock.is_valid = False

    # ---------------------------------------------------------- shrink, grow
    def _shrink(self, exclude_ranks: Any, config: Any, flag: Any) -> Any:
        if not isinstance(flag, _nc.CommShrinkFlag):
            raise TypeError(f"flag must be an nccl.core.CommShrinkFlag, got {flag!r}")
        if config is not None and not isinstance(config, _nc.NCCLConfig):
            raise TypeError(f"config must be an NCCLConfig, got {config!r}")
        drop = sorted(int(r) for r in (exclude_ranks or []))
        if not drop or self.rank in drop:
            raise nccl_error(Result.InvalidArgument)  # init.cc:3086, 3090
        self.shrink_flags.append(flag)
        busy = any(not la.finished() for la in self.launches)
        if flag == _nc.CommShrinkFlag.ABORT:
            self._abort_launches()
        elif busy:
            self.sim.gpu.errors.append(
                f"{self!r}: shrink(DEFAULT) with operations in flight (NCCL would hang)"
            )
        blocking = self.blocking if config is None else config.blocking is not False
        survivors = [r for r in range(self.world.nranks) if r not in drop]
        key = (
            self.world.key,
            "shrink",
            tuple(drop),
            self.sim.round(self.world, ("shrink", tuple(drop)), self.rank),
        )
        child = self.sim.join(
            key, len(survivors), survivors.index(self.rank), blocking, self.device
        )
        if busy and flag != _nc.CommShrinkFlag.ABORT:
            child.error = int(Result.InvalidUsage)
        return self._adopt(child)

    def _split(self, color: Any, key: Any, config: Any) -> Any:
        if config is not None and not isinstance(config, _nc.NCCLConfig):
            raise TypeError(f"config must be an NCCLConfig, got {config!r}")
        for what, v in (("color", color), ("key", key)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise TypeError(f"{what} must be an int, got {v!r}")
        busy = any(not la.finished() for la in self.launches)
        if busy:
            self.sim.gpu.errors.append(
                f"{self!r}: split with operations in flight (NCCL would hang)"
            )
        blocking = self.blocking if config is None else config.blocking is not False
        child = self.sim.split(self, -1 if color is None else int(color), int(key), blocking)
        return self._adopt(child)

    def _adopt(self, child: CommState) -> Any:
        """The parent's job runs until the child's world is complete; only then is the handle filled."""
        if not self.blocking:
            child.filled = False
            self.child = child
        return child.mock

    def _get_unique_id(self) -> Any:
        if self.world.grow_uid is not None:
            raise nccl_error(Result.InvalidUsage)  # nccl.h: not while a previous id is unconsumed
        uid = self.sim.new_uid()
        self.world.grow_uid = bytes(uid)
        return uid

    def _grow(self, nranks: Any, unique_id: Any, rank: Any, config: Any) -> Any:
        new_rank = rank is not None
        if new_rank and self.world is not None:
            raise _nc.NcclInvalid("New ranks must use a null communicator (Communicator())")
        if not new_rank and self.world is None:
            raise _nc.NcclInvalid("Existing ranks must use an initialized communicator")
        blocking = config is None or config.blocking is not False
        if not new_rank:
            world = self.world
            if int(nranks) <= world.nranks:
                raise nccl_error(Result.InvalidArgument)  # init.cc:3233
            if unique_id is not None and bytes(unique_id) != world.grow_uid:
                raise nccl_error(Result.InvalidArgument)  # the magic of a consumed or foreign id
            uid = world.grow_uid
            if uid is None:
                raise nccl_error(Result.InvalidArgument)  # no root took an id for this grow
            key = (world.key, "grow", uid)
            child = self.sim.join(
                key,
                int(nranks),
                self.rank,
                self.blocking if config is None else blocking,
                self.device,
                parent_nranks=world.nranks,
            )
            return self._adopt(child)
        if unique_id is None or not 0 <= int(rank) < int(nranks):
            raise nccl_error(Result.InvalidArgument)  # init.cc:3274-3289
        owner = self.sim.grow_owner(bytes(unique_id))
        if owner is None or int(rank) < owner.nranks:
            raise nccl_error(Result.InvalidArgument)
        key = (owner.key, "grow", bytes(unique_id))
        return self.sim.join(
            key,
            int(nranks),
            int(rank),
            blocking,
            self.sim.current_device(),
            parent_nranks=owner.nranks,
        ).mock
