"""NCCL backend through nccl4py (non-blocking communicator, CUDA-event completion).

Modules, by owner: ``lib`` (the nccl4py seam: result codes, ``missing``, version
gates), ``caps`` (what NCCL can run: :data:`CAPS`, one table), ``cuda`` (a communicator's device, own stream, events),
``handle`` (:class:`CommHandle`, the one owner of an NCCL communicator: its lock,
state, abort/revoke/finalize/shrink/grow), ``lanes`` (one launch thread per device),
``encode`` (OpSpecs to planned NCCL calls), ``launcher`` (:class:`NcclBackend`: jobs,
launch, completion), ``agree`` (shrink/grow agreement through the store), ``creation``
(device choice, polled init, joining a grown communicator).
What nccl4py's errors mean (their result codes) is read in ``_base/foreign.py``, the
one boundary. Importing this package imports neither nccl4py nor CUDA.
"""

from ..._base.foreign import PEER_ERRORS as PEER_ERRORS
from ..._base.foreign import REMOTE_ERROR as REMOTE_ERROR
from ..._base.foreign import SYSTEM_ERROR as SYSTEM_ERROR
from .caps import CAPS as CAPS
from .caps import COMPLEX as COMPLEX
from .caps import NATIVE as NATIVE
from .caps import NcclCaps as NcclCaps
from .creation import abort_quietly as abort_quietly
from .creation import choose_device as choose_device
from .creation import create as create
from .creation import current_device as current_device
from .creation import join_grown as join_grown
from .creation import wait_ready as wait_ready
from .cuda import CudaRuntime as CudaRuntime
from .handle import CommHandle as CommHandle
from .launcher import NcclBackend as NcclBackend
from .launcher import backend_class as backend_class
from .lib import IN_PROGRESS as IN_PROGRESS
from .lib import INVALID_ARGUMENT as INVALID_ARGUMENT
from .lib import SUCCESS as SUCCESS
from .lib import NcclError as NcclError
from .lib import NcclLib as NcclLib
from .lib import library_problem as library_problem
from .lib import missing as missing
