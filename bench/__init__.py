"""Benchmarks: asynccoll against torch.distributed on the same machine, in the same run."""
