"""What the benchmark scripts share, written once: each script keeps only what it measures.

``launch``: torchrun commands, the workers' environment, per-rank JSON results. ``timing``: step clocks and
peak memory. ``rounds``: ABBA round order and slowest-rank medians. ``training``: the tiny GPT, its synthetic
batches and a quiet Trainer. ``tables``: aligned text tables and byte units. The tools run as modules
from the repository root (``python -m benchmarks.throughput``), so ``from benchmarks.harness.tables import format_rows``
resolves here, and a test imports a tool the same way.
"""
