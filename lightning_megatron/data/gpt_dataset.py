"""GPT samples over a memory-mapped indexed dataset, with cached index arrays (Megatron-LM's ``GPTDataset``).

Opening the dataset reads the ``.idx`` header and opens small cached arrays
(``data/sample_index.py``, ``data/index_cache.py``); a sample reads its own entries of
them and its ``seq_length + 1`` tokens from the ``.bin`` (``os.pread``, nothing mapped:
``data/file_array.py``). A corpus of any size therefore costs each rank the samples it
reads, never the tokens or the index.

Optional per-document masks, as Megatron-LM offers them for packed samples:

* ``reset_position_ids``: positions restart at 0 after every end-of-document token, so each
  document is positioned as if it were alone (``position_ids`` in the sample);
* ``reset_attention_mask``: a token attends only to earlier tokens of its own document
  (``document_ids`` in the sample: the model builds the causal, same-document mask);
* ``eod_mask_loss``: no loss where the input token is the end-of-document id (the
  prediction of the next document's first token from nothing).

An end-of-document token belongs to the document it ends.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_megatron.data.file_array import FileArray
from lightning_megatron.data.index_cache import Ranks, load_or_build
from lightning_megatron.data.indexed import IndexedDataset, data_file, index_file
from lightning_megatron.data.sample_index import (
    build_sample_index,
    epochs_for,
    samples_starting_before,
)

IGNORE_INDEX = -100
_INDEX_VERSION = 2  # bump when the arrays' meaning changes: old cache entries are then rebuilt


@dataclass(frozen=True)
class DocumentMasks:
    """Which of Megatron-LM's per-document masks the samples carry (all off: plain packing)."""

    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False


def split_documents(dataset: IndexedDataset, documents: range, eos_id: int) -> dict[str, np.ndarray]:
    """``starts`` (first token), ``stored`` (tokens in the ``.bin``) and ``lengths`` (with the end-of-document
    token) of each non-empty document of ``documents``, and ``tokens``: their sum (one value, so that a rank
    opening the cache need not read every length).

    Lengths come from the ``.idx``; whether a document already ends with ``eos_id`` from its last
    token, which ``PREFIX.ends`` records (else it is read from the ``.bin`` without mapping it:
    ``IndexedDataset.last_tokens``). The ``.idx`` is read through the mappings of a fresh
    ``IndexedDataset`` that are closed again, so the pages read do not stay in this process (the builder's).
    The build holds the 16 bytes a document it returns and the last tokens (one token a document).
    """
    dataset = IndexedDataset(dataset.prefix)
    last_tokens = dataset.last_tokens(documents)
    starts = np.empty(len(documents), np.int64)
    stored, lengths = np.empty(len(documents), np.int32), np.empty(len(documents), np.int32)
    kept = 0  # the arrays are filled a part of the documents at a time: no int64 temporaries per document
    for part, part_starts, part_stored in dataset.extents_by_chunk(documents):
        keep = part_stored > 0
        end = kept + int(keep.sum())
        starts[kept:end], stored[kept:end] = part_starts[keep], part_stored[keep]
        adds_eos = last_tokens[part.start - documents.start:part.stop - documents.start][keep] != eos_id
        np.add(stored[kept:end], adds_eos, out=lengths[kept:end])
        kept = end
    del dataset
    return {"starts": starts[:kept], "stored": stored[:kept], "lengths": lengths[:kept],
            "tokens": np.array([lengths[:kept].sum(dtype=np.int64)])}


def documents_key(dataset: IndexedDataset, documents: range, eos_id: int) -> dict:
    """Everything a split's document arrays depend on; a change in any of them selects another cache entry.
    ``PREFIX.ends`` is not part of it: the arrays are the same with it and without it, and a stale one is not used."""
    files = {}
    for path in (index_file(dataset.prefix), data_file(dataset.prefix)):
        stat = path.stat()
        files[path.suffix] = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return {"kind": "gpt-documents", "version": _INDEX_VERSION, "prefix": os.path.abspath(dataset.prefix),
            "files": files, "documents": [documents.start, documents.stop], "eos_id": eos_id}


class GPTDataset(Dataset):
    """Next-token samples ``{"input_ids", "labels"}`` (``[seq_length]`` each) from ``documents`` of an indexed dataset.

    Args:
        dataset: the memory-mapped corpus.
        documents: the document ids of this split (see ``data/splits.py``).
        seq_length: tokens per sample.
        num_samples: samples the run draws (``max_steps * global_batch_size`` for training);
            enough data epochs are indexed for them, each with its own document order, and the
            dataset is that long. ``None``: the samples of one data epoch.
        seed: seed of the document orders and the sample order.
        eos_id: the end-of-document id, added after each document that does not end with it.
        cache_dir: where the index arrays are cached.
        ranks: who builds the cache (one rank) and who waits; one process by default.
        masks: Megatron-LM's per-document masks (see the module docstring).
        vocab_size: when given, a sample holding an id at or above it is refused (data made
            with another tokenizer), naming the id.
        name: how the dataset is called in logs and errors.

    ``shuffles_samples`` is true when ``num_samples`` is given: the order of the samples over
    all the data epochs is this dataset's, so the data module's sampler only splits it over
    data-parallel ranks. With one data epoch the sampler reshuffles it every epoch.
    """

    def __init__(
        self,
        dataset: IndexedDataset,
        documents: range,
        *,
        seq_length: int,
        num_samples: Optional[int],
        seed: int,
        eos_id: int,
        cache_dir: str | os.PathLike,
        ranks: Ranks = Ranks(),
        masks: DocumentMasks = DocumentMasks(),
        vocab_size: Optional[int] = None,
        name: str = "GPT",
    ) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length must be at least 1, got {seq_length}")
        self.dataset, self.documents, self.seq_length, self.eos_id = dataset, documents, seq_length, eos_id
        self.masks, self.vocab_size, self.name = masks, vocab_size, name
        self.shuffles_samples = num_samples is not None
        # Two cache entries, both built by one rank and read by all: the split's documents (shared by
        # every seq_length and seed), then its samples. No rank holds an array that grows with the corpus.
        documents_entry = documents_key(dataset, documents, eos_id)
        documents_cache = load_or_build(cache_dir, documents_entry, lambda: split_documents(dataset, documents, eos_id),
                                        ranks=ranks, what=f"{name} documents")
        split = documents_cache.arrays
        self.tokens_per_epoch = int(split["tokens"][0])
        if self.tokens_per_epoch < seq_length + 1:
            raise ValueError(
                f"{name}: documents {documents.start}..{documents.stop - 1} of {dataset.prefix} hold "
                f"{self.tokens_per_epoch} tokens (end-of-document ids included), fewer than one sample of "
                f"seq_length + 1 = {seq_length + 1}; use more data, a larger share in split, or a shorter seq_length."
            )
        epoch_samples = samples_starting_before(self.tokens_per_epoch, seq_length)
        wanted = epoch_samples if num_samples is None else num_samples
        self.epochs = epochs_for(wanted, tokens_per_epoch=self.tokens_per_epoch, seq_length=seq_length)
        key = {"kind": "gpt-samples", "documents": documents_entry, "seq_length": seq_length, "epochs": self.epochs,
               "seed": seed}

        def build() -> dict[str, np.ndarray]:
            # read, not mapped: the builder's long-lived mapping of the lengths then holds no page of them
            lengths = np.load(documents_cache.directory / "lengths.npy")
            index = build_sample_index(lengths, seq_length=seq_length, epochs=self.epochs, seed=seed)
            return {"document_order": index.document_order, "sample_document": index.sample_document,
                    "sample_offset": index.sample_offset, "shuffle": index.shuffle}

        epochs = f"{self.epochs} data epoch{'s' if self.epochs > 1 else ''}"
        cached = load_or_build(cache_dir, key, build, ranks=ranks, what=f"{name} samples ({epochs})")
        self.cache = cached
        arrays = cached.arrays
        self._document_order, self._shuffle = arrays["document_order"], arrays["shuffle"]
        self._sample_document, self._sample_offset = arrays["sample_document"], arrays["sample_offset"]
        self._starts, self._stored, self._lengths = split["starts"], split["stored"], split["lengths"]
        bin_path = data_file(dataset.prefix)
        self._tokens = FileArray(bin_path, dataset.dtype, 0, bin_path.stat().st_size // dataset.dtype.itemsize)
        self._length = wanted

    def __len__(self) -> int:
        return self._length

    def window(self, index: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of sample ``index`` (int64), end-of-document ids in place."""
        if not 0 <= index < self._length:
            raise IndexError(f"sample {index} out of range for {self._length} samples of {self.name}")
        sample = int(self._shuffle[index])
        position, offset = int(self._sample_document[sample]), int(self._sample_offset[sample])
        out = np.empty(self.seq_length + 1, dtype=np.int64)
        filled = 0
        while filled < len(out):
            document = int(self._document_order[position])
            start, length = int(self._starts[document]), int(self._lengths[document])
            take = min(length - offset, len(out) - filled)
            stored = max(0, min(offset + take, int(self._stored[document])) - offset)  # the rest is the added eos
            out[filled : filled + stored] = self._tokens[start + offset : start + offset + stored]
            out[filled + stored : filled + take] = self.eos_id
            filled += take
            position, offset = position + 1, 0
        return out

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.window(index)
        if self.vocab_size is not None and window.max() >= self.vocab_size:
            raise ValueError(
                f"Sample {index} of {self.name} ({self.dataset.prefix}) holds token id {window.max()} but the tokenizer "
                f"has only {self.vocab_size} ids; the data was made with another tokenizer: pass that one as tokenizer=."
            )
        return document_masked_sample(window, self.eos_id, self.masks)


def document_masked_sample(window: np.ndarray, eos_id: int, masks: DocumentMasks) -> dict[str, torch.Tensor]:
    """``input_ids``/``labels`` from a window of ``seq_length + 1`` tokens, with the masks asked for."""
    inputs, labels = window[:-1], window[1:].copy()
    sample = {"input_ids": torch.from_numpy(inputs.copy())}
    if masks.eod_mask_loss:
        labels[inputs == eos_id] = IGNORE_INDEX
    sample["labels"] = torch.from_numpy(labels)
    if masks.reset_position_ids or masks.reset_attention_mask:
        # a token's document: the end-of-document tokens before it (exclusive: an eos ends its own document)
        ends = (inputs == eos_id).astype(np.int64)
        document_ids = np.concatenate([[0], np.cumsum(ends)[:-1]])
        if masks.reset_position_ids:
            first = np.flatnonzero(np.diff(document_ids, prepend=-1))  # where each document starts
            sample["position_ids"] = torch.from_numpy(np.arange(len(inputs)) - np.repeat(first, np.diff(
                np.append(first, len(inputs)))))
        if masks.reset_attention_mask:
            sample["document_ids"] = torch.from_numpy(document_ids)
    return sample
