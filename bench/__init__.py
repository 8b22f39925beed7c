"""Benchmarks for gpuwatchd (issue 6): poll cost, holder scan against fuser/lsof, memory, latency.

Run with ``make bench`` (``bench/run.py``); ``--quick`` is the seconds-long smoke mode that
``tests/system/test_bench_smoke.py`` uses. Nothing here is imported by the daemon.
"""
