"""Bootstrap: from ``init()``'s arguments (or torchrun's environment) to a running Communicator.

``args`` checks the arguments, ``stores`` keeps the process's TCPStores,
``rendezvous`` meets the other ranks, ``build`` makes the backends and the
Communicator, and ``init`` holds the public ``init()`` and ``wrap()``.
"""
