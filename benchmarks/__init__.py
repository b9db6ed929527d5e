"""Benchmark harness of fusedops.

``benchmarks/harness.py`` holds everything shared by all operators (timing,
copy-bandwidth measurement, correctness gate, CSV/markdown/PNG reporting);
``benchmarks/ops/<op>.py`` declares one operator each; ``benchmarks/run.py`` is
the command line.  See ``benchmarks/README.md``.
"""
