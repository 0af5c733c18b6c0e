"""The backend-neutral core (``asynccoll/_core``): the communicator, its work, coalescing, the
ledger of issued ops, calling order, argument checks, object collectives, the interfaces between rooms, and trio."""
