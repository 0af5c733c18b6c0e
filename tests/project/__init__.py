"""Project-level checks: the package layout, the docs, the README, the examples, the benchmarks'
smoke runs and ``python -m asynccoll.doctor``."""
