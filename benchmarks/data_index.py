"""The GPT sample index at scale: bytes per sample and build time, ours beside Megatron-Core's helpers on the same
document lengths, with the cost of a 1T-token corpus's index extrapolated from the measured rates.

One set of document lengths (``--tokens``, default 1e9: lengths ``1 + Geometric(1 / (mean - 1))`` with mean
``--mean-document`` tokens, as ``data_peer.write_synthetic_corpus`` writes them; or the documents of an existing
corpus, ``--prefix``) is saved to one ``.npy`` file. For each ``--seq-lengths``, each side builds the index of one
data epoch of those documents in a fresh process (lengths read first, then its peak RSS reset):

* **lightning-megatron**: ``data/sample_index.py`` ``build_sample_index``: the document order (two epochs: the last
  samples run into the next one), the sample index (int32 document and offset) and the shuffle;
* **Megatron-Core** (``pip install --no-deps megatron-core``, a peer only, never a dependency; without it its rows
  say so): what its ``GPTDataset`` builds for one epoch: ``_build_document_index`` (one epoch), the compiled
  ``helpers.build_sample_idx`` and ``_build_shuffle_index``;
* with ``--baseline-checkout DIR``, also ours as a checkout of another commit has it (e.g. the one before), by
  the same child run with ``PYTHONPATH=DIR``.

Per row: samples, build seconds (the fastest of ``--repeats`` builds, and per billion tokens), the peak RSS
growth during the first build and per sample, the bytes the index keeps per sample (document arrays included),
for ours the peak numpy allocations per sample (``tracemalloc``, one more build in the same process), and the
ratios to Megatron-Core; then what ours costs at 1T tokens of documents as long as these (``index_bytes``;
the time scaled from the row above). Writing the arrays to the cache is not included there: with ``--prefix``
a second table times the whole build from the files by each side's ``GPTDataset`` (every document, fresh
process, the fastest of ``--repeats`` builds each into a fresh cache; ours writes a documents index and a CRC-32
of each file too), with the bytes of its files and the resident memory the dataset keeps after its build.

Example::

    python -m benchmarks.data_index                                   # 1B tokens, seq_length 64 and 2048 (~1 min)
    python -m benchmarks.data_index --tokens 1e8 --seq-lengths 64     # seconds
    git archive HEAD~3 | tar -x -C /tmp/before && python -m benchmarks.data_index --baseline-checkout /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
SEED = 1234
TRILLION = 1e12


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=float, default=1e9, help="tokens of the synthetic document lengths")
    parser.add_argument("--mean-document", type=int, default=1000, help="mean document length in tokens")
    parser.add_argument("--prefix", help="take the document lengths of this indexed dataset instead")
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[64, 2048])
    parser.add_argument("--baseline-checkout", help="also run ours from this checkout (PYTHONPATH), as a 'before' row")
    parser.add_argument("--repeats", type=int, default=3, help="builds per side and seq_length (the fastest is "
                        "timed; the peak is the first's)")
    parser.add_argument("--eos-id", type=int, default=0, help="the end-of-document id of --prefix's corpus")
    parser.add_argument("--side", choices=("ours", "megatron-core", "ours-files", "megatron-core-files"),
                        help=argparse.SUPPRESS)  # a child's build
    parser.add_argument("--lengths", help=argparse.SUPPRESS)
    parser.add_argument("--seq-length", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------------ one build (child)
def _resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _ours(lengths: np.ndarray, seq_length: int) -> list[np.ndarray]:
    from lightning_megatron.data.sample_index import build_sample_index

    index = build_sample_index(lengths, seq_length=seq_length, epochs=1, seed=SEED)
    return [index.document_order, index.sample_document, index.sample_offset, index.shuffle]


def _megatron_core(lengths: np.ndarray, seq_length: int) -> list[np.ndarray]:
    """What Megatron-Core's ``GPTDataset`` builds for one epoch, by its own functions."""
    from megatron.core.datasets import helpers
    from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index

    random_state = np.random.RandomState(SEED)
    document_index = _build_document_index(np.arange(len(lengths), dtype=np.int32), 1, random_state, False)
    sample_index = helpers.build_sample_idx(lengths, document_index, seq_length, 1, int(lengths.sum(dtype=np.int64)),
                                            True, True)
    shuffle = _build_shuffle_index(len(sample_index) - 1, len(sample_index) - 1, random_state)
    return [document_index, sample_index, shuffle]


def _build_from_files(args: argparse.Namespace, cache: Path) -> dict:
    """A whole index build of every document of ``--prefix`` by each side's ``GPTDataset``, into ``cache``."""
    if args.side == "ours-files":
        from lightning_megatron.data import GPTDataset, IndexedDataset

        corpus = IndexedDataset(args.prefix)
        build = lambda directory: GPTDataset(corpus, range(corpus.num_documents),  # noqa: E731
                                             seq_length=args.seq_length, num_samples=None, seed=SEED,
                                             eos_id=args.eos_id, cache_dir=directory)
    else:
        sys.path.insert(0, str(REPO_ROOT))  # benchmarks.data_peer
        from benchmarks.data_peer import build_megatron_core_dataset, megatron_core_available

        megatron_core_available(verbose=False)  # its modules imported before the measurement
        import megatron.core.datasets.helpers  # noqa: F401
        build = lambda directory: build_megatron_core_dataset(  # noqa: E731
            args.prefix, seq_length=args.seq_length, num_samples=None, seed=SEED, split="1,0,0", cache_dir=directory,
            eod_id=args.eos_id)[0]
    Path("/proc/self/clear_refs").write_text("5")
    before = _resident_kib("VmRSS")
    start = time.perf_counter()
    dataset = build(cache / "0")
    seconds = time.perf_counter() - start
    peak_kib = _resident_kib("VmHWM") - before
    samples, after_kib = len(dataset), _resident_kib("VmRSS") - before
    kept = sum(path.stat().st_size for path in (cache / "0").rglob("*") if path.is_file())
    del dataset
    for repeat in range(1, args.repeats):  # the fastest build, each into a fresh cache
        start = time.perf_counter()
        build(cache / str(repeat))
        seconds = min(seconds, time.perf_counter() - start)
    return {"samples": samples, "seconds": seconds, "peak_bytes": peak_kib * 1024, "traced_bytes": None,
            "kept_bytes": kept, "after_bytes": after_kib * 1024}


def child(args: argparse.Namespace) -> None:
    """One side's build in this fresh process: JSON on stdout."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron.core: Transformer Engine and Apex are absent
        if args.side.endswith("-files"):
            with tempfile.TemporaryDirectory(prefix="data-index-cache-") as cache:
                print(json.dumps(_build_from_files(args, Path(cache))))
        else:
            print(json.dumps(_build_index(args)))


def _build_index(args: argparse.Namespace) -> dict:
    """The index of ``--lengths`` by one side: its time, peak RSS growth and bytes (and for ours its numpy peak)."""
    build = _ours if args.side == "ours" else _megatron_core
    if args.side == "megatron-core":
        import megatron.core.datasets.gpt_dataset  # noqa: F401  imported before the measurement
    else:
        import lightning_megatron.data.sample_index  # noqa: F401
    lengths = np.load(args.lengths)  # read, not mapped: its pages are not the build's
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts here
    before = _resident_kib("VmRSS")
    start = time.perf_counter()
    arrays = build(lengths, args.seq_length)
    seconds = time.perf_counter() - start
    peak_kib = _resident_kib("VmHWM") - before
    samples = len(arrays[-1])  # the shuffle: one entry per sample
    kept = sum(array.nbytes for array in arrays)
    for _ in range(args.repeats - 1):  # the fastest build: this machine's cores are shared
        del arrays
        start = time.perf_counter()
        arrays = build(lengths, args.seq_length)
        seconds = min(seconds, time.perf_counter() - start)
    traced = None
    if args.side == "ours":  # numpy reports its buffers to tracemalloc; Megatron-Core's C++ buffers are not seen
        import tracemalloc

        del arrays
        tracemalloc.start()
        build(lengths, args.seq_length)
        traced = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return {"samples": samples, "seconds": seconds, "peak_bytes": peak_kib * 1024, "kept_bytes": kept,
            "traced_bytes": traced, "tokens": int(lengths.sum(dtype=np.int64)), "documents": len(lengths)}


# ------------------------------------------------------------------------------------------------ the tables (parent)
def document_lengths(args: argparse.Namespace) -> np.ndarray:
    if args.prefix:
        from lightning_megatron.data import IndexedDataset

        dataset = IndexedDataset(args.prefix)
        stored = dataset.document_extents(range(dataset.num_documents))[1]
        return stored[stored > 0].astype(np.int32)
    rng = np.random.default_rng(0)
    count = int(args.tokens // args.mean_document)
    return (1 + rng.geometric(1.0 / (args.mean_document - 1), size=count)).astype(np.int32)


def run_side(side: str, checkout: Path, lengths_file: Path, seq_length: int, args: argparse.Namespace) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--lengths", str(lengths_file),
               "--seq-length", str(seq_length), "--eos-id", str(args.eos_id), "--repeats", str(args.repeats)]
    if args.prefix:
        command += ["--prefix", str(Path(args.prefix).resolve())]
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=checkout)
    if done.returncode != 0:
        raise RuntimeError(f"the {side} build from {checkout} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.side:
        return child(args)
    from benchmarks.data_peer import megatron_core_available
    from lightning_megatron.data.sample_index import index_bytes, samples_starting_before

    peer = megatron_core_available(verbose=True)
    lengths = document_lengths(args)
    tokens = int(lengths.sum(dtype=np.int64))
    print(f"{len(lengths):,} documents, {tokens:,} tokens (mean document {tokens / len(lengths):.0f} tokens)")
    sides = [("lightning-megatron", "ours", REPO_ROOT)]
    if args.baseline_checkout:
        sides.insert(0, (f"lightning-megatron at {args.baseline_checkout}", "ours",
                         Path(args.baseline_checkout).resolve()))
    if peer:
        sides.append(("Megatron-Core", "megatron-core", REPO_ROOT))
    with tempfile.TemporaryDirectory(prefix="data-index-") as work:
        lengths_file = Path(work) / "lengths.npy"
        np.save(lengths_file, lengths)
        del lengths
        print("\nIndex of one data epoch (document order, sample index, shuffle), each side in a fresh process")
        print("seq_length | builder | samples | build s | s per 1B tokens | peak RSS growth MiB | peak RSS B/sample | "
              "kept B/sample | numpy peak B/sample | time vs Megatron-Core | peak vs Megatron-Core")
        for seq_length in args.seq_lengths:
            rows = [(name, run_side(side, checkout, lengths_file, seq_length, args)) for name, side, checkout in sides]
            reference = rows[-1][1] if peer else None
            for name, row in rows:
                per_sample = lambda value: f"{value / row['samples']:.2f}"  # noqa: E731
                traced = per_sample(row["traced_bytes"]) if row["traced_bytes"] is not None else "-"
                ratios = (f"{row['seconds'] / reference['seconds']:.2f} | "
                          f"{row['peak_bytes'] / max(reference['peak_bytes'], 1):.2f}") if reference else "- | -"
                print(f"{seq_length} | {name} | {row['samples']:,} | {row['seconds']:.3f} | "
                      f"{row['seconds'] * 1e9 / row['tokens']:.2f} | {row['peak_bytes'] / 2**20:.1f} | "
                      f"{per_sample(row['peak_bytes'])} | {per_sample(row['kept_bytes'])} | {traced} | {ratios}",
                      flush=True)
            if not peer:
                print(f"{seq_length} | Megatron-Core | not installed (pip install --no-deps megatron-core) | | | | | |")
            ours = rows[-2][1] if peer else rows[-1][1]
            documents = round(ours["documents"] * TRILLION / ours["tokens"])  # as long as these documents
            kept = index_bytes(documents, tokens_per_epoch=int(TRILLION), seq_length=seq_length, epochs=1)
            print(f"{seq_length} | ours at 1T tokens ({documents:,} documents; time scaled from the row above) | "
                  f"{samples_starting_before(int(TRILLION), seq_length):,} | "
                  f"{ours['seconds'] * TRILLION / ours['tokens']:.0f} | | {kept / 2**30:.1f} GiB (+2 MiB) | | "
                  f"{kept / 2**30:.1f} GiB | | |")
        if args.prefix:
            files_table(args, sides, lengths_file, tokens)


def files_table(args: argparse.Namespace, sides: list, lengths_file: Path, tokens: int) -> None:
    print(f"\nThe whole build from {args.prefix} (every document, one data epoch, fresh cache, fresh process): ours "
          f"documents + samples index with a CRC-32 of each file; Megatron-Core's GPTDataset (split 1,0,0) its "
          f"document, sample and shuffle index, each written as .npy")
    print("seq_length | builder | samples | build s | s per 1B tokens | peak RSS growth MiB | peak RSS B/sample | "
          "files B/sample | RSS kept after MiB | time vs Megatron-Core | peak vs Megatron-Core")
    for seq_length in args.seq_lengths:
        rows = [(name, run_side(f"{side}-files", checkout, lengths_file, seq_length, args))
                for name, side, checkout in sides]
        reference = rows[-1][1] if sides[-1][1] == "megatron-core" else None
        for name, row in rows:
            ratios = (f"{row['seconds'] / reference['seconds']:.2f} | "
                      f"{row['peak_bytes'] / max(reference['peak_bytes'], 1):.2f}") if reference else "- | -"
            print(f"{seq_length} | {name} | {row['samples']:,} | {row['seconds']:.3f} | "
                  f"{row['seconds'] * 1e9 / tokens:.2f} | {row['peak_bytes'] / 2**20:.1f} | "
                  f"{row['peak_bytes'] / row['samples']:.2f} | {row['kept_bytes'] / row['samples']:.2f} | "
                  f"{row['after_bytes'] / 2**20:.1f} | {ratios}", flush=True)
        if reference is None:
            print(f"{seq_length} | Megatron-Core | not installed (pip install --no-deps megatron-core) | | | | | |")

if __name__ == "__main__":
    main()
