"""NCCL backend through nccl4py (non-blocking communicator, CUDA-event completion).

Modules: ``lib`` (nccl4py seam, result codes, ``missing``), ``cuda`` (CUDA seam:
per-communicator comm stream, events, the ``wait_stream`` gate), ``encode``
(OpSpec to nccl4py calls, dtype and reduce-op mapping), ``launcher`` (the
backend: submit, launcher thread, completion, abort/close/shrink), ``lifecycle``
(bootstrap, polled init, ``create``).
Importing this package imports neither nccl4py nor CUDA.
"""

from .cuda import CudaRuntime as CudaRuntime
from .launcher import NcclBackend as NcclBackend
from .launcher import backend_class as backend_class
from .lib import _COMPLEX as _COMPLEX
from .lib import _NCCL_DTYPES as _NCCL_DTYPES
from .lib import _PEER_ERRORS as _PEER_ERRORS
from .lib import _REDUCING as _REDUCING
from .lib import IN_PROGRESS as IN_PROGRESS
from .lib import INVALID_ARGUMENT as INVALID_ARGUMENT
from .lib import REMOTE_ERROR as REMOTE_ERROR
from .lib import SUCCESS as SUCCESS
from .lib import SYSTEM_ERROR as SYSTEM_ERROR
from .lib import NcclError as NcclError
from .lib import NcclLib as NcclLib
from .lib import library_problem as library_problem
from .lib import missing as missing
from .lifecycle import abort_quietly as abort_quietly
from .lifecycle import create as create
from .lifecycle import device_index as device_index
from .lifecycle import wait_ready as wait_ready
