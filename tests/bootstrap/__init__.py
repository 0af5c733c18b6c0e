"""The bootstrap (``asynccoll/_bootstrap``): ``init`` arguments, rendezvous and stores."""
