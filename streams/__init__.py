"""CUDA plumbing for async collectives.

* :func:`comm_stream` / :class:`StreamSet`: a dedicated, highest-priority stream per device;
* :class:`OwnStreams` / :func:`own_streams`: streams created for this process alone
  (``torch.cuda.Stream()`` hands out streams of a shared pool);
* :class:`EventPool`: reusable CUDA events;
* :func:`current_stream` / :func:`as_torch_tensor`: the current stream of torch or CuPy, and
  CuPy / DLPack arrays as torch tensors;
* :func:`wait_event`: a CUDA event as an awaitable, served by one :class:`EventWatcher`
  thread per device and woken through a batched :class:`LoopWaker` (asyncio and uvloop).

Importable on machines without CUDA; functions that need it raise :class:`CudaUnavailable`.
Importing starts no thread and does not initialise CUDA.
"""

from ._errors import CudaUnavailable as CudaUnavailable
from ._errors import DeviceLike as DeviceLike
from ._errors import cuda_available as cuda_available
from ._interop import as_torch_tensor as as_torch_tensor
from ._interop import current_stream as current_stream
from ._pool import EventPool as EventPool
from ._pool import OwnStreams as OwnStreams
from ._pool import StreamSet as StreamSet
from ._pool import comm_stream as comm_stream
from ._pool import default_stream_set as default_stream_set
from ._pool import own_streams as own_streams
from ._waker import LoopWaker as LoopWaker
from ._waker import loop_waker as loop_waker
from ._watcher import EventLike as EventLike
from ._watcher import EventWatcher as EventWatcher
from ._watcher import WatcherClosed as WatcherClosed
from ._watcher import default_watcher as default_watcher
from ._watcher import wait_event as wait_event


def reset() -> None:
    """Forget the process-wide CUDA objects: the :func:`comm_stream` set, the
    :func:`own_streams` pool and the default watchers (closed).

    For test kits that replace CUDA (``asynccoll.testing.simgpu`` closes a simulated
    GPU this way); a program never needs it: the objects live as long as the process.
    """
    from . import _pool, _watcher

    _pool.forget()
    _watcher.forget()


__all__ = [
    "CudaUnavailable",
    "DeviceLike",
    "EventLike",
    "EventPool",
    "EventWatcher",
    "LoopWaker",
    "OwnStreams",
    "StreamSet",
    "WatcherClosed",
    "as_torch_tensor",
    "comm_stream",
    "cuda_available",
    "current_stream",
    "default_stream_set",
    "default_watcher",
    "loop_waker",
    "own_streams",
    "reset",
    "wait_event",
]

for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("streams."):
        try:
            _obj.__module__ = "streams"
        except (AttributeError, TypeError):
            pass
del _name, _obj
