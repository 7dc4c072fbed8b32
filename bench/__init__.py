"""pgque's benchmarks: ``python -m bench [SUITE ...]`` (see bench/README.md).

Each suite is one module that registers itself in :mod:`bench.registry`; the
shared pieces (server, scratch database, timing, JSON and chart output) live
in :mod:`bench.harness`, :mod:`bench.measure` and :mod:`bench.report`.
"""
