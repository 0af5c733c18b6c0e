"""Backends: Gloo and any torch ProcessGroup (``torch_pg``), NCCL through nccl4py (``nccl``)."""
