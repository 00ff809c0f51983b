"""Data at pretraining scale: per-rank memory over corpora of growing size, index build time and loader speed,
side by side with Megatron-Core's own ``GPTDataset`` on the same files.

Four tables, one invocation:

1. **Memory per rank.** For each corpus size (``--sizes-gb``, default 0.2 1 2: gigabytes of
   uint16 tokens, written here), ``--ranks`` fresh processes (torchrun, gloo, CPU) train the
   tiny GPT for ``--steps`` steps under ``Megatron3DStrategy`` (tp=2 when the ranks allow it)
   on ``GPTDataModule(data_prefix=...)``. Each rank reports its resident memory before
   ``fit`` and after it: private (``RssAnon``) and mapped file pages (``RssFile``, the page
   cache of what was read, shared and reclaimable), and its peak during ``fit`` (``VmHWM``,
   reset just before: the index build's transient pages show there). Reading the corpus into
   memory, as ``GPTDataModule`` did before, would add the corpus size to every rank.
   ``--document-ends without`` (or ``both``) trains on the corpus with its ``PREFIX.ends``
   moved aside, so the index build reads each document's last token from the ``.bin``.
2. **Index build**, on the largest corpus: ours (the documents and samples indices of the
   train split, fresh cache) and Megatron-Core's (``BlendedMegatronDatasetBuilder`` in one
   process, fresh cache), for one data epoch at ``--seq-length``; seconds, seconds per
   billion tokens, and the time to open the built cache. The blend index (1M samples,
   3 datasets) is timed too.
3. **Loader speed**: samples/s reading the first ``--read-samples`` samples of each train
   dataset, by ``dataset[i]`` and through a ``DataLoader`` of batch 8.
4. **The end-of-document probe** of that index build (the last token of every document), timed
   alone, each way with its peak RSS (one after the other, in this process): from
   ``PREFIX.ends``, from the ``.bin`` by ``pread`` (the sidecar moved aside), and through a
   memory map of the ``.bin`` (how the build read it before ``PREFIX.ends``: the baseline).

Megatron-Core is a peer only (``pip install --no-deps megatron-core``); without it its rows
say so. See ``benchmarks/README.md`` for the numbers measured here.

Example::

    python -m benchmarks.data                                  # 0.2, 1, 2 GB corpora, 4 ranks (~3 min, 3.2 GB disk)
    python -m benchmarks.data --sizes-gb 0.01 --ranks 2 --quick   # seconds
    python -m benchmarks.data --sizes-gb 0.572 --document-ends both   # peak RSS, with and without PREFIX.ends
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

from benchmarks.harness.launch import read_ranks, run_checked, torchrun, worker_env
from benchmarks.data_peer import (  # the peer module lives next to this script
    build_megatron_core_dataset,
    loader_samples_per_second,
    megatron_core_available,
    write_synthetic_corpus,
)

EOS, VOCAB = 256, 257  # the byte tokenizer's ids: the corpus trains the byte-level tiny GPT as it is
SPLIT = "969,30,1"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[0.2, 1.0, 2.0],
                        help="corpus sizes in GB of uint16 tokens")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-length", type=int, default=2048, help="of the index build and loader tables")
    parser.add_argument("--read-samples", type=int, default=2000)
    parser.add_argument("--dir", help="where the corpora go (default: a temporary directory, removed after)")
    parser.add_argument("--quick", action="store_true", help="no memory table (no torchrun launches)")
    parser.add_argument("--document-ends", choices=("with", "without", "both"), default="with",
                        help="memory table: train with the corpus's PREFIX.ends sidecar, without it (moved aside: "
                        "the last tokens are read from the .bin), or both")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a rank of the memory table: the corpus prefix
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------------ memory (per rank)
def resident_kib() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            fields[name] = int(value.split()[0])
    return fields


def worker(args: argparse.Namespace) -> None:
    """One rank: the tiny GPT trained for a few steps on the corpus; resident memory before and after."""
    import lightning as L

    from lightning_megatron import Megatron3DStrategy
    from lightning_megatron.data import GPTDataModule
    from lightning_megatron.models import GPT, GPTConfig

    world = int(os.environ["WORLD_SIZE"])
    L.seed_everything(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, max_seq_length=256, hidden_size=32, num_layers=2, num_heads=4))
    data = GPTDataModule(data_prefix=args.worker, seq_length=256, global_batch_size=8, split=SPLIT,
                         index_cache_dir=str(Path(args.result_dir) / "index_cache"))
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=args.steps, limit_val_batches=2,
                        val_check_interval=args.steps, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=Megatron3DStrategy(tensor_parallel_size=2 if world % 2 == 0 else 1))
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from here: what fit adds
    before = resident_kib()
    trainer.fit(model, datamodule=data)
    after = resident_kib()
    rank = int(os.environ["RANK"])
    Path(args.result_dir, f"rank{rank}.json").write_text(json.dumps({"before": before, "after": after}))
    os._exit(0)  # skip gloo's C++ teardown


def memory_table(corpora: list[tuple[str, int]], args: argparse.Namespace, work: Path) -> None:
    print(f"\n1. Resident memory per rank ({args.ranks} ranks, {args.steps} steps of the tiny GPT, MiB)")
    print("corpus GB | PREFIX.ends | rank | RSS before | RSS after | peak growth | private growth | "
          "mapped-file growth | corpus MiB")
    variants = ("with", "without") if args.document_ends == "both" else (args.document_ends,)
    for prefix, tokens in corpora:
        for variant in variants:
            result_dir = work / f"ranks-{Path(prefix).name}-{variant}"
            result_dir.mkdir(parents=True, exist_ok=True)
            cmd = torchrun(args.ranks, __spec__.name, "--worker", prefix, "--result-dir", str(result_dir),
                           "--steps", str(args.steps))
            sidecar, aside = Path(f"{prefix}.ends"), Path(f"{prefix}.ends.aside")
            if variant == "without" and sidecar.exists():
                sidecar.rename(aside)
            try:
                run_checked(cmd, f"the ranks on {prefix}", result_dir, worker_env())
            finally:
                if aside.exists():
                    aside.rename(sidecar)
            for rank, result in enumerate(read_ranks(result_dir, args.ranks)):
                before, after = result["before"], result["after"]
                mib = lambda kib: f"{kib / 1024:.0f}"  # noqa: E731
                print(f"{tokens * 2 / 1e9:9.3f} | {variant:>11} | {rank:4d} | {mib(before['VmRSS']):>10} | "
                      f"{mib(after['VmRSS']):>9} | {mib(after['VmHWM'] - before['VmRSS']):>11} | "
                      f"{mib(after['RssAnon'] - before['RssAnon']):>14} | "
                      f"{mib(after['RssFile'] - before['RssFile']):>18} | {tokens * 2 / 2**20:10.0f}", flush=True)


# ------------------------------------------------------------------------------------------------ index and loader
def ours(prefix: str, seq_length: int, cache_dir: Path):
    """Our train split (one data epoch) and the seconds its indices took to build."""
    from lightning_megatron.data import GPTDataset, IndexedDataset
    from lightning_megatron.data.splits import split_document_ranges

    start = time.perf_counter()
    corpus = IndexedDataset(prefix)
    train = split_document_ranges(SPLIT, corpus.num_documents)["train"]
    dataset = GPTDataset(corpus, train, seq_length=seq_length, num_samples=None, seed=1234, eos_id=EOS,
                         cache_dir=cache_dir)
    return dataset, time.perf_counter() - start


def probe(how: str, prefix: str) -> dict:
    """The train split's documents array built with the last tokens read ``how``: seconds, documents, and how far
    this process's peak RSS rose (reset first; the probes run one after the other in this process)."""
    import numpy as np

    from lightning_megatron.data import IndexedDataset
    from lightning_megatron.data.gpt_dataset import split_documents
    from lightning_megatron.data.indexed import data_file
    from lightning_megatron.data.splits import split_document_ranges

    train = split_document_ranges(SPLIT, IndexedDataset(prefix).num_documents)["train"]
    Path("/proc/self/clear_refs").write_text("5")
    before, start = resident_kib()["VmRSS"], time.perf_counter()
    if how == "memory map":  # the baseline: the build's reading before PREFIX.ends
        dataset = IndexedDataset(prefix)
        starts, stored = dataset.document_extents(train)
        tokens = np.memmap(data_file(prefix), dtype=dataset.dtype, mode="r")
        documents = int((tokens[(starts + stored - 1)[stored > 0]] == EOS).size)
        del tokens
    else:
        with warnings.catch_warnings():  # pread: the warning that PREFIX.ends is missing
            warnings.simplefilter("ignore")
            documents = len(split_documents(IndexedDataset(prefix), train, EOS)["starts"])
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_kib": resident_kib()["VmHWM"] - before, "documents": documents}


def probe_table(prefix: str) -> None:
    print("\n4. The end-of-document probe alone (the train split's documents array)")
    print("last tokens from | documents | seconds | peak RSS growth MiB | peak vs memory map")
    rows = {}
    sidecar, aside = Path(f"{prefix}.ends"), Path(f"{prefix}.ends.aside")
    for how in ("PREFIX.ends", "pread", "memory map"):
        if how == "pread":
            sidecar.rename(aside)
        try:
            rows[how] = probe(how, prefix)
        finally:
            if aside.exists():
                aside.rename(sidecar)
    for how, row in rows.items():
        print(f"{how} | {row['documents']} | {row['seconds']:.3f} | {row['peak_kib'] / 1024:.1f} | "
              f"{row['peak_kib'] / max(rows['memory map']['peak_kib'], 1):.3f}")


def index_and_loader_tables(prefix: str, tokens: int, args: argparse.Namespace, work: Path) -> None:
    from lightning_megatron.data.blend import blend_index

    peer = megatron_core_available(verbose=True)
    rows = []
    for name in ("lightning-megatron", "Megatron-Core") if peer else ("lightning-megatron",):
        cache = work / f"cache-{name}"
        shutil.rmtree(cache, ignore_errors=True)
        if name == "lightning-megatron":
            build = lambda: ours(prefix, args.seq_length, cache)  # noqa: E731
        else:
            build = lambda: build_megatron_core_dataset(prefix, seq_length=args.seq_length, num_samples=None,  # noqa: E731
                                                        seed=1234, split=SPLIT, cache_dir=cache, eod_id=EOS,
                                                        vocab_size=VOCAB)
        dataset, built = build()
        dataset, opened = build()
        read = min(args.read_samples, len(dataset))
        rates = (loader_samples_per_second(dataset, read, 8, dataloader=False),
                 loader_samples_per_second(dataset, read, 8, dataloader=True))
        rows.append((name, len(dataset), built, opened, rates))
    if not peer:
        rows.append(("Megatron-Core", None, None, None, None))

    print(f"\n2. Index build, train split of {tokens / 1e9:.2f}B tokens, seq_length {args.seq_length}, one data epoch")
    print("loader | samples | build s | s per 1B tokens | open cached s")
    for name, samples, built, opened, _ in rows:
        if samples is None:
            print(f"{name} | not installed (pip install --no-deps megatron-core) | | |")
            continue
        print(f"{name} | {samples} | {built:.3f} | {built * 1e9 / tokens:.2f} | {opened:.4f}")
    start = time.perf_counter()
    blend_index([0.2, 0.3, 0.5], 1_000_000)
    print(f"blend index (ours), 1M samples over 3 datasets | | {time.perf_counter() - start:.2f} | |")

    print(f"\n3. Loader speed, the first {min(args.read_samples, rows[0][1])} train samples of seq_length "
          f"{args.seq_length} (samples/s)")
    print("loader | dataset[i] | DataLoader(batch 8) | ratio to Megatron-Core (DataLoader)")
    peer_rate = rows[1][4][1] if peer else None
    for name, samples, _, _, rates in rows:
        if samples is None:
            continue
        ratio = f"{rates[1] / peer_rate:.2f}" if peer_rate else "-"
        print(f"{name} | {rates[0]:.0f} | {rates[1]:.0f} | {ratio}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="data-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        corpora = []
        for gigabytes in args.sizes_gb:
            prefix = str(work / f"corpus-{gigabytes:g}gb")
            tokens = int(gigabytes * 1e9 / 2)
            start = time.perf_counter()
            _, written = write_synthetic_corpus(prefix, tokens, seed=0, eos_id=EOS, vocab_size=EOS)
            Path(f"{prefix}.meta.json").write_text(json.dumps({"tokenizer": "byte", "vocab_size": VOCAB, "eos_id": EOS}))
            print(f"wrote {prefix}: {written:,} tokens in {time.perf_counter() - start:.1f} s", flush=True)
            corpora.append((prefix, written))
        if not args.quick:
            memory_table(corpora, args, work)
        index_and_loader_tables(*corpora[-1], args, work)
        probe_table(corpora[-1][0])
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
