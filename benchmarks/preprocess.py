"""Preprocessing throughput (tokens/s) with 1 process against ``--workers`` processes, in one table.

The input is a ~20 MB ``.jsonl`` built from the Python standard library's sources (one
document per file, repeated until the size is reached), so the benchmark needs no download.
Both variants tokenise the same file with the same tokenizer into fresh output folders;
repeats alternate the order of the variants, so slow drift on a shared machine falls on
both alike, and the table shows the median. With ``--workers 1`` everything runs in one
process; with N workers the main process reads and writes while N processes tokenise.
The CPU seconds (main process and workers together) show the cost of the work itself: on a
machine shared with other jobs the wall-clock speedup depends on how many cores are free,
while CPU seconds above the 1-process figure are the pool's own overhead.

Example::

    python benchmarks/preprocess.py                             # byte tokenizer, 1 vs 2 processes
    python benchmarks/preprocess.py --workers 8 --tokenizer tokenizer.json --megabytes 200
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
from pathlib import Path

from lightning_megatron.data import stdlib_source_files
from lightning_megatron.data.preprocess import preprocess


def write_stdlib_jsonl(path: Path, *, megabytes: float) -> int:
    """Stdlib sources as JSON lines until the file holds ``megabytes``; returns its size in bytes."""
    sources = [file.read_bytes().decode("utf-8") for file in stdlib_source_files()]
    size, target = 0, megabytes * 1e6
    with open(path, "w") as f:
        while size < target:
            for text in sources:
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                size += len(line)
                if size >= target:
                    break
    return size


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the pool's workers)."""
    usages = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json")
    parser.add_argument("--workers", type=int, default=2, help="processes of the parallel variant")
    parser.add_argument("--megabytes", type=float, default=20.0, help="size of the generated .jsonl")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    variants = [1, args.workers]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        size = write_stdlib_jsonl(folder / "stdlib.jsonl", megabytes=args.megabytes)
        results: dict[int, list] = {w: [] for w in variants}
        cpu: dict[int, list[float]] = {w: [] for w in variants}
        for repeat in range(args.repeats):
            for workers in variants if repeat % 2 == 0 else variants[::-1]:
                start = cpu_seconds()
                result = preprocess(input=folder / "stdlib.jsonl", tokenizer=args.tokenizer,
                                    output_prefix=folder / f"out-{workers}-{repeat}", workers=workers, progress=False)
                cpu[workers].append(cpu_seconds() - start)
                results[workers].append(result)

    documents, tokens = results[1][0].documents, results[1][0].tokens
    print(f"\npreprocess: {size / 1e6:.1f} MB jsonl, {documents} documents, {tokens:,} tokens, tokenizer "
          f"{args.tokenizer!r}, median of {args.repeats}")
    print(f"{'processes':>9} | {'seconds':>8} | {'tokens/s':>12} | {'speedup':>7} | {'CPU seconds':>11}")
    base = statistics.median(r.tokens_per_second for r in results[1])
    for workers in variants:
        runs = results[workers]
        assert all((r.documents, r.tokens) == (documents, tokens) for r in runs), "variants disagree on the output"
        rate = statistics.median(r.tokens_per_second for r in runs)
        seconds = statistics.median(r.seconds for r in runs)
        print(f"{workers:>9} | {seconds:>8.2f} | {rate:>12,.0f} | {rate / base:>6.2f}x | {statistics.median(cpu[workers]):>11.2f}")


if __name__ == "__main__":
    main()
