"""GPT pre-training data: documents packed into fixed-length samples, split over dp ranks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_megatron.data.base import DataParallelDataModule
from lightning_megatron.data.corpus import load_stdlib_token_documents
from lightning_megatron.data.indexed import IndexedDataset, check_dataset_files
from lightning_megatron.data.preprocess import metadata_file, read_metadata
from lightning_megatron.data.tokenizers import Tokenizer, check_vocab_fits, load_tokenizer


class PackedTokenDataset(Dataset):
    """Documents joined into one token stream, each followed by ``eos_id``, cut into samples.

    The stream is cut into non-overlapping windows of ``seq_length + 1`` tokens (the remainder
    is dropped); window ``i`` gives ``input_ids = window[:-1]`` and ``labels = window[1:]``, the
    next token at every position, as Hugging Face causal-LM batches look. A label of -100 would
    mark a position the loss ignores; packing leaves none, so every label is a real token.

    Example::

        >>> ds = PackedTokenDataset([np.array([1, 2]), np.array([3])], eos_id=9, seq_length=2)
        >>> ds[0]["input_ids"].tolist(), ds[0]["labels"].tolist()
        ([1, 2], [2, 9])
    """

    def __init__(self, documents: Sequence[np.ndarray], *, eos_id: int, seq_length: int) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length must be at least 1, got {seq_length}")
        eos = np.array([eos_id], dtype=np.min_scalar_type(eos_id))
        pieces = [part for doc in documents for part in (np.asarray(doc), eos)]
        #: The packed token stream, every document followed by eos, before cutting.
        self.tokens = np.concatenate(pieces) if pieces else eos[:0]
        self.seq_length = seq_length

    def __len__(self) -> int:
        return len(self.tokens) // (self.seq_length + 1)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        start = index * (self.seq_length + 1)
        window = torch.from_numpy(self.tokens[start : start + self.seq_length + 1].astype(np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}


class GPTDataModule(DataParallelDataModule):
    """Next-token prediction on a preprocessed indexed dataset, or by default on the Python
    standard library's source, byte-tokenised.

    Args:
        seq_length: tokens per sample.
        global_batch_size: samples per optimizer step summed over all data-parallel ranks;
            each rank loads ``global_batch_size // data_parallel_size`` of them.
        val_fraction: share of documents held out for validation; at least one.
        max_files: use only the first ``max_files`` stdlib files (all when ``None``); built-in
            corpus only.
        seed: seed of the document split and of the training sample order.
        num_workers: DataLoader worker processes.
        data_prefix: a Megatron-LM indexed dataset ``PREFIX.bin``/``PREFIX.idx`` (written by
            ``lightning-megatron preprocess`` or Megatron-LM's tools) instead of the built-in
            corpus. Each document of the dataset is one document here; a trailing
            end-of-document id (``--append-eos``) is dropped because packing adds one. Like the
            built-in corpus, the tokens are read into memory once in ``setup``.
        tokenizer: ``"byte"`` or a ``tokenizer.json``: the tokenizer the data was made with,
            which gives :attr:`vocab_size` and the end-of-document id. By default the one that
            ``preprocess`` recorded in ``PREFIX.meta.json`` (``"byte"`` for the built-in corpus);
            needed for indexed data made by other tools.

    Example::

        trainer.fit(model, datamodule=GPTDataModule(seq_length=256, global_batch_size=32))
        # after `lightning-megatron preprocess --input corpus.jsonl --tokenizer byte --output-prefix data/corpus`
        trainer.fit(model, datamodule=GPTDataModule(data_prefix="data/corpus"))

    ``setup`` checks that every token id of the data is below :attr:`vocab_size` and, when the
    trainer's model has a ``config.vocab_size``, that the tokenizer's vocabulary fits the model.

    Every loader gets a :class:`~torch.utils.data.DistributedSampler` built here, even at
    dp=1, because the global batch of step k must be the same samples whatever the
    data-parallel size: the sampler's permutation depends only on ``seed`` and the epoch, and
    rank r takes every dp-th sample of it, so the dp ranks' batches at step k together are
    exactly the dp=1 batch at step k. Lightning leaves a loader whose sampler is already a
    DistributedSampler alone (and calls its ``set_epoch``), so this order is what runs; left
    to Lightning, dp=1 would get a plain shuffled loader with an unrelated order. The samplers
    drop the tail that does not divide over dp rather than repeat samples, so no validation
    sample is counted twice.
    """

    def __init__(
        self,
        *,
        seq_length: int = 128,
        global_batch_size: int = 16,
        val_fraction: float = 0.02,
        max_files: int | None = None,
        seed: int = 1234,
        num_workers: int = 0,
        data_prefix: str | None = None,
        tokenizer: str | None = None,
    ) -> None:
        super().__init__(global_batch_size=global_batch_size, val_fraction=val_fraction, seed=seed,
                         num_workers=num_workers)
        if data_prefix is not None and max_files is not None:
            raise ValueError(
                f"max_files={max_files} selects files of the built-in corpus and cannot be combined with "
                f"data_prefix={data_prefix!r}; leave max_files unset."
            )
        self.seq_length = seq_length
        self.max_files = max_files
        self.data_prefix = data_prefix
        self.tokenizer = self._load_tokenizer(tokenizer)

    def _load_tokenizer(self, spec: str | None) -> Tokenizer:
        """The tokenizer the data was made with: ``spec``, else the one ``preprocess`` recorded."""
        if self.data_prefix is None:
            if spec not in (None, "byte"):
                raise ValueError(
                    f"The built-in corpus is byte-tokenised; tokenizer={spec!r} needs preprocessed data: run "
                    f"`lightning-megatron preprocess --tokenizer {spec} ...` and pass data_prefix."
                )
            return load_tokenizer("byte")
        check_dataset_files(self.data_prefix, argument="data_prefix")  # before the tokenizer: no files, no advice on it
        metadata = read_metadata(self.data_prefix)
        if spec is None and metadata is None:
            raise ValueError(
                f"data_prefix={self.data_prefix!r} has no {metadata_file(self.data_prefix).name} naming its tokenizer "
                f"(it was not written by `lightning-megatron preprocess`); pass tokenizer='byte' or the path of the "
                f"tokenizer.json the data was made with."
            )
        tokenizer = load_tokenizer(spec if spec is not None else metadata["tokenizer"])
        if metadata is not None and tokenizer.vocab_size != metadata["vocab_size"]:
            raise ValueError(
                f"tokenizer={spec!r} has {tokenizer.vocab_size} ids but data_prefix={self.data_prefix!r} was made with "
                f"{metadata['tokenizer']!r} ({metadata['vocab_size']} ids); pass that tokenizer or leave tokenizer unset."
            )
        return tokenizer

    @property
    def vocab_size(self) -> int:
        """Ids the data's tokenizer can produce: the least ``vocab_size`` a model for this data needs."""
        return self.tokenizer.vocab_size

    def check_model(self, config) -> None:
        if getattr(config, "vocab_size", None) is not None:
            check_vocab_fits(tokenizer_vocab_size=self.vocab_size, model_vocab_size=config.vocab_size)

    def data_source(self) -> str:
        return f"max_files={self.max_files}" if self.data_prefix is None else f"data_prefix={self.data_prefix!r}"

    def load_documents(self) -> list[np.ndarray]:
        if self.data_prefix is None:
            return load_stdlib_token_documents(self.max_files)
        dataset = IndexedDataset(self.data_prefix)
        eos = self.tokenizer.eos_id
        documents = (dataset.document(i) for i in range(dataset.num_documents))
        return [doc[:-1] if len(doc) and doc[-1] == eos else doc for doc in documents]

    def make_dataset(self, documents: Sequence[np.ndarray], split: str) -> PackedTokenDataset:
        dataset = PackedTokenDataset(documents, eos_id=self.tokenizer.eos_id, seq_length=self.seq_length)
        if len(dataset.tokens) and dataset.tokens.max() >= self.vocab_size:
            raise ValueError(
                f"The {split} split ({self.data_source()}) holds token id {dataset.tokens.max()} but the tokenizer has "
                f"only {self.vocab_size} ids; the data was made with another tokenizer: pass that one as tokenizer=."
            )
        return dataset
