"""A multi-rank NCCL in one process, behind nccl4py's exact interface.

:class:`SimNccl` builds a stand-in for the ``nccl.core`` module whose
``Communicator`` (class and instances), ``group_start``, ``group_end`` and
``get_unique_id`` are ``unittest.mock.create_autospec`` objects of the *real*
nccl4py ones: a misspelled method, a wrong number of arguments or an unknown
keyword raises ``TypeError``/``AttributeError`` exactly where nccl4py would. The
enums, ``NCCLConfig``, ``UniqueId`` and ``get_error_string`` are the real ones;
``get_async_error`` returns real ``nccl.bindings.nccl.Result`` values.

Semantics modelled (ranks are threads of this process, one communicator each):

* non-blocking communicators: ``init`` returns at once and reports ``InProgress``
  until every rank called it; every launch (a call outside a group, or a
  ``group_end``) reports ``InProgress`` for ``inprogress_polls`` polls and only
  then puts its kernel on the stream (NCCL may defer the launch). Anything else
  enqueued on that stream meanwhile is recorded in ``gpu.errors``.
* collectives compute real results on the ranks' tensors when every rank's
  kernel reached the head of its stream; send/recv match per (src, dst) pair;
  all ops of one group progress together (fusion).
* ``finalize`` (polled), ``destroy``, ``abort`` (frees the handle: later calls
  raise ``NcclInvalid``), ``shrink`` (flags checked, survivors renumbered).
* ``revoke`` (nccl4py's rules): in-flight kernels stop, the state reads
  ``InProgress`` for ``revoke_polls`` polls, then ``Success`` (quiescent, the
  earlier error cleared). Afterwards shrink (either flag), abort and destroy are
  allowed; ``finalize``, data ops, and any call before the revoke was polled to
  completion are contract breaches (``gpu.errors`` + ``InvalidUsage``).
  ``SimNccl(revoke=False)`` is an nccl4py/NCCL without ``revoke`` (the
  autospec is of the real class minus that method).
* faults: :meth:`SimNccl.kill` (peers see ``RemoteError``), :meth:`SimNccl.stall_revoke`
  (a revoke never quiesces), :meth:`SimNccl.hang`
  (a rank's kernels never complete), :meth:`SimNccl.set_error`, and
  :meth:`SimNccl.block_calls` (NCCL calls of a rank block until a latch opens).
"""

from __future__ import annotations

import collections
import functools
import inspect
import os
import threading
import types
from typing import Any
from unittest import mock

import nccl.bindings.nccl as _b
import nccl.core as _nc
import torch
from nccl.core.interop.torch import _to_nccl_dtype

from .compute import _compute
from .device import Latch, SimGPU, SimStream, SimTensor, _Item, _key, _plain

Result = _b.Result
_REAL = _nc.Communicator
_SIG = {name: inspect.signature(getattr(_REAL, name)) for name in dir(_REAL)
        if not name.startswith("_") and callable(getattr(_REAL, name, None))}


def _without(cls: type, name: str) -> type:
    """``cls``'s interface minus method ``name`` (an older nccl4py), for ``create_autospec``."""
    ns: dict[str, Any] = {}
    for klass in reversed(cls.__mro__[:-1]):
        ns.update({k: v for k, v in vars(klass).items() if k not in ("__dict__", "__weakref__")})
    ns.pop(name)
    return type(cls.__name__, (), ns)


_COLL = ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter")
_DATA = (*_COLL, "send", "recv", "alltoall", "gather", "scatter")


class _Op:
    __slots__ = ("kind", "comm", "send", "recv", "op", "root", "peer", "key", "done", "launch", "count", "dtype")

    def __init__(self, kind: str, comm: _CommState, **kw: Any) -> None:
        self.kind = kind
        self.comm = comm
        self.send: Any = kw.get("send")
        self.recv: Any = kw.get("recv")
        self.op: Any = kw.get("op")
        self.root: Any = kw.get("root")
        self.peer: Any = kw.get("peer")
        self.key: Any = None
        self.done = False
        self.launch: _Launch | None = None
        buf = self.send if self.send is not None else self.recv
        self.count = int(buf.numel()) if buf is not None else 0
        self.dtype: Any = buf.dtype if buf is not None else None


class _Launch:
    """The kernel of one call outside a group, or of one communicator's part of a group."""

    def __init__(self, comm: _CommState, ops: list[_Op], stream: SimStream) -> None:
        self.comm = comm
        self.ops = ops
        self.stream = stream
        self.at_head = False
        self.pushed = False  # on its stream (ncclInProgress cleared)
        self.aborted = False
        self.drained = False
        for op in ops:
            op.launch = self

    def finished(self) -> bool:
        return self.aborted or all(op.done for op in self.ops)


class _World:
    def __init__(self, nranks: int, key: Any) -> None:
        self.nranks = nranks
        self.key = key
        self.comms: dict[int, _CommState] = {}
        self.colls: dict[int, dict[int, _Op]] = collections.defaultdict(dict)
        self.p2p: dict[tuple[int, int, int], dict[str, _Op]] = collections.defaultdict(dict)
        self.shrinks = 0

    def complete(self) -> bool:
        return len(self.comms) == self.nranks


class _CommState:
    """What one simulated ``ncclComm_t`` knows; its ``mock`` is what the code under test holds."""

    def __init__(self, sim: SimNccl, world: _World, rank: int, blocking: bool) -> None:
        self.sim = sim
        self.world = world
        self.rank = rank
        self.blocking = blocking
        self.valid = True
        self.aborted = False
        self.destroyed = False
        self.finalizing = False
        self.dead = False
        self.hung = False
        self.error = 0
        self.polls_left = 0
        self.deferred: list[_Launch] = []
        self.launches: list[_Launch] = []
        self.colls = 0
        self.p2p: collections.Counter[tuple[int, int]] = collections.Counter()
        self.calls: list[str] = []
        self.block: Latch | None = None
        self.fail: dict[str, BaseException] = {}
        self.revoked = False
        self.revoke_polls = 0  # polls left before a revoke reads Success
        self.revoke_stalled = False  # stall_revoke(): never quiescent
        self.shrink_flags: list[Any] = []  # the flag of every shrink on this communicator
        m = mock.create_autospec(sim.spec, instance=True, spec_set=True)
        for name in _SIG:
            if hasattr(m, name):
                getattr(m, name).side_effect = functools.partial(self.call, name)
        self.mock = m

    def __repr__(self) -> str:
        return f"<SimComm rank={self.rank}/{self.world.nranks} valid={self.valid}>"

    # -------------------------------------------------------------- dispatch
    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        bound = _SIG[name].bind(None, *args, **kwargs)  # the mock already checked arity
        bound.apply_defaults()
        a = dict(bound.arguments)
        a.pop("self", None)
        latch = self.block
        if latch is not None:  # an NCCL call stuck inside the library
            with self.sim.gpu._cv:
                self.sim.gpu._cv.wait_for(lambda: latch.is_open, self.sim.gpu.sync_limit)
        with self.sim.gpu._cv:
            self.calls.append(name)
            if name in ("abort", "destroy", "finalize") and not self.valid:
                return None  # nccl4py: a null communicator makes these no-ops
            if not self.valid:
                raise _nc.NcclInvalid(f"Cannot {name}: Communicator not initialized")
            if name in self.fail:
                raise self.fail.pop(name)
            if self.revoked:
                self._check_revoked(name)
            fn = getattr(self, "_" + name, None)
            if fn is None:
                raise NotImplementedError(f"nccl4py Communicator.{name} is not simulated")
            try:
                return fn(**a)
            finally:
                if name in _DATA:  # the mock's call records would keep the tensors alive
                    self.mock.reset_mock()

    # ------------------------------------------------------------- buffers
    def _buffer(self, t: Any, what: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise _nc.NcclInvalid(f"{what} must be a tensor here, got {type(t).__name__}")
        _to_nccl_dtype(t.dtype)  # the real mapping: NcclInvalid for complex, int16, ...
        if not isinstance(t, SimTensor):
            self.sim.gpu.error(f"{what}: a host tensor was passed to NCCL (not a simulated CUDA tensor)")
        if not t.is_contiguous():
            self.sim.gpu.error(f"{what}: a non-contiguous tensor was passed to NCCL")
        return _plain(t)  # like a device pointer: does not keep the caller's tensor alive

    def _stream(self, stream: Any) -> SimStream:
        if isinstance(stream, bool):
            raise TypeError("stream must not be a bool")
        handle = 0 if stream is None else stream if isinstance(stream, int) else int(stream.__cuda_stream__()[1])
        if handle == 0:
            self.sim.gpu.error("an NCCL op was enqueued on the default stream (stream=None/0)")
            return self.sim.gpu.default_stream
        return self.sim.gpu.stream_by_handle(handle)

    def _redop(self, op: Any) -> int:
        if not isinstance(op, _nc.NcclRedOp):
            raise TypeError(f"op must be an nccl.core.NcclRedOp, got {op!r}")
        return int(op)

    def _root(self, root: Any) -> int:
        if isinstance(root, (bool, _nc.NcclRedOp)) or not isinstance(root, int):
            raise TypeError(f"root must be a rank (int), got {root!r}")
        if not 0 <= root < self.world.nranks:
            raise _b.NCCLError(int(Result.InvalidArgument))
        return root

    # ----------------------------------------------------------- collectives
    def _allreduce(self, sendbuf: Any, recvbuf: Any, op: Any, stream: Any, config: Any) -> None:
        self._reduce(sendbuf, recvbuf, op, None, stream, config)

    def _reduce(self, sendbuf: Any, recvbuf: Any, op: Any, root: Any, stream: Any, config: Any) -> None:
        s = self._buffer(sendbuf, "sendbuf")
        r = None
        if root is None or self._root(root) == self.rank:
            r = self._buffer(recvbuf, "recvbuf")
            if r.dtype != s.dtype:
                raise _nc.NcclInvalid(f"Dtype mismatch: sendbuf has dtype {s.dtype}, recvbuf has dtype {r.dtype}")
            if r.numel() < s.numel():
                raise _nc.NcclInvalid("Buffer count mismatch")
        kind = "allreduce" if root is None else "reduce"
        self._issue(_Op(kind, self, send=s, recv=r, op=self._redop(op), root=root), self._stream(stream))

    def _broadcast(self, sendbuf: Any, recvbuf: Any, root: Any, stream: Any, config: Any) -> None:
        root = self._root(root)
        r = self._buffer(recvbuf, "recvbuf")
        s = None
        if root == self.rank:
            s = self._buffer(sendbuf, "sendbuf")
            if s.dtype != r.dtype or s.numel() != r.numel():
                raise _nc.NcclInvalid("broadcast: sendbuf and recvbuf differ")
        op = _Op("broadcast", self, send=s, recv=r, root=root)
        op.count, op.dtype = int(r.numel()), r.dtype
        self._issue(op, self._stream(stream))

    def _allgather(self, sendbuf: Any, recvbuf: Any, stream: Any, config: Any) -> None:
        s, r = self._buffer(sendbuf, "sendbuf"), self._buffer(recvbuf, "recvbuf")
        if r.numel() < s.numel() * self.world.nranks or r.dtype != s.dtype:
            raise _nc.NcclInvalid("allgather: recvbuf too small or of another dtype")
        self._issue(_Op("allgather", self, send=s, recv=r), self._stream(stream))

    def _reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: Any, stream: Any, config: Any) -> None:
        s, r = self._buffer(sendbuf, "sendbuf"), self._buffer(recvbuf, "recvbuf")
        if s.numel() < r.numel() * self.world.nranks or r.dtype != s.dtype:
            raise _nc.NcclInvalid("reduce_scatter: sendbuf too small or of another dtype")
        o = _Op("reduce_scatter", self, send=s, recv=r, op=self._redop(op))
        o.count = int(r.numel())
        self._issue(o, self._stream(stream))

    def _send(self, sendbuf: Any, peer: Any, stream: Any) -> None:
        self._issue(_Op("send", self, send=self._buffer(sendbuf, "sendbuf"), peer=self._root(peer)), self._stream(stream))

    def _recv(self, recvbuf: Any, peer: Any, stream: Any) -> None:
        self._issue(_Op("recv", self, recv=self._buffer(recvbuf, "recvbuf"), peer=self._root(peer)), self._stream(stream))

    def _issue(self, op: _Op, stream: SimStream) -> None:
        group = self.sim._group()
        if group is not None:
            group.append((op, stream))
        else:
            self.launch([op], stream)

    def launch(self, ops: list[_Op], stream: SimStream) -> None:
        """Number the ops (issue order) and launch them now or after InProgress clears."""
        for op in ops:
            if op.kind in _COLL:
                op.key = self.colls
                self.colls += 1
                self.world.colls[op.key][self.rank] = op
            else:
                src, dst = (self.rank, op.peer) if op.kind == "send" else (op.peer, self.rank)
                k = self.p2p[(src, dst, op.kind)]  # type: ignore[index]
                self.p2p[(src, dst, op.kind)] += 1  # type: ignore[index]
                op.key = (src, dst, k)
                self.world.p2p[op.key][op.kind] = op
        la = _Launch(self, ops, stream)
        self.launches.append(la)
        if self.blocking:
            self.sim._push_launch(la)
        else:
            self.deferred.append(la)
            self.polls_left = max(self.polls_left, self.sim.inprogress_polls)

    # ------------------------------------------------------------- state
    def _check_revoked(self, name: str) -> None:
        """nccl4py: after revoke only shrink/split/abort/destroy, once it is quiescent."""
        if name in ("get_async_error", "get_last_error", "abort", "destroy"):
            return
        why = None
        if name == "finalize":
            why = "finalize() after revoke() (invalid)"
        elif name not in ("shrink", "split"):
            why = f"{name}() on a revoked communicator"
        elif self.revoke_stalled or self.revoke_polls > 0:
            why = f"{name}() before the revoke was polled to ncclSuccess"
        if why is not None:
            self.sim.gpu.errors.append(f"{self!r}: {why}")
            raise _b.NCCLError(int(Result.InvalidUsage))

    def _revoke(self, flags: int = 0) -> None:
        if isinstance(flags, bool) or not isinstance(flags, int):
            raise TypeError(f"flags must be an int, got {flags!r}")
        if flags != 0:
            raise _b.NCCLError(int(Result.InvalidArgument))  # reserved: must be 0
        if self.revoked:
            return
        self.revoked = True
        self._abort_launches()  # in-flight ops stop (their Works fail upstream)
        self.revoke_polls = max(1, self.sim.revoke_polls)

    def _get_async_error(self) -> Any:
        if self.revoked and (self.revoke_stalled or self.revoke_polls > 0):
            if not self.revoke_stalled:
                self.revoke_polls -= 1
            if self.revoke_stalled or self.revoke_polls > 0:
                return Result.InProgress
            self.error = 0  # quiescent: ncclSuccess
        if self.error:
            return Result(self.error)
        if not self.world.complete():
            return Result.InProgress
        if self.deferred or self.polls_left > 0:
            self.polls_left -= 1
            if self.polls_left > 0:
                return Result.InProgress
            for la in self.deferred:
                self.sim._push_launch(la)
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
        self._abort_launches()
        self._free()
        self.aborted = True

    def _abort_launches(self) -> None:
        for la in self.launches:
            if not la.finished():
                la.aborted = True
        self.deferred.clear()
        self.sim.gpu._cv.notify_all()

    def _free(self) -> None:
        self.valid = False
        self.mock.is_valid = False

    def _shrink(self, exclude_ranks: Any, config: Any, flag: Any) -> Any:
        if not isinstance(flag, _nc.CommShrinkFlag):
            raise TypeError(f"flag must be an nccl.core.CommShrinkFlag, got {flag!r}")
        if config is not None and not isinstance(config, _nc.NCCLConfig):
            raise TypeError(f"config must be an NCCLConfig, got {config!r}")
        drop = sorted(int(r) for r in (exclude_ranks or []))
        if self.rank in drop:
            self.sim.gpu.errors.append(f"{self!r}: an excluded rank called shrink")
            raise _b.NCCLError(int(Result.InvalidUsage))
        self.shrink_flags.append(flag)
        busy = any(not la.finished() for la in self.launches)
        if flag == _nc.CommShrinkFlag.ABORT:
            self._abort_launches()
        elif busy:
            self.sim.gpu.errors.append(f"{self!r}: shrink(DEFAULT) with operations in flight (NCCL would hang)")
        blocking = self.blocking if config is None else config.blocking is not False
        survivors = [r for r in range(self.world.nranks) if r not in drop]
        key = (self.world.key, "shrink", tuple(drop), self.sim._shrink_round(self.world, tuple(drop), self.rank))
        new = self.sim._join(key, len(survivors), survivors.index(self.rank), blocking)
        if busy and flag != _nc.CommShrinkFlag.ABORT:
            new.error = int(Result.InvalidUsage)
        self.polls_left = max(self.polls_left, 1)
        return new.mock


class SimNccl:
    """The NCCL of every simulated rank in this process (see the module docstring)."""

    def __init__(self, gpu: SimGPU, *, inprogress_polls: int = 2, revoke: bool = True, revoke_polls: int = 3) -> None:
        self.gpu = gpu
        self.inprogress_polls = inprogress_polls
        self.revoke_polls = revoke_polls
        #: The nccl4py ``Communicator`` interface simulated (``revoke=False``: one without revoke).
        self.spec: type = _REAL if revoke else _without(_REAL, "revoke")
        self.comms: list[_CommState] = []
        self._worlds: dict[Any, _World] = {}
        self._by_mock: dict[int, _CommState] = {}
        self._tls = threading.local()
        self._rounds: collections.Counter[Any] = collections.Counter()
        gpu.push_checks.append(self._check_push)
        m = types.ModuleType("nccl.core(simulated)")
        for name in ("NcclRedOp", "NCCLConfig", "UniqueId", "CommShrinkFlag", "NcclInvalid",
                     "NcclDataType", "get_error_string", "get_version"):
            setattr(m, name, getattr(_nc, name))
        m.Communicator = mock.create_autospec(self.spec, spec_set=True)  # type: ignore[attr-defined]
        m.Communicator.init.side_effect = self._init
        m.group_start = mock.create_autospec(_nc.group_start, side_effect=self._group_start)  # type: ignore[attr-defined]
        m.group_end = mock.create_autospec(_nc.group_end, side_effect=self._group_end)  # type: ignore[attr-defined]
        m.get_unique_id = mock.create_autospec(_nc.get_unique_id, side_effect=self._unique_id)  # type: ignore[attr-defined]
        self.module = m

    # ---------------------------------------------------------------- faults
    def state(self, comm: Any) -> _CommState:
        """The simulator's state behind a communicator mock."""
        return self._by_mock[id(comm)]

    def kill(self, comm: Any) -> None:
        """The rank of ``comm`` dies: its kernels never complete; its peers see RemoteError."""
        st = self.state(comm)
        with self.gpu._cv:
            st.dead = True
            for other in st.world.comms.values():
                if other is not st and other.valid:
                    other.error = int(Result.RemoteError)
            self.gpu._cv.notify_all()

    def stall_revoke(self, comm: Any) -> None:
        """A revoke of ``comm`` never quiesces (its state stays ``InProgress``)."""
        self.state(comm).revoke_stalled = True

    def hang(self, comm: Any) -> None:
        """The kernels of ``comm``'s rank never complete (no error is reported)."""
        self.state(comm).hung = True

    def set_error(self, comm: Any, code: int) -> None:
        with self.gpu._cv:
            self.state(comm).error = int(code)

    def fail_call(self, comm: Any, name: str, exc: BaseException) -> None:
        """The next call of method ``name`` on ``comm`` raises ``exc`` (e.g. ``NcclInvalid``)."""
        self.state(comm).fail[name] = exc

    def block_calls(self, comm: Any, latch: Latch | None) -> None:
        """Every NCCL call on ``comm`` blocks inside the library until ``latch`` opens."""
        self.state(comm).block = latch

    def drain_aborted(self) -> None:
        """Let aborted kernels leave their streams (with ``SimGPU(abort_drains=False)``)."""
        with self.gpu._cv:
            for st in self.comms:
                for la in st.launches:
                    la.drained = True
            self.gpu._cv.notify_all()

    def pushed(self, comm: Any) -> int:
        """How many launches of ``comm`` are on their stream (left ncclInProgress)."""
        with self.gpu._cv:
            return sum(1 for la in self.state(comm).launches if la.pushed)

    def live(self) -> list[_CommState]:
        """Communicators neither destroyed nor aborted (leaks)."""
        return [c for c in self.comms if c.valid]

    # ----------------------------------------------------------- module API
    def _unique_id(self, empty: bool = False) -> Any:
        return _nc.UniqueId.from_bytes(bytes(128) if empty else os.urandom(128))

    def _init(self, nranks: Any, rank: Any, unique_id: Any, config: Any = None) -> Any:
        if not isinstance(unique_id, _nc.UniqueId):
            raise _nc.NcclInvalid(f"unique_id must be a UniqueId, got {type(unique_id).__name__}")
        if config is not None and not isinstance(config, _nc.NCCLConfig):
            raise TypeError(f"config must be an NCCLConfig, got {config!r}")
        if not isinstance(nranks, int) or not isinstance(rank, int) or not 0 <= rank < nranks:
            raise _b.NCCLError(int(Result.InvalidArgument))
        blocking = config is None or config.blocking is not False
        st = self._join(bytes(unique_id), nranks, rank, blocking)
        if blocking:  # ncclCommInitRank blocks until every rank arrived
            with self.gpu._cv:
                if not self.gpu._cv.wait_for(st.world.complete, self.gpu.sync_limit):
                    raise _b.NCCLError(int(Result.Timeout))
        return st.mock

    def _join(self, key: Any, nranks: int, rank: int, blocking: bool) -> _CommState:
        with self.gpu._cv:
            world = self._worlds.get(key)
            if world is None:
                world = self._worlds[key] = _World(nranks, key)
            if world.nranks != nranks or rank in world.comms:
                raise _b.NCCLError(int(Result.InvalidUsage))
            st = _CommState(self, world, rank, blocking)
            world.comms[rank] = st
            self.comms.append(st)
            self._by_mock[id(st.mock)] = st
            self.gpu._cv.notify_all()
            return st

    def _shrink_round(self, world: _World, drop: tuple[int, ...], rank: int) -> int:
        k = (world.key, drop, rank)
        n = self._rounds[k]
        self._rounds[k] += 1
        return n

    def _group(self) -> list[tuple[_Op, SimStream]] | None:
        return getattr(self._tls, "ops", None) if getattr(self._tls, "depth", 0) else None

    def _group_start(self) -> None:
        depth = getattr(self._tls, "depth", 0)
        if depth == 0:
            self._tls.ops = []
        self._tls.depth = depth + 1

    def _group_end(self, *, simulate: bool = False) -> Any:
        depth = getattr(self._tls, "depth", 0)
        if depth == 0:
            raise _b.NCCLError(int(Result.InvalidUsage))
        self._tls.depth = depth - 1
        if depth > 1:
            return None
        ops, self._tls.ops = self._tls.ops, []
        if simulate:  # ncclGroupSimulateEnd: nothing is launched
            return _nc.GroupSimInfo(estimated_time=0.0)
        with self.gpu._cv:
            by_comm: dict[int, list[tuple[_Op, SimStream]]] = collections.defaultdict(list)
            for op, stream in ops:
                by_comm[id(op.comm)].append((op, stream))
            for items in by_comm.values():
                streams = {id(s) for _, s in items}
                if len(streams) > 1:
                    self.gpu.errors.append("one communicator used several streams inside one group")
                items[0][0].comm.launch([op for op, _ in items], items[0][1])
        return None

    # ------------------------------------------------------------- device
    def _push_launch(self, la: _Launch) -> None:
        keys = [_key(t) for op in la.ops for t in (op.send, op.recv) if t is not None]
        item = _Item("nccl", functools.partial(self._ready, la), lambda: None, keys)
        item.launch = la
        la.pushed = True
        self.gpu._push(la.stream, item)

    def _check_push(self, stream: SimStream, item: _Item) -> None:
        if item.launch is not None:
            return
        for st in self.comms:
            if any(la.stream is stream for la in st.deferred):
                self.gpu.errors.append(
                    f"{item.kind} enqueued on {stream.name} while {st!r} is still ncclInProgress on it")

    def _ready(self, la: _Launch) -> bool:
        """Device thread: the launch is at the head of its stream; progress its ops."""
        la.at_head = True
        if la.aborted:
            return self.gpu.abort_drains or la.drained
        for op in la.ops:
            if not op.done:
                if op.kind in _COLL:
                    self._try_coll(op)
                else:
                    self._try_p2p(op)
        return la.finished()

    def _alive(self, op: _Op) -> bool:
        la = op.launch
        return la is not None and la.at_head and not la.aborted and not op.comm.dead and not op.comm.hung

    def _try_coll(self, op: _Op) -> None:
        world = op.comm.world
        group = world.colls[op.key]
        if len(group) < world.nranks or not all(self._alive(o) for o in group.values()):
            return
        ops = [group[r] for r in range(world.nranks)]
        first = ops[0]
        if any((o.kind, o.count, o.dtype, o.op, o.root) != (first.kind, first.count, first.dtype, first.op, first.root) for o in ops):
            self.gpu.errors.append(
                "collective mismatch across ranks: " + ", ".join(f"{o.kind}/{o.count}/{o.dtype}/op{o.op}/root{o.root}" for o in ops))
        else:
            _compute(ops, world.nranks)
        for o in ops:
            o.done = True
        del world.colls[op.key]

    def _try_p2p(self, op: _Op) -> None:
        pair = op.comm.world.p2p[op.key]
        s, r = pair.get("send"), pair.get("recv")
        if s is None or r is None or not (self._alive(s) and self._alive(r)):
            return
        if s.count != r.count or s.dtype != r.dtype:
            self.gpu.errors.append(f"send/recv mismatch {op.key}: {s.count}x{s.dtype} vs {r.count}x{r.dtype}")
        else:
            _plain(r.recv).copy_(_plain(s.send))
        s.done = r.done = True
        del op.comm.world.p2p[op.key]

