"""asynccoll: async-first collectives for asyncio, uvloop and trio.

``await comm.all_reduce(t)`` never blocks the event loop; every collective returns an
awaitable :class:`Work`. CPU tensors run on torch's Gloo, CUDA tensors on NCCL
(through nccl4py). See ``README.md`` and the documentation in ``docs/``.
"""

from ._base.errors import AsyncCollError as AsyncCollError
from ._base.errors import BackendUnavailable as BackendUnavailable
from ._base.errors import CollectiveMismatch as CollectiveMismatch
from ._base.errors import CollectiveTimeout as CollectiveTimeout
from ._base.errors import CommAborted as CommAborted
from ._base.errors import CommClosed as CommClosed
from ._base.errors import GradSyncError as GradSyncError
from ._base.errors import InvalidArgument as InvalidArgument
from ._base.errors import PeerFailure as PeerFailure
from ._base.ops import ReduceOp as ReduceOp
from ._bootstrap.init import init as init
from ._bootstrap.init import join as join
from ._bootstrap.init import wrap as wrap
from ._core.communicator import Communicator as Communicator
from ._core.work import Work as Work
from ._torch.register import process_group as process_group
from ._torch.register import register as _register_torch_backend
from ._train import GradSync as GradSync

__version__ = "0.1.0"

__all__ = [
    "AsyncCollError",
    "BackendUnavailable",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "CommAborted",
    "CommClosed",
    "Communicator",
    "GradSync",
    "GradSyncError",
    "InvalidArgument",
    "PeerFailure",
    "ReduceOp",
    "Work",
    "init",
    "join",
    "process_group",
    "wrap",
]

for _name in __all__:
    _obj = globals()[_name]
    if hasattr(_obj, "__module__") and _obj.__module__.startswith("asynccoll."):
        try:
            _obj.__module__ = "asynccoll"
        except (AttributeError, TypeError):
            pass
del _name, _obj

# torch.distributed learns the backend name "asynccoll" (one entry in its plugin table).
_register_torch_backend()
