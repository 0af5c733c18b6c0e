"""The op path: the Communicator's calls, validation, the ledger of issued ops, Works,
coalescing, object collectives and the backend interface."""
