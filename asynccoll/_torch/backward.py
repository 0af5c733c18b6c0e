"""A typed error out of ``loss.backward()`` when a collective issued during it fails.

DDP's reducer (C++) waits for its buckets' futures in a final autograd callback; a
future failed from Python reaches it as a plain ``RuntimeError`` whose message holds
ours (torch 2.13's ``Future.then`` keeps only the text of a Python error). So when
the first op of a backward pass is issued through the group, :class:`BackwardCheck`
queues a final callback of its own, which runs before the reducer's (that one is
queued once every bucket was issued): it waits for the ops whose futures were
handed out during this pass, and raises the first failure as it is, typed
(``PeerFailure`` with ``.ranks``); the engine re-raises a Python callback's error
unchanged.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from torch._C import _current_graph_task_id
from torch.autograd import Variable

if TYPE_CHECKING:
    from .works import C10dWork


class BackwardCheck:
    """Per process group: the ops issued during each running backward pass, by graph task."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._passes: dict[int, list[C10dWork]] = {}

    def issued(self, work: C10dWork) -> None:
        task = _current_graph_task_id()
        if task < 0:  # not inside a backward pass
            return
        with self._lock:
            works = self._passes.get(task)
            if works is None:
                self._passes[task] = works = []
                first = True
            else:
                first = False
            works.append(work)
        if first:
            Variable._execution_engine.queue_callback(lambda: self._check(task))

    def _check(self, task: int) -> None:
        with self._lock:
            works = self._passes.pop(task, [])
        for work in works:
            if work.handed_out:
                work.wait()  # raises the op's error, typed
