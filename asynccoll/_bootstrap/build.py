"""Building a communicator on a met rendezvous: its backends, diagnostics and the
``build_shrunk`` closure that ``shrink()`` uses.

Nothing here blocks the event loop: building each backend (Gloo's full-mesh
connect, NCCL's polled init) runs on executor threads, bounded by ``timeout``. What
blocks after NCCL's init (the Gloo group, the diagnostics, the liveness member's keys,
the end barrier) runs as one job on one thread: every hop from the loop to a thread
and back is time the peers wait for this rank.

Backends are made by :class:`Factories`, passed explicitly from ``init`` down to every
communicator that ``shrink()`` builds (the simulated GPU's test kit passes one that builds NCCL on its simulator).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
import weakref
from datetime import timedelta
from typing import Any, Awaitable, Callable

import anyio
import torch
import torch.distributed as dist

from .._backends import gloo
from .._backends.torch_pg import TorchGroupBackend
from .._base.aio import run_in_thread
from .._base.errors import AsyncCollError, BackendUnavailable, CollectiveMismatch, InvalidArgument
from .._core.backend import Backend
from .._core.communicator import Communicator
from .._diag import trace
from .._diag.diagnostics import Diagnostics
from .._faults.liveness import Liveness
from .._faults.shrink import shrink
from .args import check_args
from .rendezvous import (
    TRACE_KEY,
    Namespace,
    Rendezvous,
    abandon,
    agree_options,
    all_created,
    comm_prefix,
    forget,
    gave_up,
    off_loop,
    rendezvous,
    sole_prefix,
)
from .split import Splitter
from .stores import STORES, exclusive

#: Seconds Gloo's connect timeout outlasts ours.
_GLOO_MARGIN = 30.0
#: Creation errors after which every rank still reaches the store, so each can count
#: itself out of the communicator's keys (``forget``); at most this many seconds.
_REFUSED = (BackendUnavailable, CollectiveMismatch, InvalidArgument)
_FORGET_S = 5.0


def build_gloo(store: Any, rank: int, world_size: int, timeout: float) -> TorchGroupBackend:
    """The Gloo backend of rank ``rank`` of ``world_size`` on ``store`` (blocking: Gloo's
    full-mesh connect)."""
    # Gloo's own connect timeout outlasts ours: when we give up (CollectiveTimeout,
    # Ctrl-C) and the process exits, its wait is still quietly under way instead of
    # printing C++ warnings on the way out. Its ops then get our timeout again
    # (ProcessGroupGloo._set_default_timeout, torch >= 2.1).
    pg = dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout + _GLOO_MARGIN))
    set_default = getattr(pg, "_set_default_timeout", None)
    if set_default is not None:
        set_default(timedelta(seconds=timeout))
    return TorchGroupBackend(
        pg,
        name="gloo",
        device_type="cpu",
        world_size=world_size,
        timeout=timeout,
        caps=gloo.CAPS,
    )


async def build_nccl(rdv: Rendezvous, prefix: str, device: Any, timeout: float) -> Backend:
    from .._backends import nccl

    backend: Backend = await nccl.create(rdv, prefix + "nccl/", device, timeout)
    return backend


async def join_nccl(
    store: Any, rank: int, new_size: int, device: Any, timeout: float, *, lib: Any = None
) -> Any:
    from .._backends import nccl

    # The device is resolved here, on the caller's thread (as nccl.create does); the
    # blocking grow runs off the loop on a thread that knows nothing of it.
    index = nccl.choose_device(device, torch.cuda.device_count(), nccl.current_device)
    job = functools.partial(nccl.join_grown, store, rank, new_size, index, timeout, lib=lib)
    return await off_loop(job, timeout + 5.0, "nccl grow")


def nccl_missing() -> str | None:
    from .._backends.nccl import missing

    return missing()


@dataclasses.dataclass(frozen=True)
class Factories:
    """How the bootstrap makes each backend; the defaults are the real ones."""

    #: ``gloo(store, rank, world_size, timeout)``: the Gloo backend of a met rendezvous, on
    #: its namespace's ``gloo/`` (blocking: it runs on the creation's thread).
    gloo: Callable[[Any, int, int, float], Backend] = build_gloo
    #: ``await nccl(rdv, prefix, device, timeout)``: the NCCL backend.
    nccl: Callable[[Rendezvous, str, Any, float], Awaitable[Backend]] = build_nccl
    #: ``await nccl_join(store, rank, new_size, device, timeout)``: a new rank's NCCL backend
    #: of a group its members grow natively (``Backend.grow_agreed`` on the same store), or
    #: None when they build a fresh one.
    nccl_join: Callable[[Any, int, int, Any, float], Awaitable[Backend | None]] = join_nccl
    #: Why NCCL cannot run here (what to install), or None when it can.
    nccl_missing: Callable[[], str | None] = nccl_missing


REAL = Factories()


async def build_communicator(
    backend: str,
    *,
    rank: int | None,
    world_size: int | None,
    master_addr: str | None,
    master_port: int | None,
    store: Any,
    device: Any,
    timeout: float,
    check: str | None,
    trace_dir: Any,
    heartbeat: float | None = None,
    nccl_backend: Backend | None = None,
    factories: Factories = REAL,
    group: Any = None,
    sole: bool = False,
) -> Communicator:
    # nccl_backend: a ready NCCL backend (shrink's ncclCommShrink) used instead of a new init.
    # group: the named group (elastic.Group) this communicator belongs to, or None.
    # sole: ``store`` is a namespace of this communicator alone (a shrink's, a grow's).
    timeout = check_args(backend, store, master_addr, device, timeout, heartbeat)
    if check not in (None, "fingerprint"):
        raise InvalidArgument(f"check must be None or 'fingerprint', got {check!r}")
    if trace_dir is not None and not isinstance(trace_dir, (str, os.PathLike)):
        raise InvalidArgument(f"trace_dir must be a path, got {type(trace_dir).__name__}")
    use_nccl = False
    if backend in ("nccl", "auto"):
        # "auto" serves CUDA tensors with NCCL whenever CUDA, nccl4py, cuda-bindings
        # and libnccl are all usable here; "nccl" insists on them.
        # Off the loop: the first check in a process loads libnccl (hundreds of MB) and
        # asks CUDA for its devices.
        missing = await run_in_thread(factories.nccl_missing, None, name="asynccoll-nccl-check")
        if missing is None:
            use_nccl = True
        elif backend == "nccl":
            raise BackendUnavailable(missing)
    rdv = await rendezvous(
        rank=rank,
        world_size=world_size,
        master_addr=master_addr,
        master_port=master_port,
        store=store,
        timeout=timeout,
    )
    if group is not None:
        group = group.bound(
            rdv.store, rdv.key
        )  # the first communicator's store: joiners meet there
    try:
        lock = await exclusive(rdv.store, rdv.rank, timeout)
        try:
            recipe = Recipe(
                backend, use_nccl, device, timeout, check, trace_dir, heartbeat, factories
            )
            comm = await connect(rdv, recipe, nccl_backend, group, sole)
        finally:
            lock.release()
    except BaseException:
        if rdv.key is not None:
            STORES.release(rdv.key)
        raise
    if rdv.key is not None:
        # The hold taken by rendezvous() ends with this communicator.
        weakref.finalize(comm, STORES.release, rdv.key)
    elif group is not None and group.key is not None:
        STORES.hold(group.key, comm)  # a grown group's communicator uses the group's store
    return comm


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a communicator is made (``init``'s options, checked); its shrunk, grown and
    split communicators are made the same way."""

    backend: str
    use_nccl: bool
    device: Any
    timeout: float
    check: str | None
    trace_dir: Any
    heartbeat: float | None
    factories: Factories

    @property
    def detect(self) -> bool:
        """Heartbeat detection: on where a dead peer would hang (NCCL) or when asked for;
        otherwise a slower census-only beat that names ranks Gloo lost."""
        return self.heartbeat is not None or self.use_nccl

    @property
    def interval(self) -> float:
        """Seconds between liveness beats (0: none)."""
        if self.heartbeat is not None:
            return self.heartbeat
        return 1.0 if self.use_nccl else 0.25


@dataclasses.dataclass
class Parts:
    """What the blocking part of a creation made (:func:`assemble`)."""

    backends: dict[str | None, Backend]
    diagnostics: Diagnostics
    liveness: Liveness | None

    def release(self) -> None:
        """Undo the creation (its waiter gave up before it ended): the member leaves, the
        backends go."""
        if self.liveness is not None:
            self.liveness.stop()
        for backend in set(self.backends.values()):
            backend.release()


def assemble(
    rdv: Rendezvous,
    ns: Namespace,
    backends: dict[str | None, Backend],
    recipe: Recipe,
    group: str | None,
    token: str | None = None,
) -> Parts:
    """The blocking rest of a creation, after NCCL's init (``backends``): the liveness
    member's keys, the Gloo group, the diagnostics and the end barrier. One job on one
    thread: each hop from the loop to a thread and back is time the peers wait for
    this rank. What it made is released if it fails (``backends`` are the caller's).
    ``token``: the liveness member's namespace token, where the ranks derive it alike
    (``Liveness.publish``)."""
    built = dict(backends)
    member = None
    try:
        # (what needs no peer first: done while they arrive)
        if recipe.interval and rdv.world_size > 1:
            member = Liveness(
                rdv.prefixed(ns.prefix),
                rdv.rank,
                rdv.world_size,
                interval=recipe.interval,
                detect=recipe.detect,
            )
            member.publish(token)
        if recipe.backend in ("gloo", "auto"):
            store = rdv.prefixed(ns.prefix + "gloo/")
            built["cpu"] = recipe.factories.gloo(store, rdv.rank, rdv.world_size, recipe.timeout)
        diag = diagnostics(rdv, ns.prefix, built, recipe, group)
        all_created(rdv, ns, recipe.timeout)
    except BaseException:
        if member is not None:
            member.stop()
        if "cpu" in built:
            built["cpu"].release()
        raise
    return Parts(built, diag, member)


def why(exc: BaseException) -> str:
    """What a rank that gives a creation up tells its peers (``abandon``)."""
    return f"{type(exc).__name__}: {exc}".replace("|", "/")


async def connect(
    rdv: Rendezvous,
    recipe: Recipe,
    nccl_backend: Backend | None = None,
    group: Any = None,
    sole: bool = False,
) -> Communicator:
    """Build the backends and the Communicator on a met rendezvous.

    ``nccl_backend``: a ready NCCL backend (shrink's ``ncclCommShrink``) used instead of
    a new init. ``group``: the named group (``elastic.Group``) this communicator belongs
    to, or None. ``sole``: the store is a namespace of this communicator alone (a
    shrink's, a grow's): no generations there.
    """
    timeout = recipe.timeout
    name = getattr(group, "name", None)
    ns = await comm_prefix(rdv, timeout, name, sole)
    backends: dict[str | None, Backend] = {}
    try:
        await agree_options(
            rdv,
            ns.prefix,
            {
                "backend": recipe.backend,
                "nccl": recipe.use_nccl,
                "check": recipe.check,
                "heartbeat": recipe.heartbeat,
                "world_size": rdv.world_size,
                "name": name,
            },
            timeout,
        )
        if recipe.use_nccl:
            backends["cuda"] = nccl_backend or await recipe.factories.nccl(
                rdv, ns.prefix, recipe.device, timeout
            )
        job = functools.partial(assemble, rdv, ns, backends, recipe, name)
        parts = await off_loop(job, timeout, "creation", on_late=Parts.release)
    except BaseException as exc:
        # A backend that failed ("auto": NCCL refused two ranks on one GPU) must not
        # leave the one built before it running (Gloo's threads and sockets).
        for be in set(backends.values()):
            be.release()
        # Peers still waiting here stop at once, and a retry meets in a new namespace
        # on every rank (shielded: a cancelled creation must say so too).
        with anyio.CancelScope(shield=True):
            try:
                await off_loop(
                    functools.partial(abandon, rdv, ns, why(exc)), min(timeout, _FORGET_S), "store"
                )
            except AsyncCollError:
                pass  # the store failed: the creation error is the one to report
        if isinstance(exc, _REFUSED):  # the store is fine: the last rank out deletes the keys
            try:
                await off_loop(
                    functools.partial(forget, rdv, ns.prefix), min(timeout, _FORGET_S), "store"
                )
            except AsyncCollError:
                pass  # keys left behind: the creation error is the one to report
        raise
    return adopt(rdv, ns.prefix, parts, recipe, group)


def adopt(
    rdv: Rendezvous, prefix: str, parts: Parts, recipe: Recipe, group: Any = None
) -> Communicator:
    """The Communicator of a creation's parts (never blocks): its liveness starts, and
    it knows how to shrink and split with ``recipe``."""
    backends = parts.backends
    cuda = backends.get("cuda")
    dev = cuda.device if cuda is not None and cuda.device is not None else torch.device("cpu")
    timeout = recipe.timeout

    def rebuild(new_rank: int, new_size: int, store: Any, **kwargs: Any) -> Awaitable[Communicator]:
        """A communicator of this one's options (not its name) on ``store``: a shrunk
        one, rank ``new_rank`` of ``new_size``."""
        return build_communicator(
            recipe.backend,
            rank=new_rank,
            world_size=new_size,
            master_addr=None,
            master_port=None,
            store=store,
            device=recipe.device,
            timeout=timeout,
            check=recipe.check,
            trace_dir=recipe.trace_dir,
            heartbeat=recipe.heartbeat,
            factories=recipe.factories,
            **kwargs,
        )

    async def build_shrunk(
        new_rank: int,
        new_size: int,
        suffix: str,
        failed: bool = False,
        excluded: tuple[int, ...] = (),
    ) -> Communicator:
        # For a backend-level shrink (see _faults/shrink.py): ``excluded`` are the old
        # ranks left out, ``failed`` says it follows a failure (its abort flag).
        # A store connection of its own: a group construction that waits for a
        # survivor who died meanwhile must not hold the connection that the
        # liveness service and shrink's watch use (a client serialises requests).
        store = await off_loop(rdv.prefixed(prefix + suffix).clone, timeout, "store")
        # NCCL: ncclCommShrink of the old (revoked) communicator, ABORT flag after a
        # failure, DEFAULT for a planned shrink; None (a new init) unless every survivor can.
        shrunk = None
        if cuda is not None:  # Backend.shrink_agreed: None where there is no native shrink
            job = functools.partial(
                cuda.shrink_agreed, store, new_rank, new_size, excluded, failed, timeout
            )
            shrunk = await off_loop(job, timeout, "nccl shrink")
        try:
            new = await rebuild(
                new_rank, new_size, store, nccl_backend=shrunk, group=group, sole=True
            )
        except BaseException:
            if shrunk is not None:
                shrunk.release()  # bounded ncclCommAbort of the unused child
            # Its keys go with this communicator's (a build that a survivor's death
            # cancelled is given up too).
            name = getattr(group, "name", None)
            await gave_up(rdv.store, prefix, suffix, new_size, name, min(timeout, _FORGET_S))
            raise
        if rdv.key is not None:
            STORES.hold(rdv.key, new)  # it uses the shared store too
        return new

    token = parts.liveness.namespace if parts.liveness is not None else None
    splitter = Splitter(rdv, prefix, cuda, Subgroups(rdv, recipe, token))
    return Communicator(
        rank=rdv.rank,
        world_size=rdv.world_size,
        backends=backends,
        backend_name=recipe.backend,
        device=dev,
        store=rdv.prefixed(prefix),
        timeout=timeout,
        liveness=parts.liveness,
        build_shrunk=build_shrunk,
        shrink=shrink,
        diagnostics=parts.diagnostics,
        group=group,
        forget=functools.partial(forget, rdv, prefix, more=splitter.leftover_keys),
        splitter=splitter,
    )


class Subgroups:
    """How a communicator's subgroups are made (``split.Maker``): with its recipe, each
    in a namespace of its own on a store connection of its own."""

    def __init__(self, parent: Rendezvous, recipe: Recipe, token: str | None) -> None:
        self._parent = parent
        self._recipe = recipe
        self._token = token  # the parent's liveness namespace token, if it has one

    def assemble(self, rank: int, size: int, store: Any, child: Backend | None, name: str) -> Any:
        """Rank ``rank`` of the subgroup ``name`` of ``size`` on ``store`` (over the split's
        NCCL ``child``, if any), up to the end of its creation (blocking: on the split's
        thread). If it fails, ``child`` is released; the split gives it up (``abandon``).
        Its liveness token is its parent's and its ``name``: no agreement on one."""
        rdv = Rendezvous(store, rank, size)
        ns = Namespace(sole_prefix(size, None), None, 0)
        backends: dict[str | None, Backend] = {"cuda": child} if child is not None else {}
        token = f"{self._token}/{name}" if self._token is not None else None
        try:
            return rdv, ns, assemble(rdv, ns, backends, self._recipe, None, token)
        except BaseException:
            if child is not None:
                child.release()  # bounded ncclCommAbort of the unused child
            raise

    def abandon(self, store: Any, size: int, exc: BaseException) -> None:
        """Give up the subgroup of ``size`` on ``store`` (blocking): members waiting in its
        creation stop at once."""
        abandon(Rendezvous(store, 0, size), Namespace(sole_prefix(size, None), None, 0), why(exc))

    def release(self, made: Any) -> None:
        """Undo a subgroup's creation whose split gave up before it ended."""
        made[2].release()

    def adopt(self, made: Any) -> Communicator:
        """The subgroup's Communicator (never blocks)."""
        rdv, ns, parts = made
        comm = adopt(rdv, ns.prefix, parts, self._recipe)
        if self._parent.key is not None:
            STORES.hold(self._parent.key, comm)  # it uses the shared store too
        return comm


def diagnostics(
    rdv: Rendezvous,
    prefix: str,
    backends: dict[str | None, Backend],
    recipe: Recipe,
    group: str | None = None,
) -> Diagnostics:
    """The communicator's diagnostics (blocking); with ``check``, wraps ``backends`` in place.

    With ``trace_dir``, the ranks agree on the communicator's name in it (the first
    proposal stored wins: one request per rank), so that their files go together and
    apart from every other communicator's (``trace``)."""
    trace_dir, check = recipe.trace_dir, recipe.check
    comm_name = None
    if trace_dir is not None:
        mine = json.dumps({"id": trace.new_comm_id(), "at": time.time()})
        if rdv.world_size > 1:
            store = rdv.prefixed(prefix)
            mine = bytes(store.compare_set(TRACE_KEY, "", mine)).decode()
        agreed = json.loads(mine)
        comm_name = trace.CommName(agreed["id"], agreed["at"], group)
    checker = None
    if check == "fingerprint" and rdv.world_size > 1:
        from .._diag.fingerprint import FingerprintChecker
        from .._diag.mesh import store_host

        store = rdv.prefixed(prefix)
        host = store_host(rdv.store)
        checker = FingerprintChecker.connect(store, rdv.rank, rdv.world_size, recipe.timeout, host)
        for key, be in list(backends.items()):
            # Not NCCL yet: its submit records the caller's current stream, so it cannot
            # be deferred to the checker's thread (see fingerprint.py, "Scope").
            if be.device_type != "cuda":
                backends[key] = checker.wrap(be)
    return Diagnostics(
        rank=rdv.rank,
        world_size=rdv.world_size,
        backend=recipe.backend,
        trace_dir=os.fspath(trace_dir) if trace_dir is not None else None,
        checker=checker,
        name=comm_name,
    )
