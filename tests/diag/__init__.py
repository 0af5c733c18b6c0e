"""Diagnostics (``asynccoll/_diag``): fingerprints, the flight record, trace files, ``diagnose``."""
