"""GradSync: data-parallel gradient averaging that overlaps the all-reduces with backward.

How a step runs::

    loss.backward()      # hooks: each gradient is copied into its bucket as soon as it
                         # is accumulated; a bucket's all_reduce is issued once all of
                         # its gradients are in (buckets are issued in a fixed order)
    await sync.wait()    # issue what is left (unused parameters), await every bucket,
                         # copy the reduced gradients back into ``.grad``
    opt.step()

Threads: the hooks run on the thread that runs backward (the loop's thread, a worker
thread of ``asyncio.to_thread``, or autograd's device thread on CUDA); the
communicator's ops may be issued from any thread. State shared between the hooks and
``wait()`` is guarded by one lock. Everything the hooks issue goes through
``comm.all_reduce``, so the order of this GradSync's collectives is the order in
which buckets are issued: fixed, and the same on every rank. Other collectives on the
same communicator must not be issued concurrently from another task while backward
runs in a thread (their order relative to the buckets would then differ between
ranks); give such tasks a communicator of their own. Nor should backward run inside
a ``comm.coalescing()`` block of the same communicator (the buckets would be held
in the batch until the block exits).

Numerics follow torch DDP: with ``ReduceOp.AVG`` each gradient is multiplied by
``1 / world_size`` while it is copied into the bucket and the bucket is summed; a
parameter without a gradient on a rank contributes its current ``.grad`` (zeros
when None); a parameter that no rank used keeps its ``.grad`` untouched; under
``no_sync()`` gradients accumulate locally and "used" is remembered until the next
synchronised step.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .._base.errors import GradSyncError, InvalidArgument
from .._base.ops import ReduceOp
from . import buckets as _buckets
from .buckets import MIB, Bucket
from .join import Join

_STRIDED = torch.strided


class GradSync:
    """Average (or sum) gradients across the ranks of ``comm`` during backward.

    ``module_or_params``: a ``torch.nn.Module`` (its parameters that require grad;
    its buffers are also broadcast at the end of :meth:`join`) or an iterable of
    leaf tensors. Every rank must pass the same parameters (same shapes, dtypes
    and order) and start from the same values.

    ``bucket_mb``: the largest bucket, in MiB. Buckets are filled in reverse
    parameter order (the order in which backward usually produces gradients); the
    first holds at least ``first_bucket_mb`` (1 MiB, as in DDP), each next one
    twice as much, up to ``bucket_mb``, so that communication starts early in
    backward. ``op``: ``ReduceOp.AVG`` (default) or ``ReduceOp.SUM``.

    ``grad_views`` (default True): after :meth:`wait`, a (contiguous) parameter's
    ``.grad`` is its view of the reduced bucket instead of a copy, which saves a
    pass over all gradients per step, as DDP's ``gradient_as_bucket_view``. Such a
    ``.grad`` is overwritten by the next synchronised backward; ``zero_grad()``
    (either way) is fine. Between backward and :meth:`wait` such a parameter's
    ``.grad`` is None: its gradient is in the bucket, on its way, and the tensor
    backward produced is freed at once (a step holds one or two gradients besides
    the buckets, not all of them). Pass False to get a ``.grad`` of its own each
    step, holding the local gradient until :meth:`wait` writes the reduced one.

    Use: ``loss.backward()`` (on the loop or in a thread), then ``await
    sync.wait()``, then the optimizer step; ``with sync.no_sync():`` around
    backward passes that only accumulate; ``async with sync.join():`` around the
    training loop when ranks may have different numbers of batches;
    :meth:`close` to remove the hooks.

    Errors: bad arguments and calls out of place raise ``InvalidArgument``; a
    gradient GradSync cannot synchronise (a second one in a step, a sparse one)
    raises ``GradSyncError`` (an ``InvalidArgument`` and a ``RuntimeError``) from
    backward or :meth:`wait`; a failure of the communicator, ``CommAborted``.
    """

    def __init__(
        self,
        comm: Any,
        module_or_params: torch.nn.Module | Iterable[torch.Tensor],
        *,
        bucket_mb: float = 25.0,
        op: ReduceOp = ReduceOp.AVG,
        first_bucket_mb: float = 1.0,
        grad_views: bool = True,
    ) -> None:
        if op not in (ReduceOp.AVG, ReduceOp.SUM):
            raise InvalidArgument(f"GradSync: op must be ReduceOp.AVG or ReduceOp.SUM, got {op!r}")
        for name, value in (("bucket_mb", bucket_mb), ("first_bucket_mb", first_bucket_mb)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidArgument(f"GradSync: {name} must be a positive number, got {value!r}")
        self.comm = comm
        self.op = op
        self.bucket_mb = float(bucket_mb)
        self.first_bucket_mb = float(first_bucket_mb)
        self.grad_views = bool(grad_views)
        if isinstance(module_or_params, torch.nn.Module):
            self.module: torch.nn.Module | None = module_or_params
            candidates: list[Any] = list(module_or_params.parameters())
        else:
            self.module = None
            if isinstance(module_or_params, torch.Tensor):
                candidates = [module_or_params]
            else:
                try:
                    candidates = list(module_or_params)
                except TypeError:
                    raise InvalidArgument(
                        "GradSync: module_or_params must be a torch.nn.Module or an iterable of tensors, "
                        f"got {type(module_or_params).__name__}"
                    ) from None
        params: list[torch.Tensor] = []
        seen: set[int] = set()
        for p in candidates:
            if not isinstance(p, torch.Tensor):
                raise InvalidArgument(
                    f"GradSync: parameters must be tensors, got {type(p).__name__}"
                )
            if not p.requires_grad or id(p) in seen:
                continue
            if not p.is_leaf:
                raise InvalidArgument("GradSync: parameters must be leaf tensors (nn.Parameter)")
            if p.layout is not torch.strided:
                raise InvalidArgument(f"GradSync: parameters must be dense tensors, got {p.layout}")
            seen.add(id(p))
            params.append(p)
        if not params:
            raise InvalidArgument("GradSync: no parameter requires grad")
        self.params = params
        n = len(params)
        # AVG: scale while copying into the bucket, then SUM (one pass, as in DDP).
        self._scale: float | None = 1.0 / comm.world_size if op is ReduceOp.AVG else None
        self._lock = threading.Lock()
        self._used = [False] * n  # produced a gradient since the last synced step
        self._ready = [False] * n  # copied into its bucket in this step
        self._buckets: list[Bucket] = []
        self._where: list[tuple[int, int]] = [(0, 0)] * n
        self._slots: list[tuple[Bucket, int]] = []  # parameter -> (its bucket, its slot)
        self._build(list(reversed(range(n))))
        # The order in which gradients arrive in the first synchronised step; the
        # buckets are then rebuilt in rank 0's order (None once done).
        self._seen: list[int] | None = []
        self._next = 0  # the next bucket to issue (fixed order)
        self._step_open = False  # a synchronised step has begun (hooks fired or wait())
        self._no_sync = 0
        self._joining = False  # inside join(), not yet out of data
        self._presence: Any = None  # join: the "still training" all_reduce of this step
        self._error: BaseException | None = None
        self._closed = False
        self.steps = 0  #: synchronised steps completed (shadowed ones included)
        ref = weakref.ref(self)
        handles = []
        for i, p in enumerate(params):
            handles.append(p.register_post_accumulate_grad_hook(_hook(ref, i)))
        self._handles = handles
        self._finalizer = weakref.finalize(self, _remove, handles)

    # ------------------------------------------------------------------ layout
    def _build(self, order: list[int]) -> None:
        members = _buckets.assign(
            self.params, order, int(self.first_bucket_mb * MIB), int(self.bucket_mb * MIB)
        )
        old = self._buckets
        buffers = _buckets.storages(members, self.params)
        self._buckets = [
            Bucket(b, m, self.params, self.grad_views, buf)
            for b, (m, buf) in enumerate(zip(members, buffers))
        ]
        for b, bucket in enumerate(self._buckets):
            for slot, i in enumerate(bucket.members):
                self._where[i] = (b, slot)
        self._slots = [(self._buckets[b], slot) for b, slot in self._where]
        if old:  # the used flags of the last reduction live on (join shadows them)
            for bucket in old:
                for slot, i in enumerate(bucket.members):
                    b, new_slot = self._where[i]
                    self._buckets[b].flags[new_slot] = bucket.flags[slot]

    @property
    def bucket_order(self) -> list[list[int]]:
        """Parameter indices (into ``params``) of each bucket, in the order they are reduced."""
        return [list(b.members) for b in self._buckets]

    async def _agree_order(self) -> None:
        """After the first synchronised step: rebuild the buckets in rank 0's ready order.

        Every rank calls this at the end of the same step (a shadowed one too), and
        one broadcast of the order keeps the buckets identical on every rank.
        """
        with self._lock:
            seen, self._seen = self._seen or [], None
        n = len(self.params)
        picked = set(seen)
        order = seen + [i for i in reversed(range(n)) if i not in picked]
        proposal = torch.tensor(order, dtype=torch.int64, device=self.params[0].device)
        work = self.comm.broadcast(proposal, 0)
        await work
        agreed = proposal.tolist()
        with self._lock:
            if agreed != [i for b in self._buckets for i in b.members]:
                self._build(agreed)

    @property
    def bucket_sizes(self) -> list[int]:
        """Bytes of each bucket, in the order they are reduced."""
        return [b.nbytes for b in self._buckets]

    # ------------------------------------------------------------------ hooks
    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook of parameter ``i`` (backward's thread).

        The hot path of backward, once per parameter: one scaled copy into the
        bucket and a little bookkeeping (no ``torch.no_grad()`` context: backward
        runs without grad mode unless ``create_graph``; ``Bucket.put`` handles the
        rest).
        """
        with self._lock:
            if self._closed:
                return
            self._used[i] = True
            if self._no_sync:
                return
            ready = self._ready
            if ready[i]:
                err = GradSyncError(
                    f"GradSync: parameter {i} received a gradient twice in one step; call "
                    "`await sync.wait()` after each backward, or use `with sync.no_sync():` "
                    "for the backward passes that only accumulate"
                )
                self._error = self._error or err
                raise err
            if not self._step_open:
                self._open_step()
            if self._seen is not None:
                self._seen.append(i)
            bucket, slot = self._slots[i]
            grad = param.grad
            if (
                grad is not None
                and grad is not bucket.grads[slot]
                and not grad.requires_grad
                and grad.layout is _STRIDED
            ):
                view = bucket.views[slot]
                scale = self._scale
                if scale is None:
                    view.copy_(grad)
                else:
                    torch.mul(grad, scale, out=view)
                if bucket.as_view[slot]:
                    # The gradient lives on in its slot; wait() makes ``.grad`` that
                    # view. Dropping the tensor backward allocated now lets the next
                    # parameter's gradient reuse its memory: kept until wait(), a
                    # step's gradients were freed together, glibc gave them back to
                    # the kernel and every step faulted them in again (measured:
                    # 6,113 page faults a step for 24 MiB of gradients, about 6 ms).
                    param.grad = None
            else:
                with torch.no_grad():
                    bucket.put(slot, grad, self._scale)
            ready[i] = True
            bucket.pending -= 1
            if not bucket.pending and bucket.index == self._next:
                buckets = self._buckets
                while self._next < len(buckets) and buckets[self._next].pending == 0:
                    self._issue(buckets[self._next])

    def _open_step(self) -> None:
        """First event of a synchronised step (lock held): under join, say "still training"."""
        self._step_open = True
        if self._joining:
            flag = torch.ones(1, dtype=torch.int32, device=self.params[0].device)
            self._presence = self.comm.all_reduce(flag)

    def _issue(self, bucket: Bucket) -> None:
        """Start the bucket's all_reduce (lock held). Missing gradients are filled in first."""
        if bucket.pending:
            with torch.no_grad():
                for slot, i in enumerate(bucket.members):
                    if not self._ready[i]:
                        grad = bucket.params[slot].grad
                        if grad is not None and grad is bucket.grads[slot]:
                            bucket.saved[slot] = grad.clone()
                        bucket.put(slot, grad, self._scale)
                        self._ready[i] = True
            bucket.pending = 0
        used = self._used
        bucket.flags.fill_(1)
        for slot, i in enumerate(bucket.members):
            if not used[i]:
                bucket.flags[slot] = 0  # on the device's stream: no host copy, no sync
        self._next = bucket.index + 1
        bucket.work = self.comm.all_reduce(bucket.buffer)

    # ------------------------------------------------------------------ public
    async def wait(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Finish this step's synchronisation: every bucket reduced, written into ``.grad``.

        Buckets not issued during backward (parameters without gradient on this rank)
        are issued now, with the parameter's current ``.grad`` (zeros if None). Call it
        once after each backward that was not under :meth:`no_sync`, before the
        optimizer step. A rank whose backward produced no gradient at all still calls
        it, so that its peers' all-reduces are matched.

        ``optimizer`` (optional): step it bucket by bucket, each bucket's parameters
        as soon as that bucket is reduced, while the later buckets are still in
        flight (then the parameters it holds outside any bucket). Same numbers as
        ``await sync.wait(); optimizer.step()`` for optimizers that update each
        parameter from its own gradient and state (SGD, Adam, AdamW, ...), but not
        for code that needs every gradient before the step (clipping by the global
        norm: use the plain form). The optimizer's step hooks run once per bucket.
        """
        with self._lock:
            self._check_open()
            if self._no_sync:
                raise InvalidArgument(
                    "GradSync.wait() inside no_sync(): nothing is synchronised there"
                )
            try:
                if not self._step_open:
                    self._open_step()
                while self._next < len(self._buckets):
                    self._issue(self._buckets[self._next])
            except BaseException:
                self._end_step()  # the communicator refused an op (aborted or closed)
                raise
            buckets = list(self._buckets)
            presence, self._presence = self._presence, None
            error, self._error = self._error, None
        try:
            if presence is not None:
                await presence
            for bucket in buckets:
                work = bucket.work
                await work  # type: ignore[misc]
                work.wait_stream()  # type: ignore[attr-defined]
                bucket.unpack(self._used)
                if optimizer is not None:
                    _step_some(optimizer, {id(p) for p in bucket.params}, inside=True)
            if optimizer is not None:
                _step_some(optimizer, {id(p) for p in self.params}, inside=False)
            if self._seen is not None:
                await self._agree_order()
        finally:
            with self._lock:
                self._end_step()
        if error is not None:
            raise error

    def _end_step(self) -> None:
        n = len(self.params)
        self._used = [False] * n
        self._ready = [False] * n
        for bucket in self._buckets:
            bucket.reset()
        self._next = 0
        self._step_open = False
        self.steps += 1

    # ------------------------------------------------------------ join steps
    # The steps of ``async with sync.join()`` (``join.py``), public so that
    # the join protocol needs nothing private. Not meant to be called otherwise.

    def begin_join(self) -> None:
        """Enter a join block: each synchronised step now starts with a presence op."""
        with self._lock:
            self._check_open()
            if self._joining:
                raise InvalidArgument("GradSync.join() does not nest")
            if self._step_open:
                raise InvalidArgument(
                    "GradSync.join(): a backward is pending; call `await sync.wait()` first"
                )
            self._joining = True

    def leave_join(self) -> bool:
        """Leave the join block (this rank is out of data); True if a backward is
        still pending (a step without ``await sync.wait()``)."""
        with self._lock:
            self._joining = False
            return self._step_open

    async def shadow_step(self) -> None:
        """Match one synchronised step of the ranks still training, with zeros.

        The gradients are zeros. The used flags keep what the bucket's previous
        reduction left there (the global counts of this rank's last step, then of
        each shadowed step), as DDP's joined rank all-reduces its last reduced
        used-map in place: a parameter used anywhere in that step stays "used",
        so a rank still training writes its (possibly zero) gradient into
        ``.grad`` instead of leaving it untouched. Same numbers as DDP.
        """
        with self._lock:
            works = [self.comm.all_reduce(bucket.shadow_buffer()) for bucket in self._buckets]
        for work in works:
            await work
        if self._seen is not None:
            await self._agree_order()
        self.steps += 1

    def end_join(self) -> None:
        """Every rank left the join block: drop the zero buffers of the shadow steps."""
        for bucket in self._buckets:
            bucket.shadow = None

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument("GradSync is closed")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; nothing is communicated.

        The next backward outside it synchronises the accumulated gradients.
        """
        with self._lock:
            self._check_open()
            if self._step_open:
                raise InvalidArgument(
                    "GradSync.no_sync(): a synchronised backward is pending; call `await sync.wait()` first"
                )
            self._no_sync += 1
        try:
            yield
        finally:
            with self._lock:
                self._no_sync -= 1

    def join(self) -> Join:
        """``async with sync.join():`` around a training loop with uneven inputs.

        Same semantics as torch DDP's ``join()`` with its defaults: a rank that leaves
        the block answers its peers' gradient all-reduces with zeros (the average
        stays divided by the full world size) until every rank has left it; then all
        ranks take the parameters (and a module's buffers) of the last rank to leave
        (the highest such rank on ties).
        """
        self._check_open()
        return Join(self)

    def close(self) -> None:
        """Remove the hooks. Idempotent; later ``wait()``/``join()`` raise ``InvalidArgument``."""
        with self._lock:
            self._closed = True
        self._finalizer()

    def __repr__(self) -> str:
        return (
            f"<asynccoll.GradSync params={len(self.params)} buckets={len(self._buckets)} "
            f"op={self.op.name} steps={self.steps}{' closed' if self._closed else ''}>"
        )


def _step_some(optimizer: torch.optim.Optimizer, ids: set[int], inside: bool) -> None:
    """``optimizer.step()`` over the parameters whose id is (``inside``) or is not in ``ids``."""
    groups = optimizer.param_groups
    saved = [g["params"] for g in groups]
    try:
        keep = []
        for g, params in zip(groups, saved):
            g["params"] = [p for p in params if (id(p) in ids) is inside]
            if g["params"]:
                keep.append(g)
        if not keep:
            return
        optimizer.param_groups = keep
        optimizer.step()
    finally:
        optimizer.param_groups = groups
        for g, params in zip(groups, saved):
            g["params"] = params


def _hook(ref: weakref.ref[GradSync], i: int) -> Any:
    def hook(param: torch.Tensor) -> None:
        sync = ref()
        if sync is not None:
            sync._on_grad(i, param)

    return hook


def _remove(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()
