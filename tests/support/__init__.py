"""What the tests share (backends, ports, spies, rank functions) and the tools over the suite.

Rank functions live in modules here so that ``run_ranks`` workers can import them by name;
``python -m tests.support.covered`` and ``python -m tests.support.mutations`` are tools.
"""
