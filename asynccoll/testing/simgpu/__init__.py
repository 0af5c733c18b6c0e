"""A simulated GPU for testing CUDA/NCCL code paths on a CPU-only machine.

* :class:`SimGPU` (``device.py``): streams as FIFO queues run by one virtual device
  thread, events, gates, held kernels, "CUDA" tensors (:class:`SimTensor`), and a
  caching-allocator check (``record_stream``).
* :class:`SimNccl` (``nccl.py``): a multi-rank NCCL behind autospecs of the real
  nccl4py ``Communicator``/``group_start``/``group_end`` with real enums and result
  codes; faults: kill, hang, async error, calls stuck inside NCCL.
* :class:`SimCluster` / :class:`SimCudaRuntime` (``runtime.py``): the NCCL
  backend's CUDA seam on the simulator; build backends, or communicators whose
  ``init`` builds NCCL on the simulator (``factories``, ``run_comms``).

Needs nccl4py importable (no GPU, no libnccl call is made for communication).
"""

from .device import Latch as Latch
from .device import SimEvent as SimEvent
from .device import SimGPU as SimGPU
from .device import SimStream as SimStream
from .device import SimTensor as SimTensor
from .nccl import SimNccl as SimNccl
from .runtime import Rdv as Rdv
from .runtime import SimCluster as SimCluster
from .runtime import SimCudaRuntime as SimCudaRuntime
from .runtime import run_threads as run_threads

__all__ = [
    "Latch", "Rdv", "SimCluster", "SimCudaRuntime", "SimEvent", "SimGPU", "SimNccl",
    "SimStream", "SimTensor", "run_threads",
]
