"""The small interface every backend implements (Gloo, NCCL, a wrapped torch group).

A backend executes validated :class:`OpSpec` s for one kind of device. It must
never block the caller of :meth:`submit`, and it settles each Work exactly once,
from any thread, with ``work._set_result(value)`` or ``work._set_exception(exc)``;
exceptions are already translated into the contract's family (``errors.py``) with
the backend's original error as ``__cause__``. A failed Work makes the
communicator abort, so a backend does not abort itself on errors.
"""

from __future__ import annotations

import abc
from typing import Sequence

from .ops import OpSpec
from .work import Work


class Backend(abc.ABC):
    """Runs operations for one device type (``"cpu"`` or ``"cuda"``)."""

    #: Short name shown in ``comm.backend`` and errors ("gloo", "nccl", "torch").
    name: str = ""
    #: The tensor device type this backend serves; ``None`` serves any device.
    device_type: str | None = None

    @abc.abstractmethod
    def submit(self, spec: OpSpec, work: Work) -> None:
        """Start ``spec`` now, in call order; settle ``work`` when it ends.

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

        Pending Works have already been failed by the communicator; the backend must
        not settle them as successes afterwards.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources after all Works settled. May block briefly; runs off the loop."""
