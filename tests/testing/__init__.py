"""The test kit (``asynccoll.testing``): ``run_ranks`` and fault injection, and the simulated
GPU itself (``test_simgpu_*``: the device model, the doubles, the simulated NCCL's rules)."""
