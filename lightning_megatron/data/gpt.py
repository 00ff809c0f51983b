"""GPT pre-training data: documents packed into fixed-length samples, split over dp ranks."""

from __future__ import annotations

from collections.abc import Sequence

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_megatron.data.corpus import ByteTokenizer, load_stdlib_token_documents


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


class GPTDataModule(L.LightningDataModule):
    """Next-token prediction on the Python standard library's source, byte-tokenised.

    Args:
        seq_length: tokens per sample.
        global_batch_size: samples per optimizer step summed over all data-parallel ranks;
            each rank loads ``global_batch_size // data_parallel_size`` of them.
        val_fraction: share of documents (files) held out for validation; at least one.
        max_files: use only the first ``max_files`` stdlib files (all when ``None``).
        seed: seed of the document split and of the training sample order.
        num_workers: DataLoader worker processes.

    Example::

        trainer.fit(model, datamodule=GPTDataModule(seq_length=256, global_batch_size=32))

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
    ) -> None:
        super().__init__()
        self.seq_length = seq_length
        self.global_batch_size = global_batch_size
        self.val_fraction = val_fraction
        self.max_files = max_files
        self.seed = seed
        self.num_workers = num_workers
        self.tokenizer = ByteTokenizer()
        self.train_dataset: PackedTokenDataset | None = None
        self.val_dataset: PackedTokenDataset | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def data_parallel_size(self) -> int:
        return self._data_parallel()[0]

    @property
    def data_parallel_rank(self) -> int:
        return self._data_parallel()[1]

    @property
    def micro_batch_size(self) -> int:
        """Samples per DataLoader batch on this rank: the global batch split over dp.

        The strategy may cut this batch further into pipeline micro-batches.
        """
        dp_size = self.data_parallel_size
        if self.global_batch_size % dp_size:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not divisible by the data-parallel size {dp_size}; "
                f"choose a global_batch_size that is a multiple of {dp_size}."
            )
        return self.global_batch_size // dp_size

    def _data_parallel(self) -> tuple[int, int]:
        """(dp size, dp rank) from the attached trainer's strategy; (1, 0) without one."""
        kwargs = getattr(getattr(self.trainer, "strategy", None), "distributed_sampler_kwargs", None)
        if kwargs is None:
            return 1, 0
        return kwargs["num_replicas"], kwargs["rank"]

    def setup(self, stage: str | None = None) -> None:
        """Tokenise the corpus once and split it by document, so no file is in both splits."""
        self.micro_batch_size  # fail fast on a global batch that does not divide over dp
        if self.train_dataset is not None:
            return
        documents = load_stdlib_token_documents(self.max_files)
        order = np.random.default_rng(self.seed).permutation(len(documents))
        documents = [documents[i] for i in order]
        num_val = max(1, round(self.val_fraction * len(documents)))
        self.train_dataset = self._dataset(documents[:-num_val], "train", self.global_batch_size)
        self.val_dataset = self._dataset(documents[-num_val:], "validation", self.data_parallel_size)

    def _dataset(self, documents: list[np.ndarray], split: str, min_samples: int) -> PackedTokenDataset:
        dataset = PackedTokenDataset(documents, eos_id=self.tokenizer.eos_id, seq_length=self.seq_length)
        if len(dataset) < min_samples:
            raise ValueError(
                f"The {split} split has {len(dataset)} samples of {self.seq_length + 1} tokens but needs at least "
                f"{min_samples}; use more files (max_files={self.max_files}), a shorter seq_length, a smaller "
                f"global_batch_size, or another val_fraction ({self.val_fraction})."
            )
        return dataset

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, train=False)

    def _loader(self, dataset: PackedTokenDataset | None, *, train: bool) -> DataLoader:
        """Training shuffles and drops a last partial global batch; validation keeps its order."""
        if dataset is None:
            raise RuntimeError("GPTDataModule.setup() must run before its dataloaders are requested.")
        sampler = DistributedSampler(
            dataset,
            num_replicas=self.data_parallel_size,
            rank=self.data_parallel_rank,
            shuffle=train,
            seed=self.seed,
            drop_last=True,
        )
        return DataLoader(
            dataset,
            batch_size=self.micro_batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            drop_last=train,
        )
