"""The ``streams`` package: event watchers, loop wakers, ``wait_event``, stream pools, interop."""
