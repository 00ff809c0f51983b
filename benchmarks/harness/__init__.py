"""What the benchmark scripts share, written once: each script keeps only what it measures.

``launch``: torchrun commands, the workers' environment, per-rank JSON results. ``timing``: step clocks and
peak memory. ``rounds``: ABBA round order and slowest-rank medians. ``training``: the tiny GPT, its synthetic
batches and a quiet Trainer. ``tables``: aligned text tables and byte units. The scripts run as ``python benchmarks/x.py``,
so ``benchmarks/`` is on ``sys.path`` and ``from harness.tables import format_rows`` resolves here.
"""
