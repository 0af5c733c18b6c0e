"""A multi-rank NCCL in one process, behind nccl4py's exact interface.

:class:`SimNccl` builds a stand-in for the ``nccl.core`` module whose
``Communicator`` (class and instances), ``group_start``, ``group_end`` and
``get_unique_id`` are ``unittest.mock.create_autospec`` objects of the *real*
nccl4py ones: a misspelled method, a wrong number of arguments or an unknown
keyword raises ``TypeError``/``AttributeError`` exactly where nccl4py would. The
enums, ``NCCLConfig``, ``UniqueId`` and ``get_error_string`` are the real ones;
``get_async_error`` returns real ``nccl.bindings.nccl.Result`` values.

Semantics (ranks are threads of this process, one communicator each, each on the
device that was current on its thread at init: ``ncclCommInitRank`` uses
``cudaGetDevice``); the per-communicator rules are in ``comm.py``, what runs on the
device in ``world.py``:

* non-blocking communicators: ``init`` returns at once and reports ``InProgress``
  until every rank called it; every launch (a call outside a group, or a
  ``group_end``) reports ``InProgress`` for ``inprogress_polls`` polls and only
  then puts its kernel on the stream (NCCL may defer the launch). Anything else
  enqueued on that stream meanwhile is recorded in ``gpu.errors``.
* ``group_end(simulate=True)`` launches a non-blocking group like ``group_end``:
  ``ncclGroupEndInternal`` hands a non-blocking group to ``groupLaunchNonBlocking``,
  which calls ``groupLaunch`` without the simulation info (group.cc:762-764, 852-857),
  so ``ncclGroupSimulateEnd`` cannot discard a half-built group.
* a group whose calls failed inside NCCL (the group error) launches nothing and
  ``group_end`` raises that error (group.cc:788 ``goto fail`` → ``groupCleanup``).
* collectives compute real results on the ranks' tensors once every rank's
  kernel runs; send/recv match per (src, dst) pair; all ops of one group progress
  together (fusion).
* launches of communicators that share a device follow the same host order on
  every rank (``world.Device.check_order``).
* faults: :meth:`SimNccl.kill` (peers see ``RemoteError``), :meth:`SimNccl.stall_revoke`
  (a revoke never quiesces), :meth:`SimNccl.hang` (a rank's kernels never complete),
  :meth:`SimNccl.set_error`, :meth:`SimNccl.fail_call`, and :meth:`SimNccl.block_calls`
  (a rank's launches are stuck inside NCCL until a latch opens: see ``comm.py``).
"""

from __future__ import annotations

import collections
import os
import threading
import types
from typing import Any
from unittest import mock

import nccl.bindings.nccl as _b
import nccl.core as _nc

from .comm import REAL, CommState, nccl_error
from .device import Device, Latch, StreamState
from .world import Kernels, Op, World

Result = _b.Result


def _without(cls: type, name: str) -> type:
    """``cls``'s interface minus method ``name`` (an older nccl4py), for ``create_autospec``."""
    ns: dict[str, Any] = {}
    for klass in reversed(cls.__mro__[:-1]):
        ns.update({k: v for k, v in vars(klass).items() if k not in ("__dict__", "__weakref__")})
    ns.pop(name)
    return type(cls.__name__, (), ns)


class SimNccl:
    """The NCCL of every simulated rank in this process (see the module docstring)."""

    def __init__(
        self,
        gpu: Device,
        *,
        inprogress_polls: int = 2,
        revoke: bool = True,
        revoke_polls: int = 3,
        grow: bool = True,
    ) -> None:
        self.gpu = gpu
        self.inprogress_polls = inprogress_polls
        self.revoke_polls = revoke_polls
        spec: type = REAL
        for name, present in (("revoke", revoke), ("grow", grow), ("get_unique_id", grow)):
            if not present:  # an nccl4py/libnccl without it
                spec = _without(spec, name)
        #: The nccl4py ``Communicator`` interface simulated.
        self.spec = spec
        self.comms: list[CommState] = []
        self.device = Kernels(self)
        self._worlds: dict[Any, World] = {}
        self._by_mock: dict[int, CommState] = {}
        self._tls = threading.local()
        self._rounds: collections.Counter[Any] = collections.Counter()
        self._splits: dict[
            Any, dict[int, Any]
        ] = {}  # (parent world, n) -> rank -> color, key, child
        gpu.push_checks.append(self._check_push)
        m = types.ModuleType("nccl.core(simulated)")
        for name in (
            "NcclRedOp",
            "NCCLConfig",
            "UniqueId",
            "CommShrinkFlag",
            "NcclInvalid",
            "NcclDataType",
            "get_error_string",
            "get_version",
        ):
            setattr(m, name, getattr(_nc, name))
        m.Communicator = mock.create_autospec(self.spec, spec_set=True)  # type: ignore[attr-defined]
        m.Communicator.init.side_effect = self._init
        m.Communicator.side_effect = self._null
        m.group_start = mock.create_autospec(_nc.group_start, side_effect=self._group_start)  # type: ignore[attr-defined]
        m.group_end = mock.create_autospec(_nc.group_end, side_effect=self._group_end)  # type: ignore[attr-defined]
        m.get_unique_id = mock.create_autospec(_nc.get_unique_id, side_effect=self._unique_id)  # type: ignore[attr-defined]
        self.module = m

    def new_mock(self) -> Any:
        return mock.create_autospec(self.spec, instance=True, spec_set=True)

    # ---------------------------------------------------------------- faults
    def state(self, comm: Any) -> CommState:
        """The simulator's state behind a communicator mock."""
        return self._by_mock[id(comm)]

    def kill(self, comm: Any) -> None:
        """The rank of ``comm`` dies: its kernels never complete; its peers see RemoteError."""
        st = self.state(comm)
        with self.gpu.cv:
            st.dead = True
            for other in st.world.comms.values():
                if other is not st and other.valid:
                    other.error = int(Result.RemoteError)
            self.gpu.cv.notify_all()

    def stall_revoke(self, comm: Any) -> None:
        """A revoke of ``comm`` never quiesces (its state stays ``InProgress``)."""
        self.state(comm).revoke_stalled = True

    def hang(self, comm: Any) -> None:
        """The kernels of ``comm``'s rank never complete (no error is reported)."""
        self.state(comm).hung = True

    def set_error(self, comm: Any, code: int) -> None:
        with self.gpu.cv:
            self.state(comm).error = int(code)

    def fail_call(self, comm: Any, name: str, exc: BaseException) -> None:
        """The next call of method ``name`` on ``comm`` raises ``exc`` (``NcclInvalid``: nccl4py's
        own check; ``NCCLError``: NCCL's, which also sets the group and async errors)."""
        self.state(comm).fail[name] = exc

    def block_calls(self, comm: Any, latch: Latch | None) -> None:
        """``comm``'s launches get stuck inside NCCL until ``latch`` opens: on a blocking
        communicator every call blocks; on a non-blocking one a launch stays
        ``ncclInProgress`` and only abort and revoke block (``comm.py``)."""
        self.state(comm).block = latch

    def in_progress(self, comm: Any) -> int:
        """Launches of ``comm`` that NCCL has not put on their stream (still ncclInProgress)."""
        with self.gpu.cv:
            return len(self.state(comm).deferred)

    def drain_aborted(self) -> None:
        """Let aborted kernels leave their streams (with ``SimGPU(abort_drains=False)``)."""
        with self.gpu.cv:
            for st in self.comms:
                for la in st.launches:
                    la.drained = True
            self.gpu.cv.notify_all()

    def pushed(self, comm: Any) -> int:
        """How many launches of ``comm`` are on their stream (left ncclInProgress)."""
        with self.gpu.cv:
            return sum(1 for la in self.state(comm).launches if la.pushed)

    def live(self) -> list[CommState]:
        """Communicators neither destroyed nor aborted (leaks)."""
        return [c for c in self.comms if c.valid]

    # ----------------------------------------------------------- module API
    def new_uid(self) -> Any:
        return _nc.UniqueId.from_bytes(os.urandom(128))

    def _unique_id(self, empty: bool = False) -> Any:
        return _nc.UniqueId.from_bytes(bytes(128)) if empty else self.new_uid()

    def current_device(self) -> int:
        d: int = self.gpu.runtime.current_device()
        return d

    def _null(self, ptr: Any = None) -> Any:
        """``Communicator()``: a null communicator (only ``grow`` as a new rank is meaningful)."""
        if ptr not in (None, 0):
            raise NotImplementedError("wrapping a raw ncclComm_t pointer is not simulated")
        st = CommState(self, None, -1, True, self.current_device())
        self._by_mock[id(st.mock)] = st
        return st.mock

    def _init(self, nranks: Any, rank: Any, unique_id: Any, config: Any = None) -> Any:
        if not isinstance(unique_id, _nc.UniqueId):
            raise _nc.NcclInvalid(f"unique_id must be a UniqueId, got {type(unique_id).__name__}")
        if config is not None and not isinstance(config, _nc.NCCLConfig):
            raise TypeError(f"config must be an NCCLConfig, got {config!r}")
        if not isinstance(nranks, int) or not isinstance(rank, int) or not 0 <= rank < nranks:
            raise nccl_error(Result.InvalidArgument)
        blocking = config is None or config.blocking is not False
        st = self.join(bytes(unique_id), nranks, rank, blocking, self.current_device())
        if blocking:  # ncclCommInitRank blocks until every rank arrived
            with self.gpu.cv:
                if not self.gpu.cv.wait_for(st.world.complete, self.gpu.sync_limit):
                    raise nccl_error(Result.Timeout)
        return st.mock

    def join(
        self,
        key: Any,
        nranks: int,
        rank: int,
        blocking: bool,
        device: int,
        parent_nranks: int | None = None,
    ) -> CommState:
        """Rank ``rank`` joins the world ``key`` (created by its first member)."""
        with self.gpu.cv:
            world = self._worlds.get(key)
            if world is None:
                world = self._worlds[key] = World(nranks, key)
            if world.nranks != nranks or rank in world.comms:
                raise nccl_error(Result.InvalidUsage)
            st = CommState(self, world, rank, blocking, device)
            world.comms[rank] = st
            self.device.hosts.setdefault(key, set()).add(device)
            self.comms.append(st)
            self._by_mock[id(st.mock)] = st
            if world.complete() and isinstance(key, tuple) and len(key) == 3 and key[1] == "grow":
                parent = self._worlds.get(key[0])
                if parent is not None:  # the id is consumed by this grow
                    parent.grown.add(key[2])
                    parent.grow_uid = None
            self.gpu.cv.notify_all()
            return st

    def split(self, parent: CommState, color: int, key: int, blocking: bool) -> CommState:
        """``parent``'s rank calls ``ncclCommSplit`` (see ``comm.py``): its child, filled
        once every rank of the parent called it (a null communicator for color -1)."""
        with self.gpu.cv:
            n = self.round(parent.world, "split", parent.rank)
            gather = self._splits.setdefault((parent.world.key, n), {})
            child = CommState(self, None, -1, blocking, parent.device)
            child.split_of = (parent.world, gather)
            self._by_mock[id(child.mock)] = child
            gather[parent.rank] = (color, key, child)
            if len(gather) < parent.world.nranks:
                return child
            colors: dict[int, list[tuple[int, int, CommState]]] = {}
            for r in sorted(gather):  # commGetSplitInfo: by key, then by parent rank
                c, k, st = gather[r]
                if c != -1:  # NCCL_SPLIT_NOCOLOR: no child
                    colors.setdefault(c, []).append((k, r, st))
            for c, members in colors.items():
                members.sort(key=lambda m: (m[0], m[1]))
                wkey = (parent.world.key, "split", n, c)
                world = self._worlds[wkey] = World(len(members), wkey)
                for i, (_, _, st) in enumerate(members):
                    if st.aborted:  # the parent aborted the child's init (setCommAbortFlags)
                        continue
                    st.world, st.rank, st.valid = world, i, True
                    world.comms[i] = st
                    self.device.hosts.setdefault(wkey, set()).add(st.device)
                    self.comms.append(st)
            self.gpu.cv.notify_all()
            return child

    def child_done(self, child: CommState) -> bool:
        """Whether the job that makes ``child`` (a shrink's, grow's or split's) has ended."""
        if child.split_of is not None:
            world, gather = child.split_of
            if len(gather) < world.nranks:
                return False
            return child.world is None or child.world.complete()
        return bool(child.world.complete())

    def grow_owner(self, uid: bytes) -> World | None:
        """The world whose root took ``uid`` (for a new rank's grow), if still unconsumed."""
        with self.gpu.cv:
            for world in self._worlds.values():
                if world.grow_uid == uid:
                    return world
            return None

    def round(self, world: World, what: Any, rank: int) -> int:
        k = (world.key, what, rank)
        n = self._rounds[k]
        self._rounds[k] += 1
        return n

    # --------------------------------------------------------------- groups
    def in_group(self) -> bool:
        return bool(getattr(self._tls, "depth", 0))

    def group_add(self, op: Op, stream: StreamState) -> None:
        self._tls.ops.append((op, stream))

    def group_error(self, exc: _b.NCCLError) -> None:
        """group.h ``ncclGroupErrCheck``: the first error of a call inside a group."""
        if self.in_group() and getattr(self._tls, "error", None) is None:
            self._tls.error = exc

    def _group_start(self) -> None:
        depth = getattr(self._tls, "depth", 0)
        if depth == 0:
            self._tls.ops = []
            self._tls.error = None
        self._tls.depth = depth + 1

    def _group_end(self, *, simulate: bool = False) -> Any:
        depth = getattr(self._tls, "depth", 0)
        if depth == 0:
            raise nccl_error(Result.InvalidUsage)
        self._tls.depth = depth - 1
        if depth > 1:
            return None
        ops, self._tls.ops = self._tls.ops, []
        error, self._tls.error = self._tls.error, None
        if error is not None:  # groupCleanup: nothing is launched
            raise nccl_error(error.status)
        with self.gpu.cv:
            by_comm: dict[int, list[tuple[Op, StreamState]]] = collections.defaultdict(list)
            for op, stream in ops:
                by_comm[id(op.comm)].append((op, stream))
            if simulate and all(items[0][0].comm.blocking for items in by_comm.values()):
                return _nc.GroupSimInfo(estimated_time=0.0)  # a blocking group is only simulated
            for items in by_comm.values():
                if len({id(s) for _, s in items}) > 1:
                    self.gpu.errors.append("one communicator used several streams inside one group")
                items[0][0].comm.launch([op for op, _ in items], items[0][1])
        return _nc.GroupSimInfo(estimated_time=0.0) if simulate else None

    # ------------------------------------------------------------- device
    def _check_push(self, stream: StreamState, item: Any) -> None:
        if item.launch is not None:
            return
        for st in self.comms:
            if any(la.stream is stream for la in st.deferred):
                self.gpu.errors.append(
                    f"{item.kind} enqueued on {stream.name} while {st!r} is still ncclInProgress on it"
                )
