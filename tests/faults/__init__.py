"""Faults (``asynccoll/_faults``, elastic membership): deadlines, abort, dead, frozen and
skipping peers, shrink and failover, liveness, grow and join, prompt exits, the chaos soak."""
