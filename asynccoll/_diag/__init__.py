"""Diagnostics: the per-communicator record, fingerprint checking, mismatch reports and
trace files."""
