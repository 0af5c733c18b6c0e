"""A simulated GPU for testing CUDA/NCCL code paths on a CPU-only machine.

It replaces the vendor libraries, never asynccoll's own code:

* :class:`SimGPU` (``device.py``): devices with streams, hardware queues, events,
  kernels, "CUDA" tensors (:class:`SimTensor`) and a caching-allocator check; opening
  one installs the doubles of ``torch.cuda`` (``cudart.py``) and of
  ``cuda.bindings.driver`` (``driver.py``), so ``streams`` and the NCCL backend's
  ``CudaRuntime`` run unmodified.
* :class:`SimNccl` (``nccl.py``, ``comm.py``, ``world.py``): a multi-rank NCCL behind
  autospecs of the real nccl4py ``Communicator``/``group_start``/``group_end`` with
  real enums and result codes; faults: kill, hang, async error, stuck calls.
* :class:`SimCluster` (``runtime.py``): both, and ways to build NCCL backends, or
  communicators whose ``init`` builds NCCL on them (``factories``, ``run_comms``).

Every rule is cited in its module to the CUDA/NCCL/torch source or doc it follows.
Needs nccl4py and cuda-bindings importable (no GPU, no libnccl call is made) and a
CPU build of torch: on a CUDA build opening one raises :class:`SimulatorUnavailable`
(a ``unittest.SkipTest``).
"""

from .device import Latch as Latch
from .device import SimTensor as SimTensor
from .gpu import SimGPU as SimGPU
from .gpu import SimulatorUnavailable as SimulatorUnavailable
from .nccl import SimNccl as SimNccl
from .runtime import Rdv as Rdv
from .runtime import SimCluster as SimCluster
from .runtime import run_threads as run_threads

__all__ = [
    "Latch",
    "Rdv",
    "SimCluster",
    "SimGPU",
    "SimNccl",
    "SimTensor",
    "SimulatorUnavailable",
    "run_threads",
]
