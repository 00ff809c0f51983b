"""What every data module of the package shares: global batches split over dp ranks only.

Each loader gets its own ``DistributedSampler`` over the data-parallel ranks (tensor- and
pipeline-parallel ranks of one replica load the same samples), built by the data module
itself, even at dp=1: the samples of global batch k are then the same set whatever the
data-parallel size, and Lightning leaves a DataLoader whose sampler is already a
``DistributedSampler`` alone. Documents are split into train, validation and test by a
seeded shuffle, so no document is in two splits and the split does not depend on the layout.
Training resumes mid-epoch without repeating or skipping samples (``data/resumable.py``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import lightning as L
import numpy as np
from torch.utils.data import DataLoader, Dataset

from lightning_megatron.data.resumable import ResumableDataLoader, ResumableDistributedSampler


class DataParallelDataModule(L.LightningDataModule):
    """Subclasses load documents (``load_documents``), build a split's dataset (``make_dataset``)
    and may check the model (``check_model``); batching and sampling live here."""

    def __init__(self, *, global_batch_size: int, val_fraction: float, seed: int, num_workers: int) -> None:
        super().__init__()
        self.global_batch_size = global_batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.train_dataset: Optional[Dataset] = None
        self.val_dataset: Optional[Dataset] = None
        self.test_dataset: Optional[Dataset] = None

    # ------------------------------------------------------------------ subclass hooks
    def load_documents(self) -> list[np.ndarray]:
        raise NotImplementedError

    def make_dataset(self, documents: Sequence[np.ndarray], split: str) -> Dataset:
        raise NotImplementedError

    def check_model(self, config: Any) -> None:
        """Raise if the trainer's model (its ``config``) cannot take these samples."""

    def data_source(self) -> str:
        """How the user chose the data, for error messages."""
        return "the data"

    # ------------------------------------------------------------------ layout
    @property
    def data_parallel_size(self) -> int:
        return self._data_parallel()[0]

    @property
    def data_parallel_rank(self) -> int:
        return self._data_parallel()[1]

    def _data_parallel(self) -> tuple[int, int]:
        """(dp size, dp rank) from the attached trainer's strategy; (1, 0) without one."""
        kwargs = getattr(getattr(self.trainer, "strategy", None), "distributed_sampler_kwargs", None)
        if kwargs is None:
            return 1, 0
        return kwargs["num_replicas"], kwargs["rank"]

    @property
    def per_rank_batch_size(self) -> int:
        """Samples per DataLoader batch on this rank: the global batch split over dp.

        The strategy may cut this batch further into pipeline micro-batches (Megatron's "micro
        batch"), hence not that name.
        """
        dp_size = self.data_parallel_size
        if self.global_batch_size % dp_size:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not divisible by the data-parallel size {dp_size}; "
                f"choose a global_batch_size that is a multiple of {dp_size}."
            )
        return self.global_batch_size // dp_size

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: Optional[str] = None) -> None:
        """Load the documents once and split them by document."""
        self.per_rank_batch_size  # fail fast on a global batch that does not divide over dp
        config = getattr(getattr(self.trainer, "lightning_module", None), "config", None)
        if config is not None:
            self.check_model(config)
        if self.train_dataset is not None:
            return
        documents = self.load_documents()
        order = np.random.default_rng(self.seed).permutation(len(documents))
        documents = [documents[i] for i in order]
        held_out = max(1, round(self.val_fraction * len(documents)))  # documents for validation, and for test
        self.train_dataset = self._checked_dataset(documents[: -2 * held_out], "train", self.global_batch_size)
        self.val_dataset = self._checked_dataset(documents[-held_out:], "validation", self.data_parallel_size)
        self.test_dataset = self._checked_dataset(documents[-2 * held_out : -held_out], "test", self.data_parallel_size)

    def _checked_dataset(self, documents: Sequence[np.ndarray], split: str, min_samples: int) -> Dataset:
        dataset = self.make_dataset(documents, split)
        if len(dataset) < min_samples:
            raise ValueError(
                f"The {split} split has {len(dataset)} samples but needs at least {min_samples}; use more data "
                f"({self.data_source()}), a shorter seq_length, a smaller global_batch_size, or another "
                f"val_fraction ({self.val_fraction})."
            )
        return dataset

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_dataset, train=False)

    def _loader(self, dataset: Optional[Dataset], *, train: bool) -> DataLoader:
        """Training shuffles; validation keeps its order. Both drop a last partial batch: every batch then
        splits into the same pipeline micro-batches, and every layout evaluates the same samples."""
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must run before its dataloaders are requested.")
        sampler = ResumableDistributedSampler(
            dataset,
            num_replicas=self.data_parallel_size,
            rank=self.data_parallel_rank,
            shuffle=train,
            seed=self.seed,
            drop_last=True,
        )
        return ResumableDataLoader(
            dataset, batch_size=self.per_rank_batch_size, sampler=sampler, num_workers=self.num_workers, drop_last=True
        )
