"""The small interface every backend implements (Gloo, NCCL, a wrapped torch group).

A backend executes validated :class:`OpSpec` s for one kind of device. It must
never block the caller of :meth:`submit`, and it reports each outcome exactly once,
from any thread, to the :class:`Sink` it was bound to (the communicator's ledger):
``sink.succeed(target)`` or ``sink.fail(target, exc)``, with ``exc`` already in the
contract's family (``errors.py``) and the backend's original error as ``__cause__``.
A failure makes the communicator abort, so a backend does not abort itself on
errors. Backends never touch Work internals.
"""

from __future__ import annotations

import abc
from typing import Any, Iterable, Protocol, Sequence

from .._base.ops import OpSpec
from .work import Bundle, Work


class Sink(Protocol):
    """Where a backend reports outcomes (implemented by ``ledger.Ledger``)."""

    def succeed(self, target: Work | Bundle, value: Any = None) -> None: ...

    def succeed_all(self, targets: Iterable[Work | Bundle]) -> None: ...

    def fail(self, target: Work | Bundle, exc: BaseException) -> None: ...


class Backend(abc.ABC):
    """Runs operations for one device type (``"cpu"`` or ``"cuda"``)."""

    #: Short name shown in ``comm.backend`` and errors ("gloo", "nccl", "torch").
    name: str = ""
    #: The tensor device type this backend serves; ``None`` serves any device.
    device_type: str | None = None
    #: Where outcomes go; set once by the communicator through :meth:`bind`.
    sink: Sink

    def bind(self, sink: Sink) -> None:
        """Report outcomes to ``sink`` from now on (called once, before any submit)."""
        self.sink = sink

    @abc.abstractmethod
    def submit(self, spec: OpSpec, work: Work | Bundle) -> None:
        """Start ``spec`` now, in call order; report its outcome to the sink.

        May raise ``InvalidArgument`` synchronously for input the backend cannot
        run; nothing must have been started in that case.
        """

    def submit_batch(self, specs: Sequence[OpSpec], works: Sequence[Work]) -> None:
        """Start a coalesced batch (API.md §4). Default: each op in order."""
        for spec, work in zip(specs, works):
            self.submit(spec, work)

    @abc.abstractmethod
    def abort(self) -> None:
        """Stop using the transport at once: bounded, non-blocking, idempotent.

        Pending Works have already been failed by the ledger, which ignores any
        success reported afterwards.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources after all Works settled. May block briefly; runs off the loop."""

    def release(self) -> None:
        """The communicator was garbage-collected: stop threads, never block. Default: abort."""
        self.abort()
