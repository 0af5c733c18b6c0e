""":class:`SimGPU`: the simulated devices (``device.py``) with the vendor doubles installed.

Opening one replaces ``torch.cuda`` (``cudart.py``) and ``cuda.bindings.driver``
(``driver.py``) by doubles on its devices and forgets ``streams``' process-wide CUDA
objects (a new "process"); closing it restores the real ones.
"""

from __future__ import annotations

import unittest
from typing import Any

import torch

from . import cudart, driver
from .device import Device


class SimulatorUnavailable(unittest.SkipTest):
    """The simulated GPU cannot open here: it replaces ``torch.cuda``'s classes with
    subclasses, which only a CPU build of torch allows (a CUDA build refuses them:
    "object.__new__(ExternalStream) is not safe", seen on torch 2.11+cu130). A
    ``unittest.SkipTest``, so a test that opens one on a CUDA build is skipped with this
    reason (pytest and unittest both treat it so); the real-GPU tests run there instead."""


class SimGPU(Device):
    """The simulated GPU of one test; see :class:`~.device.Device` for its options and rules."""

    def __init__(self, **options: Any) -> None:
        import streams

        if torch.version.cuda is not None:
            raise SimulatorUnavailable(
                f"the simulated GPU needs a CPU build of torch; this one ({torch.__version__}) is built for "
                f"CUDA {torch.version.cuda}, whose torch.cuda classes cannot be replaced"
            )
        super().__init__(**options)
        self.runtime = cudart.TorchCuda(self)
        self.driver = driver.Driver(self)
        streams.reset()  # nothing of an earlier GPU (or of none) survives
        self.runtime.install()
        self.driver.install()

    def closing(self) -> None:
        import streams

        streams.reset()  # its process-wide streams and watchers belong to this GPU
        self.driver.uninstall()
        self.runtime.uninstall()

    def __enter__(self) -> SimGPU:
        return self
