"""The completion protocol: how a waiter meets the backend queue that finishes its op.

A backend that can tell cheaply whether an op has finished attaches a
:class:`Completion` to every Work it submits (:meth:`Work.attach
<asynccoll._core.work.Work.attach>`). The Work then uses it, and nothing else does:

* whoever asks whether a pending Work is done (``done()``, ``result()``,
  ``exception()``), or starts waiting on it, first calls :meth:`settle_finished`,
  so that an op which already finished is settled on the spot, on the asking thread,
  without a thread hop;
* whoever starts waiting on a Work still pending after that (``await``, ``wait()``,
  ``add_done_callback``) then calls :meth:`watch_unfinished`, so that the backend's
  completion thread waits for the op and settles it (which wakes the waiter).

Outcomes still go through the backend's sink (``backend.Sink``): a Completion only
decides *when* and *on which thread* they are collected. Issuing an op never settles
anything.
"""

from __future__ import annotations

from typing import Protocol


class Completion(Protocol):
    """One backend queue's answer to "is it finished yet?" (module docstring)."""

    def settle_finished(self) -> None:
        """Settle, on the calling thread, the ops of this queue that have already
        finished, in issue order (cheap when none has). Never blocks."""

    def watch_unfinished(self) -> None:
        """Someone waits for an op of this queue that has not finished: make sure the
        completion thread waits for it and settles it when it finishes. Never blocks."""


class Completions:
    """The completions of the several queues that run parts of one coalesced batch."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[Completion] = []

    def add(self, completion: Completion) -> None:
        if completion not in self.parts:
            self.parts.append(completion)

    def settle_finished(self) -> None:
        for part in tuple(self.parts):
            part.settle_finished()

    def watch_unfinished(self) -> None:
        for part in tuple(self.parts):
            part.watch_unfinished()
