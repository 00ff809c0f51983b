"""What every data module of the package shares: global batches split over dp ranks only.

Each loader gets its own ``DistributedSampler`` over the data-parallel ranks (tensor- and
pipeline-parallel ranks of one replica load the same samples), built by the data module
itself, even at dp=1: the samples of global batch k are then the same set whatever the
data-parallel size, and Lightning leaves a DataLoader whose sampler is already a
``DistributedSampler`` alone. Documents are split into train, validation and test by
contiguous document ranges from Megatron-LM's ``split`` string (``data/splits.py``), so no
document is in two splits and the split does not depend on the layout. Training resumes
mid-epoch without repeating or skipping samples (``data/resumable.py``).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from lightning_megatron.data.resumable import ResumableDataLoader, data_parallel_sampler
from lightning_megatron.data.splits import enlarged_split, parse_split, split_document_ranges
from lightning_megatron.data.tokenizers import check_vocab_fits

#: The Lightning stage of each split's loader, for messages.
_LOADER_OF_SPLIT = {"train": "train_dataloader", "validation": "val_dataloader", "test": "test_dataloader"}


class DataParallelDataModule(L.LightningDataModule):
    """Subclasses open their corpus (``open_corpus``), build a split's dataset over a document
    range (``make_dataset``) and may check the model (``check_model``); splitting, batching and
    sampling live here.

    A dataset whose ``shuffles_samples`` attribute is true orders its samples itself (the GPT
    dataset shuffles per data epoch, over all the samples the run needs); its sampler then only
    splits the order over dp. Otherwise the training sampler shuffles per epoch.
    """

    def __init__(self, *, global_batch_size: int, split: str, seed: int, num_workers: int) -> None:
        super().__init__()
        parse_split(split)  # a malformed split fails when the module is made, not in setup
        self.global_batch_size = global_batch_size
        self.split = split
        self.seed = seed
        self.num_workers = num_workers
        self.train_dataset: Optional[Dataset] = None
        self.val_dataset: Optional[Dataset] = None
        self.test_dataset: Optional[Dataset] = None

    # ------------------------------------------------------------------ subclass hooks
    def open_corpus(self) -> int | list[int]:
        """Open (or build) the corpus once; return its number of documents (a list: one per blended corpus)."""
        raise NotImplementedError

    def make_dataset(self, split: str, documents: range | list[range], num_samples: Optional[int]) -> Dataset:
        """The dataset of ``split`` over the corpus documents ``documents`` (a list of ranges: one per blended
        corpus). ``num_samples``: the samples the run will draw from it (training under ``max_steps``), or
        ``None`` for one pass over its data."""
        raise NotImplementedError

    def check_model(self, config: Any) -> None:
        """Raise if the trainer's model (its ``config``) cannot take these samples."""

    def data_source(self) -> str:
        """How the user chose the data, for error messages."""
        return "the data"

    @staticmethod
    def check_data_choice(*, max_files: Optional[int], data_prefix: Any, tokenizer: Optional[str],
                          preprocess_hint: str = "") -> None:
        """The built-in corpus (``max_files``, byte tokens) and preprocessed data (``data_prefix``, its tokenizer)
        are two choices; refuse a mix of them."""
        if data_prefix is not None and max_files is not None:
            raise ValueError(
                f"max_files={max_files} selects files of the built-in corpus and cannot be combined with "
                f"data_prefix={data_prefix!r}; leave max_files unset."
            )
        if data_prefix is None and tokenizer not in (None, "byte"):
            raise ValueError(
                f"The built-in corpus is byte-tokenised; tokenizer={tokenizer!r} needs preprocessed data: run "
                f"`lightning-megatron preprocess --tokenizer {tokenizer}{preprocess_hint} ...` and pass data_prefix."
            )

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

    @property
    def train_samples(self) -> Optional[int]:
        """Samples the run trains on, as Megatron-LM's ``train_samples``: ``max_steps * global_batch_size``
        (gradient accumulation multiplies it), or ``None`` when the run counts epochs instead."""
        max_steps = getattr(self.trainer, "max_steps", None)
        if max_steps is None or max_steps < 0:
            return None
        return max_steps * self.global_batch_size * getattr(self.trainer, "accumulate_grad_batches", 1)

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: Optional[str] = None) -> None:
        """Open the corpus once and cut it into the splits' document ranges."""
        self.per_rank_batch_size  # fail fast on a global batch that does not divide over dp
        config = getattr(getattr(self.trainer, "lightning_module", None), "config", None)
        if config is not None:
            self.check_model(config)
        if self.train_dataset is not None or stage == "predict":  # predicting reads prompts, not the corpus
            return
        counts = self.open_corpus()
        blended = isinstance(counts, list)
        per_corpus = [split_document_ranges(self.split, count) for count in (counts if blended else [counts])]
        for count, ranges in zip(counts if blended else [counts], per_corpus):
            if not ranges["train"]:
                raise ValueError(f"split={self.split!r} leaves no document for training out of {count}; "
                                 f"use more data ({self.data_source()}) or a larger train weight.")

        def documents(split: str) -> range | list[range]:
            return [ranges[split] for ranges in per_corpus] if blended else per_corpus[0][split]

        self.train_dataset = self._checked_dataset("train", documents("train"), self.train_samples,
                                                   self.global_batch_size)
        self.val_dataset = self._checked_dataset("validation", documents("validation"), None, self.data_parallel_size)
        self.test_dataset = self._checked_dataset("test", documents("test"), None, self.data_parallel_size)

    def _checked_dataset(self, split: str, documents: range | list[range], num_samples: Optional[int],
                         min_samples: int) -> Optional[Dataset]:
        ranges = documents if isinstance(documents, list) else [documents]
        if split != "train" and not any(ranges):
            return None  # a split weighted 0: no loader for it
        dataset = self.make_dataset(split, documents, num_samples)
        if len(dataset) < min_samples:
            # samples grow with documents: a share that many times larger (a guess, doubled, when it has none)
            factor = math.ceil(1.25 * min_samples / len(dataset)) if len(dataset) else 2 * min_samples
            raise ValueError(
                f"The {split} split ({sum(map(len, ranges))} documents) has {len(dataset)} samples but needs at least "
                f"{min_samples}; use more data ({self.data_source()}), a shorter seq_length, a smaller "
                f"global_batch_size, or give it a larger share than split={self.split!r} does, e.g. "
                f"split={enlarged_split(self.split, split, factor)!r}."
            )
        return dataset

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset, "train")

    def val_dataloader(self) -> DataLoader | list:
        return self._loader(self.val_dataset, "validation")

    def test_dataloader(self) -> DataLoader | list:
        return self._loader(self.test_dataset, "test")

    def _held_out_batch_size(self, dataset: Dataset, split: str) -> int:
        """The per-rank batch of a validation or test loader: the training one, or less when the split holds
        fewer than one global batch (a whole multiple of the pipeline micro-batch), so that it is evaluated at
        all; said once, since the drop-last loader would otherwise run no batch and silently skip validation
        (and ModelCheckpoint/EarlyStopping on its metrics)."""
        per_rank = self.per_rank_batch_size
        available = len(dataset) // self.data_parallel_size
        if available >= per_rank:
            return per_rank
        micro = getattr(getattr(self.trainer, "strategy", None), "micro_batch_size", 1)
        size = max(micro, available - available % micro)
        rank_zero_warn(
            f"The {split} split has {len(dataset)} samples, fewer than one global batch ({self.global_batch_size}); "
            f"its loader uses batches of {size * self.data_parallel_size} ({size} per data-parallel rank) instead. "
            f"Give it a larger share than split={self.split!r} does (e.g. split="
            f"{enlarged_split(self.split, split, math.ceil(self.global_batch_size / max(len(dataset), 1)))!r}) for "
            f"evaluations as precise as training batches."
        )
        return size

    def _loader(self, dataset: Optional[Dataset], split: str) -> DataLoader | list:
        """Training is ordered by the dataset or shuffled per epoch; validation and test keep their order.
        All drop a last partial batch: every batch then splits into the same pipeline micro-batches, and every
        layout evaluates the same samples. A split weighted 0 in ``split`` has no loader."""
        if dataset is None:
            if split != "train" and self.train_dataset is not None:
                return []
            raise RuntimeError(f"{type(self).__name__}.setup() must run before {_LOADER_OF_SPLIT[split]}().")
        train = split == "train"
        overfit = bool(getattr(self.trainer, "overfit_batches", 0))  # Lightning wants an ordered loader then
        sampler = data_parallel_sampler(
            dataset,
            num_replicas=self.data_parallel_size,
            rank=self.data_parallel_rank,
            shuffle=train and not overfit and not getattr(dataset, "shuffles_samples", False),
            seed=self.seed,
        )
        batch_size = self.per_rank_batch_size if train else self._held_out_batch_size(dataset, split)
        return ResumableDataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=self.num_workers,
                                   drop_last=True)


class TokenDataModule(DataParallelDataModule):
    """A data module of token samples for a decoder (GPT pretraining and SFT data): ``self.tokenizer`` gives the
    vocabulary, ``self.seq_length`` the sample length, and the model is checked against both."""

    tokenizer: Any
    seq_length: int

    @property
    def vocab_size(self) -> int:
        """Ids the data's tokenizer can produce: the least ``vocab_size`` a model for this data needs."""
        return self.tokenizer.vocab_size

    def check_model(self, config: Any) -> None:
        """Raise if the model's ``config`` cannot take samples of ``seq_length`` ids below ``vocab_size``."""
        if getattr(config, "vocab_size", None) is not None:
            check_vocab_fits(tokenizer_vocab_size=self.vocab_size, model_vocab_size=config.vocab_size)
        if getattr(config, "max_seq_length", self.seq_length) < self.seq_length:
            raise ValueError(f"seq_length={self.seq_length} exceeds the model's max_seq_length="
                             f"{config.max_seq_length}; use a shorter seq_length or a model with a longer context.")
