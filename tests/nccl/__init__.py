"""The NCCL backend (``asynccoll/_backends/nccl``): its binding to nccl4py, end to end on the
simulated GPU (``test_simgpu_*``), and on a real GPU where there is one (``test_gpu``)."""
