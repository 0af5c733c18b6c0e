"""asynccoll.testing: run an async function on several ranks, in real processes, and break them.

``run_ranks(fn, world_size=2)`` runs ``async def fn(comm)`` on every rank and returns
each rank's value; a rank's exception is re-raised with its remote traceback, and ranks
stuck past the timeout have their stacks printed and are killed (:class:`RanksTimedOut`).
Worker processes are kept in a :class:`RankPool` between runs and replaced after any
run that was not clean. Inside a rank, :func:`crash`, :func:`crash_later`,
:func:`freeze` and :func:`skip_collective` inject faults.
"""

from ._errors import RanksTimedOut as RanksTimedOut
from ._errors import RemoteTraceback as RemoteTraceback
from ._faults import crash as crash
from ._faults import crash_later as crash_later
from ._faults import freeze as freeze
from ._faults import skip_collective as skip_collective
from ._pool import RankPool as RankPool
from ._pool import run_ranks as run_ranks
from ._worker import RankContext as RankContext

__all__ = [
    "RankContext",
    "RankPool",
    "RanksTimedOut",
    "RemoteTraceback",
    "crash",
    "crash_later",
    "freeze",
    "run_ranks",
    "skip_collective",
]

for _name in __all__:
    _obj = globals()[_name]
    try:
        _obj.__module__ = "asynccoll.testing"
    except (AttributeError, TypeError):
        pass
del _name, _obj
