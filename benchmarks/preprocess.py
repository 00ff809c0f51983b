"""Preprocessing throughput with a BPE tokenizer: 1 process against ``--workers`` processes, per input format.

The corpus is the Python standard library's sources as a ~20 MB ``.jsonl`` (one document per
file, repeated until the size is reached), also written as ``.parquet`` and as a Hugging Face
``datasets`` directory when those packages are installed, so nothing is downloaded. The
tokenizer is a byte-level BPE trained on the first ~2 MB by ``lightning-megatron
train-tokenizer``, run as a child process so that this one never starts the tokenizers
library's thread pool before preprocessing forks its workers. Every variant tokenises the same
input into a fresh folder; repeats alternate the order of the variants, so slow drift on a
shared machine falls on all alike, and the table shows medians. All outputs must be the same
bytes, whatever the format and the number of workers.

Every tokenising process is single-threaded (``preprocess`` sets ``TOKENIZERS_PARALLELISM=false``),
so ``--workers N`` uses N cores and its speed-up is bounded by the cores the machine has free.
The ``ceiling`` rows measure that bound during the run: a CPU-bound Python loop, once in one
process against split over N processes. The CPU seconds (main process and workers together)
show the pool's own cost: what lies above the 1-process figure; ``cores busy`` (CPU seconds
per second) shows how much of the machine a variant got: on a machine shared with other jobs
it is below the number of processes, and the speed-up with it.

Example::

    python -m benchmarks.preprocess                                 # BPE, 1 vs 2 processes, every format
    python -m benchmarks.preprocess --workers 8 --megabytes 200 --formats jsonl
    python -m benchmarks.preprocess --tokenizer byte
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning_megatron.data import stdlib_source_files
from lightning_megatron.data.preprocess import preprocess

FORMATS = ("jsonl", "parquet", "datasets")
_CEILING_STEPS = 30_000_000  # additions of the CPU-bound loop: about as long as one preprocessing run


def write_stdlib_jsonl(path: Path, *, megabytes: float) -> list[str]:
    """Stdlib sources as JSON lines until the file holds ``megabytes``; returns the texts written."""
    sources = [file.read_bytes().decode("utf-8") for file in stdlib_source_files()]
    texts, size, target = [], 0, megabytes * 1e6
    with open(path, "w") as f:
        while size < target:
            for text in sources:
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                texts.append(text)
                size += len(line)
                if size >= target:
                    break
    return texts


def write_input(folder: Path, form: str, texts: list[str]) -> Path:
    """The texts as a .parquet file or a ``save_to_disk`` directory (the .jsonl is already written)."""
    if form == "jsonl":
        return folder / "stdlib.jsonl"
    if form == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": texts}), folder / "stdlib.parquet")
        return folder / "stdlib.parquet"
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(folder / "stdlib_dataset"), num_shards=4)
    return folder / "stdlib_dataset"


def available_formats(requested: list[str]) -> list[str]:
    """``requested`` less the formats whose optional package is missing (said once)."""
    needs = {"parquet": "pyarrow", "datasets": "datasets"}
    kept = []
    for form in requested:
        try:
            if form in needs:
                __import__(needs[form])
            kept.append(form)
        except ImportError:
            print(f"skipping {form}: pip install 'lightning-megatron[datasets]'", file=sys.stderr)
    return kept


def train_tokenizer(folder: Path, texts: list[str], *, vocab_size: int, megabytes: float) -> Path:
    """A byte-level BPE trained by the CLI, in a child process, on the first ``megabytes`` of the texts."""
    sample, size = [], 0
    for text in texts:
        if size >= megabytes * 1e6:
            break
        sample.append(json.dumps({"text": text}) + "\n")
        size += len(sample[-1])
    (folder / "train.jsonl").write_text("".join(sample))
    output = folder / "tokenizer.json"
    subprocess.run([sys.executable, "-m", "lightning_megatron.cli", "train-tokenizer", "--input",
                    str(folder / "train.jsonl"), "--vocab-size", str(vocab_size), "--output", str(output)],
                   check=True, stdout=subprocess.DEVNULL)
    return output


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the pool's workers)."""
    usages = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usages)


def _burn(steps: int) -> int:
    total = 0
    for i in range(steps):
        total += i
    return total


def ceiling(processes: int) -> tuple[float, float]:
    """Wall and CPU seconds of ``_CEILING_STEPS`` loop steps in one process, or split over ``processes``."""
    start, cpu_start = time.perf_counter(), cpu_seconds()
    if processes == 1:
        _burn(_CEILING_STEPS)
    else:
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            pool.map(_burn, [_CEILING_STEPS // processes] * processes)
    return time.perf_counter() - start, cpu_seconds() - cpu_start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default="bpe", help="'bpe' (trained here), 'byte' or a tokenizer.json")
    parser.add_argument("--vocab-size", type=int, default=8192, help="of the BPE trained here")
    parser.add_argument("--workers", type=int, default=2, help="processes of the parallel variant")
    parser.add_argument("--megabytes", type=float, default=20.0, help="size of the generated .jsonl")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    args = parser.parse_args()

    variants = [(form, workers) for form in available_formats(args.formats) for workers in (1, args.workers)]
    rows = [*variants, ("ceiling", 1), ("ceiling", args.workers)]
    seconds: dict = {row: [] for row in rows}
    cpu: dict = {row: [] for row in rows}
    outputs: dict[bytes, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        texts = write_stdlib_jsonl(folder / "stdlib.jsonl", megabytes=args.megabytes)
        inputs = {form: write_input(folder, form, texts) for form in {form for form, _ in variants}}
        tokenizer = (str(train_tokenizer(folder, texts, vocab_size=args.vocab_size, megabytes=2.0))
                     if args.tokenizer == "bpe" else args.tokenizer)
        for repeat in range(args.repeats):
            for form, workers in variants if repeat % 2 == 0 else variants[::-1]:
                prefix = folder / f"out-{form}-{workers}-{repeat}"
                start = cpu_seconds()
                result = preprocess(input=inputs[form], tokenizer=tokenizer, output_prefix=prefix, workers=workers,
                                    progress=False)
                cpu[form, workers].append(cpu_seconds() - start)
                seconds[form, workers].append(result.seconds)
                files = Path(f"{prefix}.bin").read_bytes() + Path(f"{prefix}.idx").read_bytes()
                outputs.setdefault(files, []).append((form, workers))
                Path(f"{prefix}.bin").unlink()
            for workers in (1, args.workers):
                wall, cpu_s = ceiling(workers)
                seconds["ceiling", workers].append(wall)
                cpu["ceiling", workers].append(cpu_s)
    assert len(outputs) == 1, f"the variants wrote different datasets: {list(outputs.values())}"

    tokens = result.tokens
    print(f"\npreprocess: {args.megabytes:.0f} MB of stdlib source ({len(texts)} documents, {tokens:,} tokens), "
          f"tokenizer {args.tokenizer!r}{f' ({args.vocab_size} ids)' if args.tokenizer == 'bpe' else ''}, "
          f"median of {args.repeats}; every variant wrote the same .bin/.idx")
    print(f"{'format':>8} | {'workers':>7} | {'seconds':>7} | {'tokens/s':>10} | {'speed-up':>8} | {'CPU s':>6} | "
          f"{'cores busy':>10}")
    for form, workers in rows:
        median, cpu_s = statistics.median(seconds[form, workers]), statistics.median(cpu[form, workers])
        speedup = statistics.median(seconds[form, 1]) / median
        rate = f"{tokens / median:>10,.0f}" if form != "ceiling" else f"{'-':>10}"
        print(f"{form:>8} | {workers:>7} | {median:>7.2f} | {rate} | {speedup:>7.2f}x | {cpu_s:>6.1f} | "
              f"{cpu_s / median:>10.2f}")


if __name__ == "__main__":
    main()
