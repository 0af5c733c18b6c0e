"""Task-scoped batches: ``async with comm.coalescing() as group``.

Owns one task's batch from entering the body to issuing it. Invariants:

* only ops of the task that opened the group are captured; other tasks' ops issue at once;
* a normal exit hands the whole batch to the backends under the communicator's lock, so
  no other op slips in between its members;
* a body that raises issues nothing: every member fails with its exception, and the
  communicator stays usable;
* misuse (entering twice, nesting in one task, awaiting before the exit) is
  :class:`InvalidArgument` at the point of misuse.

Scope, deadlines and seqs in detail: ``docs/design.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import TYPE_CHECKING, Any, Generator

from .._base.aio import current_task as _current_task
from .._base.aio import running_loop
from .._base.errors import InvalidArgument
from .._base.ops import OpSpec
from .ledger import Ledger, State
from .work import BatchWork, Bundle, MemberWork, Work

if TYPE_CHECKING:
    from .backend import Backend


_NEW, _OPEN, _EXITED = 0, 1, 2


_asyncio_task = asyncio.current_task
_thread_id = threading.get_ident


class Batch:
    """The ops one task recorded inside one ``coalescing()`` body, in call order.

    Its members are light Works (``work.MemberWork``) over ONE pending entry,
    ``head`` (``work.BatchWork``): one deadline, one ledger entry, one settle.
    ``works`` is the head's own list of members (the ledger appends to it), so a
    backend handed ``works`` whole hands the ledger back the batch's own list.
    """

    __slots__ = ("ledger", "task", "loop", "thread", "open", "backends", "specs", "works", "head")

    def __init__(
        self, ledger: Ledger, task: object, loop: asyncio.AbstractEventLoop | None
    ) -> None:
        self.ledger = ledger
        self.task = task
        self.loop = loop  # the task's asyncio loop; None under trio
        self.thread = _thread_id()  # the thread that runs it
        self.open = True
        self.backends: list[Backend] = []
        self.specs: list[OpSpec] = []
        self.works: list[MemberWork] = []
        self.head: BatchWork | None = None  # opened by the first member

    def add(
        self, op: str, backend: Backend, spec: OpSpec, value: Any, keep: Any
    ) -> MemberWork | None:
        """Record an op issued now while the ContextVar holds this batch: its member
        Work (seq taken now, run when the batch exits), or None when it is not this
        batch's to record (the body exited, or the caller is another task): the
        communicator then issues it at once, as usual.

        The one call per member on the coalesced path: it records, writes nothing
        to the flight recorder (the batch is recorded when issued, ``commit_all``).
        """
        if not self.open:
            return None
        loop = self.loop
        if loop is not None:  # asyncio: on the loop's thread, and the loop runs the task
            # (not ``running_loop() is loop``: on CPython 3.11 it makes a getpid() syscall)
            if _thread_id() != self.thread or _asyncio_task(loop) is not self.task:
                return None
        elif _current_task() is not self.task:  # trio (None on a thread outside it)
            return None
        head = self.head
        work = self.ledger.reserve_member(op, value, keep, head)
        if head is None:
            head = self.head = work._batch
            self.works = head.members
        self.backends.append(backend)
        self.specs.append(spec)
        return work


class CoalescingGroup:
    """``async with comm.coalescing(wait=...) as group``: batch this task's ops.

    On a normal exit the recorded ops are issued as one group and, with
    ``wait=True`` (default), awaited: the first failing member's exception is
    raised from ``async with``. With ``wait=False`` the exit returns once the batch
    is issued; ``await group`` later returns the members' results (a list, in
    call order) or raises the first failure. ``group.works`` lists the member
    Works in call order.

    See the module docstring for scope, nesting, deadline and failure rules.
    """

    __slots__ = ("_ledger", "_wait", "_state", "_batch", "_token")

    def __init__(self, ledger: Ledger, wait: bool = True) -> None:
        if not isinstance(wait, bool):
            raise InvalidArgument(f"coalescing(wait=...) must be a bool, got {wait!r}")
        self._ledger = ledger
        self._wait = wait
        self._state = _NEW
        self._batch: Batch | None = None
        self._token: Any = None

    @property
    def works(self) -> list[Work]:
        """The member Works, in call order (grows while the body runs)."""
        batch = self._batch
        return list(batch.works) if batch is not None else []

    def __repr__(self) -> str:
        state = ("new", "open", "exited")[self._state]
        return f"<CoalescingGroup {state} ops={len(self._batch.works) if self._batch else 0}>"

    # ------------------------------------------------------------------ enter
    async def __aenter__(self) -> CoalescingGroup:
        if self._state != _NEW:
            raise InvalidArgument(
                "this coalescing group was already entered; use a new comm.coalescing() per batch"
            )
        ledger = self._ledger
        task = _current_task()
        if task is None:
            raise InvalidArgument("comm.coalescing() must be entered from an asyncio or trio task")
        outer = ledger.batch.get()
        if outer is not None and outer.open and outer.task is task:
            raise InvalidArgument("comm.coalescing() does not nest within one task")
        if ledger.state is not State.OK or ledger.closing:
            raise ledger.unusable()
        self._batch = batch = Batch(ledger, task, running_loop())
        self._token = ledger.batch.set(batch)
        self._state = _OPEN
        return self

    # ------------------------------------------------------------------- exit
    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._state != _OPEN:
            return None
        batch = self._batch
        assert batch is not None
        batch.open = False
        self._state = _EXITED
        try:
            self._ledger.batch.reset(self._token)
        except ValueError:  # exited in another context than entered; the batch is closed anyway
            pass
        self._token = None
        if exc is not None:
            self._discard(exc)
            return None  # the body's exception propagates
        if not batch.works:
            return None
        self._submit()
        if self._wait:
            head = batch.head
            if head is not None and not head.done():
                with contextlib.suppress(Exception):  # the members' own outcomes are raised below
                    await head  # the one wait of the whole batch
            if (
                head is None or head.exception() is not None
            ):  # a success wrote success into every member
                for work in batch.works:  # in call order: the first failure is raised
                    if (exc := work.exception()) is not None:
                        raise exc
        return None

    def _discard(self, exc: BaseException) -> None:
        """The body raised: issue nothing, fail every member with ``exc``, keep the comm usable."""
        works = self._batch.works if self._batch is not None else []
        if not works:
            return
        ledger = self._ledger
        with ledger.lock:
            ledger.discard(works)
        ledger.fail_unissued(works, exc)

    def _submit(self) -> None:
        """Hand the batch to its backend(s), atomically with respect to other ops."""
        batch = self._batch
        assert batch is not None
        specs, works, backends = batch.specs, batch.works, batch.backends
        ledger = self._ledger
        error: BaseException | None = None
        with ledger.lock:
            if ledger.state is not State.OK:
                unusable = ledger.unusable()
                ledger.discard(works)
                ledger.fail_unissued(works, unusable)
                raise unusable
            # One deadline for the batch (its one pending entry): the shortest member
            # timeout; on expiry its first pending member times out, the rest abort.
            ledger.commit_all(works, specs, min([s.timeout for s in specs]))
            try:
                order = dict.fromkeys(backends)
                if len(order) == 1:
                    backends[0].submit_batch(specs, works)
                else:
                    for backend in order:
                        idx = [i for i, b in enumerate(backends) if b is backend]
                        backend.submit_batch([specs[i] for i in idx], [works[i] for i in idx])
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                error = exc
        if error is not None:
            # Part of the batch may have started on this rank, and the peers will not
            # agree on what follows: the batch fails, which aborts the communicator
            # (as any failed op does).
            unsettled: list[Work] = [w for w in works if not w.done()]
            if unsettled:
                ledger.fail(Bundle(unsettled, "coalesced batch"), error)
            raise error

    # ------------------------------------------------------------------ await
    def __await__(self) -> Generator[Any, None, list[Any]]:
        if self._state != _EXITED:
            raise InvalidArgument("await group: the coalescing body has not exited yet")
        return self._results().__await__()

    async def _results(self) -> list[Any]:
        batch = self._batch
        assert batch is not None
        return [await work for work in batch.works]
