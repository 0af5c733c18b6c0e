"""The simulated NCCL on the device: communicator worlds, their ops, kernels and progress.

A *world* is one NCCL communicator as all its ranks share it (one per init, shrink
or grow). Its ranks' ops are matched by issue order: the k-th collective of every
rank forms one collective, the k-th send from ``a`` to ``b`` meets the k-th recv of
``b`` from ``a``. An NCCL kernel (:class:`Launch`) is an item on its stream
(``device.py``); once dispatched it runs, and it completes when every op in it has
met its peers' running kernels (all ops of one group progress together, as fused
in one kernel) — or when it was aborted (the abort flag makes running kernels exit;
one not started yet exits as soon as it starts).
"""

from __future__ import annotations

import collections
import functools
from typing import Any

from .compute import compute
from .device import Item, StreamState, plain, storage_key

#: A communicator's state (``comm.CommState``; world.py stands below it and names it so).
CommState = Any

COLL = ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter")
DATA = (*COLL, "send", "recv", "alltoall", "gather", "scatter")


class Op:
    __slots__ = (
        "kind",
        "comm",
        "send",
        "recv",
        "op",
        "root",
        "peer",
        "key",
        "done",
        "launch",
        "count",
        "dtype",
    )

    def __init__(self, kind: str, comm: CommState, **kw: Any) -> None:
        self.kind = kind
        self.comm = comm
        self.send: Any = kw.get("send")
        self.recv: Any = kw.get("recv")
        self.op: Any = kw.get("op")
        self.root: Any = kw.get("root")
        self.peer: Any = kw.get("peer")
        self.key: Any = None
        self.done = False
        self.launch: Launch | None = None
        buf = self.send if self.send is not None else self.recv
        self.count = int(buf.numel()) if buf is not None else 0
        self.dtype: Any = buf.dtype if buf is not None else None


class Launch:
    """The kernel of one call outside a group, or of one communicator's part of a group."""

    def __init__(self, comm: CommState, ops: list[Op], stream: StreamState) -> None:
        self.comm = comm
        self.ops = ops
        self.stream = stream
        self.running = False  # dispatched on the device
        self.pushed = False  # on its stream (ncclInProgress cleared)
        self.aborted = False
        self.drained = False
        self.left = False  # completed: off its stream
        for op in ops:
            op.launch = self

    def finished(self) -> bool:
        return self.aborted or all(op.done for op in self.ops)


class World:
    """One communicator as all its ranks share it."""

    count = 0

    def __init__(self, nranks: int, key: Any) -> None:
        self.nranks = nranks
        self.key = key
        self.comms: dict[int, CommState] = {}
        self.colls: dict[int, dict[int, Op]] = collections.defaultdict(dict)
        self.p2p: dict[tuple[int, int, int], dict[str, Op]] = collections.defaultdict(dict)
        self.grow_uid: bytes | None = (
            None  # the unconsumed id of get_unique_id (init.cc ncclCommGetUniqueId)
        )
        self.grown: set[bytes] = set()  # ids consumed by a grow of this world
        World.count += 1
        self.label = f"comm{World.count}({nranks} ranks)"

    def complete(self) -> bool:
        return len(self.comms) == self.nranks

    def __repr__(self) -> str:
        return f"<world {self.label}>"


class Kernels:
    """What the simulated NCCL puts on the device: kernels, and their progress."""

    def __init__(self, sim: Any) -> None:
        self.sim = sim
        self.gpu = sim.gpu
        # Host launch order per device (check_order): launches per world, and snapshots.
        self.counts: dict[int, collections.Counter[Any]] = collections.defaultdict(
            collections.Counter
        )
        self.marks: dict[tuple[Any, int], dict[int, dict[Any, int]]] = {}
        self.hosts: dict[Any, set[int]] = {}  # world key -> devices of its members
        self.stopped: set[Any] = set()  # worlds a member revoked or aborted
        self.names: dict[Any, str] = {}

    def push(self, la: Launch) -> None:
        """Put ``la``'s kernel on its stream (the caller holds the GPU lock)."""
        keys = [storage_key(t) for op in la.ops for t in (op.send, op.recv) if t is not None]
        item = Item("nccl", self._left(la), hold=functools.partial(self._progress, la), uses=keys)
        item.launch = la

        def start() -> None:
            la.running = True

        item.on_dispatch = start
        la.pushed = True
        self.gpu.push(la.stream, item)

    def _left(self, la: Launch) -> Any:
        def run() -> None:
            la.left = True

        return run

    def check_order(self, la: Launch) -> None:
        """Communicators sharing a device launch collectives in the same host order on every rank.

        For the k-th collective launch of world X on a device, the number of launches of
        every other world Y before it must be the same on each device hosting both X and
        Y (NCCL docs, "Using multiple NCCL communicators concurrently"; NCCL_LAUNCH_ORDER_
        IMPLICIT orders the kernels of a device by host launch order, enqueue.cc
        getImplicitOrder): otherwise the kernels of one rank wait for those of another
        in a cycle.
        """
        world = la.comm.world
        if world.nranks < 2 or not any(op.kind in COLL for op in la.ops):
            return
        dev = la.comm.device
        self.names[world.key] = world.label
        counts = self.counts[dev]
        counts[world.key] += 1
        mark = (world.key, counts[world.key])
        snap = dict(counts)
        seen = self.marks.setdefault(mark, {})
        for other, theirs in seen.items():
            for y, n in snap.items():
                if y == world.key or y not in theirs and n == 0:
                    continue
                if y in self.stopped:  # a revoked/aborted communicator orders nothing any more
                    continue
                if y in self.hosts and {dev, other} <= self.hosts[y] and theirs.get(y, 0) != n:
                    names = self.names
                    self.gpu.errors.append(
                        f"launch order: cuda:{dev} launched {names[world.key]} #{mark[1]} after {n} launches of "
                        f"{names.get(y, y)}, cuda:{other} after {theirs.get(y, 0)} (communicators sharing a device "
                        "must launch in the same host order on every rank)"
                    )
                    return
        seen[dev] = snap

    def _progress(self, la: Launch) -> bool:
        """Device thread: the kernel is running; progress its ops; True once it may end."""
        if la.aborted:
            return self.gpu.abort_drains or la.drained
        for op in la.ops:
            if not op.done:
                if op.kind in COLL:
                    self._try_coll(op)
                else:
                    self._try_p2p(op)
        return la.finished()

    def _alive(self, op: Op) -> bool:
        la = op.launch
        return (
            la is not None
            and la.running
            and not la.aborted
            and not op.comm.dead
            and not op.comm.hung
        )

    def _try_coll(self, op: Op) -> None:
        world = op.comm.world
        group = world.colls[op.key]
        if len(group) < world.nranks or not all(self._alive(o) for o in group.values()):
            return
        ops = [group[r] for r in range(world.nranks)]
        first = ops[0]
        if any(
            (o.kind, o.count, o.dtype, o.op, o.root)
            != (first.kind, first.count, first.dtype, first.op, first.root)
            for o in ops
        ):
            self.gpu.errors.append(
                "collective mismatch across ranks: "
                + ", ".join(f"{o.kind}/{o.count}/{o.dtype}/op{o.op}/root{o.root}" for o in ops)
            )
        else:
            compute(ops, world.nranks)
        for o in ops:
            o.done = True
        del world.colls[op.key]

    def _try_p2p(self, op: Op) -> None:
        pair = op.comm.world.p2p[op.key]
        s, r = pair.get("send"), pair.get("recv")
        if s is None or r is None or not (self._alive(s) and self._alive(r)):
            return
        if s.count != r.count or s.dtype != r.dtype:
            self.gpu.errors.append(
                f"send/recv mismatch {op.key}: {s.count}x{s.dtype} vs {r.count}x{r.dtype}"
            )
        else:
            plain(r.recv).copy_(plain(s.send))
        s.done = r.done = True
        del op.comm.world.p2p[op.key]
