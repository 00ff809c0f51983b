"""Benchmarks: each tool prints one table, comparing side by side in one run (see ``benchmarks/README.md``).

The tools are modules of this package, run from the repository root: ``python -m benchmarks.throughput``,
``python -m benchmarks.memory MODE``, ...; ``benchmarks.harness`` holds what they share, and a test calls a tool's
``main(argv)`` in-process by importing it the same way. The package itself never imports them.
"""
