""":class:`SimGPU`: the simulated devices (``device.py``) with the vendor doubles installed.

Opening one replaces ``torch.cuda`` (``cudart.py``) and ``cuda.bindings.driver``
(``driver.py``) by doubles on its devices and forgets ``streams``' process-wide CUDA
objects (a new "process"); closing it restores the real ones.
"""

from __future__ import annotations

from typing import Any

from . import cudart, driver
from .device import Device


class SimGPU(Device):
    """The simulated GPU of one test; see :class:`~.device.Device` for its options and rules."""

    def __init__(self, **options: Any) -> None:
        import streams

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
