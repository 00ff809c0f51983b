"""The peer of the data benchmark: Megatron-Core's own ``GPTDataset`` over our indexed dataset files, on CPU.

Megatron-Core (``pip install --no-deps megatron-core``; its wheel ships the compiled
``megatron/core/datasets/helpers_cpp`` extension, so nothing needs compiling) is a
benchmark peer only, never a dependency of ``lightning_megatron``. Its ``GPTDataset``
reads the ``.bin``/``.idx`` files that :class:`lightning_megatron.data.indexed.IndexedDatasetWriter`
writes (the formats are byte-compatible), so both loaders can be timed on one corpus.

The functions, for a benchmark script::

    from benchmarks.data_peer import (
        write_synthetic_corpus, megatron_core_available, build_megatron_core_dataset,
        loader_samples_per_second, read_rates,
    )
    num_documents, num_tokens = write_synthetic_corpus("/tmp/corpus", 50_000_000, seed=0)
    if megatron_core_available():
        train, seconds = build_megatron_core_dataset(
            "/tmp/corpus", seq_length=2048, num_samples=20_000, seed=1234, cache_dir="/tmp/mcore_cache")
        print(read_rates(train, num_samples=2_000, batch_size=8))

Run as a script it writes a ~50M-token corpus in a temporary folder, builds the peer's
train split there (fresh cache, then again from the built cache), prints the build time
scaled to a billion tokens, the read rates, and what one sample looks like::

    python -m benchmarks.data_peer                       # 50M tokens, seq 2048
    python -m benchmarks.data_peer --tokens 200e6 --seq-length 4096 --keep /tmp/peer
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sized
from pathlib import Path
from typing import Any

import numpy as np

from lightning_megatron.data.indexed import IndexedDatasetWriter

#: Documents drawn (and written) per chunk; ~1,000 tokens each, so a chunk is ~16M tokens, 32 MB of uint16.
_DOCUMENTS_PER_CHUNK = 16_384
_VOCAB_SIZE = 50_000
_INSTALL_HINT = ("Megatron-Core is not installed; the peer needs it: `pip install --no-deps megatron-core` "
                 "(its wheel ships the compiled dataset helpers; it needs only torch, numpy and packaging).")


# ---------------------------------------------------------------------------------------------------------------
# The corpus
# ---------------------------------------------------------------------------------------------------------------


def write_synthetic_corpus(
    prefix: str | os.PathLike,
    num_tokens: int,
    *,
    seed: int = 0,
    eos_id: int = 0,
    mean_doc_tokens: int = 1000,
    vocab_size: int = _VOCAB_SIZE,
) -> tuple[int, int]:
    """Write ``prefix.bin``/``prefix.idx`` (uint16) holding exactly ``num_tokens`` tokens; return (documents, tokens).

    Document lengths are ``1 + Geometric(1 / (mean_doc_tokens - 1))``, so the mean length is
    ``mean_doc_tokens`` and every document holds at least one token before its end; token ids
    are uniform in ``[1, vocab_size)`` except the last token of every document, ``eos_id``
    (the other ids avoid ``eos_id``, so an ``eos_id`` always marks a document end). The last
    document is cut to make the total exact (it still ends with ``eos_id``).

    The corpus is generated and written in chunks of ``_DOCUMENTS_PER_CHUNK`` documents (one
    random draw per chunk; documents are views into it), so memory stays at one chunk
    (~32 MB) whatever ``num_tokens`` is; the writer's per-document cost is one ``write`` and
    one list append (the dtype already matches, so it skips its range check).
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be at least 1, got {num_tokens}.")
    if mean_doc_tokens < 2:
        raise ValueError(f"mean_doc_tokens must be at least 2 (a token and the end of document), got {mean_doc_tokens}.")
    if not 0 <= eos_id < np.iinfo(np.uint16).max or vocab_size > np.iinfo(np.uint16).max + 1 or vocab_size < 2:
        raise ValueError(f"eos_id={eos_id} and vocab_size={vocab_size} must fit uint16 token ids.")
    rng = np.random.default_rng(seed)
    written = documents = 0
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        while written < num_tokens:
            lengths = 1 + rng.geometric(1.0 / (mean_doc_tokens - 1), size=_DOCUMENTS_PER_CHUNK)
            ends = np.cumsum(lengths)
            room = num_tokens - written
            if ends[-1] >= room:  # the last chunk: keep the documents that start before the end, cut the last one
                keep = int(np.searchsorted(ends, room)) + 1
                lengths, ends = lengths[:keep], ends[:keep]
                lengths[-1] -= ends[-1] - room
                ends[-1] = room
            tokens = rng.integers(1, vocab_size, size=int(ends[-1]), dtype=np.uint16)
            if eos_id != 0:  # ids in [1, vocab) may equal eos_id: move those to 0, which is then an ordinary id
                tokens[tokens == eos_id] = 0
            tokens[ends - 1] = eos_id
            starts = ends - lengths
            for start, end in zip(starts.tolist(), ends.tolist()):
                writer.add_document(tokens[start:end])
            written += int(ends[-1])
            documents += len(lengths)
    return documents, written


# ---------------------------------------------------------------------------------------------------------------
# Megatron-Core's GPTDataset
# ---------------------------------------------------------------------------------------------------------------


def megatron_core_available(*, verbose: bool = True) -> bool:
    """Whether Megatron-Core's GPT dataset and its compiled helpers import; prints why not when ``verbose``."""
    try:
        with warnings.catch_warnings():  # megatron.core warns at import that Transformer Engine and Apex are absent
            warnings.simplefilter("ignore", UserWarning)
            import megatron.core.datasets.helpers_cpp  # noqa: F401  the compiled sample-index builder
            from megatron.core.datasets.blended_megatron_dataset_builder import (
                BlendedMegatronDatasetBuilder,  # noqa: F401
            )
            from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig  # noqa: F401
    except ImportError as error:
        if verbose:
            missing = getattr(error, "name", None) or str(error)
            extra = ""
            if missing and "helpers_cpp" in missing:
                extra = (" The compiled helpers are missing: build them with `pip install pybind11` and "
                         "`python -c 'from megatron.core.datasets.utils import compile_helpers; compile_helpers()'`.")
            print(f"{_INSTALL_HINT} (import failed: {error}).{extra}", file=sys.stderr)
        return False
    return True


class PeerTokenizer:
    """The least tokenizer ``GPTDatasetConfig`` accepts: ``eod`` and ``vocab_size``; no pad id.

    ``GPTDataset`` reads ``tokenizer.eod`` (the document end, for the masks and position ids
    when they are reset), ``tokenizer.vocab_size`` (which token dtype to expect), ``.pad``
    (absent here, so it pads with -1, an id a uint16 corpus never holds) and serialises
    ``unique_identifiers`` into its cache key.
    """

    def __init__(self, eod: int = 0, vocab_size: int = _VOCAB_SIZE) -> None:
        self._eod = eod
        self._vocab_size = vocab_size
        self.unique_identifiers = {"class": type(self).__name__, "eod": eod, "vocab_size": vocab_size}

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def vocab_size(self) -> int:
        return self._vocab_size


def megatron_core_config(
    prefix: str | os.PathLike,
    *,
    seq_length: int,
    seed: int,
    split: str = "969,30,1",
    cache_dir: str | os.PathLike | None,
    eod_id: int = 0,
    vocab_size: int = _VOCAB_SIZE,
    train_only: bool = True,
) -> Any:
    """The ``GPTDatasetConfig`` of the peer: one prefix, no weights, masks and position ids not reset.

    With ``train_only`` the valid and test rows of the split matrix are set to None after the
    config parses ``split``: the train split keeps exactly the documents ``split`` gives it,
    but only its indices are built (Megatron-LM's ``pretrain_gpt`` builds all three). The
    split matrix is part of the cache key, so such a cache is not shared with a three-split build.
    """
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([os.fspath(prefix)], None),
        split=split,
        path_to_cache=None if cache_dir is None else os.fspath(cache_dir),
        tokenizer=PeerTokenizer(eod_id, vocab_size),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    if train_only:
        config.split_matrix = [config.split_matrix[0], None, None]
    return config


def build_megatron_core_dataset(
    prefix: str | os.PathLike,
    *,
    seq_length: int,
    num_samples: int | None,
    seed: int,
    split: str = "969,30,1",
    cache_dir: str | os.PathLike,
    eod_id: int = 0,
    vocab_size: int = _VOCAB_SIZE,
    train_only: bool = True,
) -> tuple[Any, float]:
    """Megatron-Core's ``GPTDataset`` for the train split of ``prefix``, and the seconds ``build()`` took.

    One process, no ``torch.distributed``: ``BlendedMegatronDatasetBuilder.build()`` then
    builds (or loads) directly, without a barrier. With a ``cache_dir`` holding no index for
    this key the time is the index build (document index, sample index, shuffle index, and
    writing them as ``.npy``); with a built one it is opening the cached ``.npy`` files (memory
    maps) and the ``.idx``. ``num_samples=None`` asks for one epoch of the train split.
    """
    if not megatron_core_available():
        raise RuntimeError(_INSTALL_HINT)
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset

    config = megatron_core_config(prefix, seq_length=seq_length, seed=seed, split=split, cache_dir=cache_dir,
                                  eod_id=eod_id, vocab_size=vocab_size, train_only=train_only)
    sizes = [num_samples, None, None]  # valid/test: one epoch each when train_only=False, as pretrain_gpt with eval
    start = time.perf_counter()
    train, _valid, _test = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return train, time.perf_counter() - start


def cache_files(cache_dir: str | os.PathLike) -> list[Path]:
    """The files of a Megatron-Core index cache (``<md5>-GPTDataset-train-{description.txt,*_index.npy}``)."""
    directory = Path(cache_dir)
    return sorted(directory.iterdir()) if directory.is_dir() else []


# ---------------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------------


def loader_samples_per_second(
    dataset: Sized, num_samples: int, batch_size: int, *, dataloader: bool = True, warmup: int = 8
) -> float:
    """Samples per second reading samples ``0 .. num_samples - 1`` in order.

    With ``dataloader`` (the default) through ``torch.utils.data.DataLoader(dataset,
    batch_size, shuffle=False, num_workers=0)``, collation included, ``num_samples //
    batch_size`` full batches; without, by ``dataset[i]`` one at a time. ``warmup`` samples
    (or batches) past the measured ones are read first and not timed (the peer computes its
    constant masks on the first read). ``dataset[i]`` for ``GPTDataset`` goes through its
    shuffle index, so consecutive samples come from random places in the corpus.
    """
    import torch

    num_samples = min(num_samples, len(dataset))
    if num_samples < 1:
        raise ValueError("num_samples must be at least 1 and the dataset non-empty.")
    if not dataloader:
        for i in range(min(warmup, len(dataset))):
            dataset[len(dataset) - 1 - i]
        start = time.perf_counter()
        for i in range(num_samples):
            dataset[i]
        return num_samples / (time.perf_counter() - start)
    if batch_size < 1 or num_samples < batch_size:
        raise ValueError(f"num_samples ({num_samples}) must hold at least one batch of {batch_size}.")
    batches = num_samples // batch_size
    warm = torch.utils.data.DataLoader(
        torch.utils.data.Subset(dataset, range(len(dataset) - min(warmup * batch_size, len(dataset)), len(dataset))),
        batch_size=batch_size, shuffle=False, num_workers=0)
    for _ in warm:
        pass
    loader = torch.utils.data.DataLoader(
        torch.utils.data.Subset(dataset, range(batches * batch_size)),
        batch_size=batch_size, shuffle=False, num_workers=0, drop_last=True)
    start = time.perf_counter()
    for _ in loader:
        pass
    return batches * batch_size / (time.perf_counter() - start)


def read_rates(dataset: Sized, num_samples: int, batch_size: int) -> dict[str, float]:
    """Both read rates of :func:`loader_samples_per_second`: ``{"getitem": ..., "dataloader": ...}`` samples/s."""
    return {
        "getitem": loader_samples_per_second(dataset, num_samples, batch_size, dataloader=False),
        "dataloader": loader_samples_per_second(dataset, num_samples, batch_size, dataloader=True),
    }


def describe_sample(sample: dict[str, Any]) -> str:
    """One line per key: shape, dtype and the first values of a sample (a dict of tensors)."""
    lines = []
    for key, value in sample.items():
        if hasattr(value, "shape"):
            head = value.reshape(-1)[:6].tolist()
            lines.append(f"  {key:<13} shape={tuple(value.shape)} dtype={value.dtype} first={head}")
        else:
            lines.append(f"  {key:<13} {type(value).__name__} {value!r}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# The script
# ---------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=float, default=50e6, help="tokens in the generated corpus")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--num-samples", type=int, default=None,
                        help="train samples asked for (default: ~one epoch of the train split)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--split", default="969,30,1")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--read-samples", type=int, default=10_000, help="samples read for the read rates")
    parser.add_argument("--all-splits", action="store_true", help="build valid and test indices too, as pretrain_gpt")
    parser.add_argument("--repeats", type=int, default=3, help="fresh-cache builds timed; the median is shown")
    parser.add_argument("--keep", default=None, help="write corpus and cache here and keep them (default: a temp dir)")
    args = parser.parse_args()

    if not megatron_core_available():
        raise SystemExit(1)
    import torch

    torch.set_num_threads(1)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="data_peer_"))
    work.mkdir(parents=True, exist_ok=True)
    prefix, cache = work / "corpus", work / "mcore_cache"
    try:
        start = time.perf_counter()
        num_documents, num_tokens = write_synthetic_corpus(prefix, int(args.tokens))
        seconds = time.perf_counter() - start
        print(f"corpus: {num_tokens:,} tokens in {num_documents:,} documents, written in {seconds:.2f} s "
              f"({num_tokens / seconds / 1e6:.1f}M tokens/s) at {prefix}")

        train_fraction = float(args.split.split(",")[0]) / sum(float(x) for x in args.split.split(","))
        num_samples = args.num_samples or max(1, int(0.99 * train_fraction * num_tokens) // args.seq_length)
        kwargs = {"seq_length": args.seq_length, "num_samples": num_samples, "seed": args.seed, "split": args.split,
                  "cache_dir": cache, "train_only": not args.all_splits}
        builds, opens = [], []
        for _ in range(max(1, args.repeats)):
            shutil.rmtree(cache, ignore_errors=True)  # the cache key ignores the corpus' contents: never reuse one
            train, seconds = build_megatron_core_dataset(prefix, **kwargs)
            builds.append(seconds)
            opens.append(build_megatron_core_dataset(prefix, **kwargs)[1])
        build_seconds, open_seconds = statistics.median(builds), statistics.median(opens)
        cached = cache_files(cache)
        train_tokens = int(train.dataset.sequence_lengths[train.indices].sum(dtype=np.int64))
        epochs = len(train.document_index) // max(1, len(train.indices))
        per_billion = build_seconds * 1e9 / num_tokens
        print(f"peer: megatron-core GPTDataset, train split {len(train.indices):,} documents / {train_tokens:,} "
              f"tokens, {num_samples:,} samples asked, {len(train):,} built ({epochs} epoch(s)), "
              f"seq_length {args.seq_length}, {'all splits' if args.all_splits else 'train split only'}")
        print(f"  index build (fresh cache): {build_seconds:.4f} s  ->  {per_billion:.2f} s per billion corpus "
              f"tokens (scaled linearly from {num_tokens / 1e6:.0f}M tokens, not measured at 1B; median of "
              f"{len(builds)}: {', '.join(f'{b:.4f}' for b in builds)})")
        print(f"  open the built cache:      {open_seconds:.4f} s (median of {len(opens)})")
        print(f"  cache: {len(cached)} files, {sum(p.stat().st_size for p in cached) / 1e6:.1f} MB in {cache}")
        rates = read_rates(train, args.read_samples, args.batch_size)
        print(f"  read: {rates['getitem']:,.0f} samples/s by dataset[i], {rates['dataloader']:,.0f} samples/s "
              f"through a DataLoader (batch {args.batch_size}, num_workers=0), "
              f"{args.read_samples:,} samples each, 1 thread")
        print("one sample (train[0]):")
        print(describe_sample(train[0]))
        batch = next(iter(torch.utils.data.DataLoader(train, batch_size=args.batch_size)))
        print("one batch: " + ", ".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in batch.items()))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
