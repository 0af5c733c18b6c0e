"""torch.distributed on asynccoll: a ``ProcessGroup`` whose collectives run on a communicator.

``asynccoll.process_group(comm)`` gives DDP, FSDP2, DeviceMesh and any
``dist.all_reduce(..., group=pg)`` the communicator's deadlines, bounded abort, named
dead peers, fingerprint checks and flight record; ``import asynccoll`` registers the
``"asynccoll"`` backend, so ``dist.init_process_group("asynccoll")`` builds the default
group on a communicator. See ``docs/guides/torch.md``.
"""
