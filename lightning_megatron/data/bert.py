"""BERT pre-training data: ``[CLS] A [SEP] B [SEP]`` samples with masked tokens, split over dp ranks.

The built-in corpus (the Python standard library's source, byte-level tokens) needs four more
ids for BERT's special tokens; they sit just above the byte tokenizer's 257
(:data:`BYTE_SPECIAL_TOKENS`), so ``bert-tiny`` has a vocabulary of 261.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_megatron.data.base import DataParallelDataModule
from lightning_megatron.data.corpus import ByteTokenizer, load_stdlib_token_documents

IGNORE_INDEX = -100
LINE_BREAK = ord("\n")  # segments of the byte-level corpus start at a line of code where they can


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of BERT's special tokens; random replacement draws ordinary ids from ``[0, num_ordinary)``."""

    pad_id: int
    cls_id: int
    sep_id: int
    mask_id: int
    num_ordinary: int

    @property
    def vocab_size(self) -> int:
        return max(self.pad_id, self.cls_id, self.sep_id, self.mask_id, self.num_ordinary - 1) + 1


# Bytes are 0..255 and end-of-document 256 (ByteTokenizer); BERT's specials come next.
BYTE_SPECIAL_TOKENS = SpecialTokens(
    pad_id=ByteTokenizer.vocab_size,
    cls_id=ByteTokenizer.vocab_size + 1,
    sep_id=ByteTokenizer.vocab_size + 2,
    mask_id=ByteTokenizer.vocab_size + 3,
    num_ordinary=256,
)


class BERTPretrainingDataset(Dataset):
    """Masked-LM samples cut from documents, each the same on every rank and at every layout.

    Every document is cut into windows of ``seq_length - 3`` tokens (a document's shorter last
    window is kept and padded; windows of one token are dropped). Window ``i`` becomes sample
    ``i``: it is split in two segments, after a line break where there is one, and with
    ``sentence_order=True`` the segments are swapped with probability 1/2
    (``sentence_order_label`` 1; ALBERT's and Megatron-LM's sentence-order prediction). Of the
    segments' tokens, ``round(mask_probability * n)`` (at least one) are chosen as in the
    original BERT: 80% become [MASK], 10% a random ordinary token, 10% stay; ``labels`` holds
    their original ids and -100 everywhere else.

    All randomness of sample ``i`` comes from a generator seeded by ``(seed, i)``, so a sample
    is cut and masked identically on every rank, at every parallel layout and in every epoch.

    Example::

        >>> ds = BERTPretrainingDataset([np.arange(20, dtype=np.uint16)], seq_length=12, seed=0)
        >>> sample = ds[0]
        >>> sample["input_ids"].shape, int(sample["attention_mask"].sum()), int((sample["labels"] != -100).sum())
        (torch.Size([12]), 12, 1)
    """

    def __init__(
        self,
        documents: Sequence[np.ndarray],
        *,
        seq_length: int,
        seed: int,
        mask_probability: float = 0.15,
        sentence_order: bool = True,
        special_tokens: SpecialTokens = BYTE_SPECIAL_TOKENS,
    ) -> None:
        if seq_length < 5:
            raise ValueError(f"seq_length={seq_length} is too short: [CLS] A [SEP] B [SEP] needs at least 5 tokens.")
        if not 0.0 < mask_probability < 1.0:
            raise ValueError(f"mask_probability must be in (0, 1), got {mask_probability}.")
        self.documents = documents
        self.seq_length, self.seed = seq_length, seed
        self.mask_probability, self.sentence_order = mask_probability, sentence_order
        self.special_tokens = special_tokens
        span = seq_length - 3
        #: ``[num_samples, 3]``: (document, start, length) of each sample's tokens.
        self.windows = np.array(
            [(d, start, min(span, len(doc) - start))
             for d, doc in enumerate(documents) for start in range(0, len(doc), span) if len(doc) - start >= 2],
            dtype=np.int64,
        ).reshape(-1, 3)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        document, start, length = self.windows[index]
        tokens = np.asarray(self.documents[document][start : start + length], dtype=np.int64)
        rng = np.random.default_rng((self.seed, index))
        cut = self._cut(tokens, rng)
        first, second = tokens[:cut], tokens[cut:]
        swapped = self.sentence_order and bool(rng.random() < 0.5)
        if swapped:
            first, second = second, first

        special = self.special_tokens
        a_end, real = 1 + len(first), len(tokens) + 3  # a_end: position of the first [SEP]
        ids = np.full(self.seq_length, special.pad_id, dtype=np.int64)
        ids[0], ids[a_end], ids[real - 1] = special.cls_id, special.sep_id, special.sep_id
        ids[1:a_end], ids[a_end + 1 : real - 1] = first, second
        token_type_ids = np.zeros(self.seq_length, dtype=np.int64)
        token_type_ids[a_end + 1 : real] = 1
        segment_positions = np.r_[1:a_end, a_end + 1 : real - 1]
        input_ids, labels = self._mask(ids, segment_positions, rng)

        sample = {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "attention_mask": torch.from_numpy((np.arange(self.seq_length) < real).astype(np.int64)),
            "token_type_ids": torch.from_numpy(token_type_ids),
        }
        if self.sentence_order:
            sample["sentence_order_label"] = torch.tensor(int(swapped))
        return sample

    @staticmethod
    def _cut(tokens: np.ndarray, rng: np.random.Generator) -> int:
        """Where segment B starts: after a line break if the window has one inside, else anywhere."""
        after_line_breaks = np.flatnonzero(tokens[:-1] == LINE_BREAK) + 1
        if len(after_line_breaks):
            return int(rng.choice(after_line_breaks))
        return int(rng.integers(1, len(tokens)))

    def _mask(self, ids: np.ndarray, candidates: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        count = max(1, round(self.mask_probability * len(candidates)))
        positions = rng.choice(candidates, size=count, replace=False)
        labels = np.full_like(ids, IGNORE_INDEX)
        labels[positions] = ids[positions]
        action = rng.random(count)
        input_ids = ids.copy()
        input_ids[positions[action < 0.8]] = self.special_tokens.mask_id
        replaced = positions[(action >= 0.8) & (action < 0.9)]
        input_ids[replaced] = rng.integers(0, self.special_tokens.num_ordinary, size=len(replaced))
        return input_ids, labels


class BERTDataModule(DataParallelDataModule):
    """Masked-LM (and sentence-order) pre-training on the Python standard library's source.

    Args:
        seq_length: tokens per sample, [CLS] and [SEP]s included; shorter samples are padded.
        global_batch_size: samples per optimizer step summed over all data-parallel ranks;
            each rank loads ``global_batch_size // data_parallel_size`` of them.
        val_fraction: share of documents (files) held out for validation; at least one.
        max_files: use only the first ``max_files`` stdlib files (all when ``None``).
        seed: seed of the document split, the training sample order and every sample's masking.
        num_workers: DataLoader worker processes.
        mask_probability: share of each sample's tokens the model must predict (BERT: 0.15).
        sentence_order: swap the two segments of half the samples and label them, for the
            model's sentence-order head (``BERTConfig.binary_head``).

    Example::

        trainer.fit(BERT("bert-tiny"), datamodule=BERTDataModule(seq_length=128, global_batch_size=16))

    As in :class:`~lightning_megatron.data.GPTDataModule`, every loader gets its own
    :class:`~torch.utils.data.DistributedSampler` over the data-parallel ranks only (tensor-parallel
    ranks of one replica load the same samples), so the samples of global batch k do not depend
    on the data-parallel size; with masking seeded per sample, neither do the masks.
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
        mask_probability: float = 0.15,
        sentence_order: bool = True,
    ) -> None:
        super().__init__(global_batch_size=global_batch_size, val_fraction=val_fraction, seed=seed,
                         num_workers=num_workers)
        self.seq_length = seq_length
        self.max_files = max_files
        self.mask_probability = mask_probability
        self.sentence_order = sentence_order
        self.special_tokens = BYTE_SPECIAL_TOKENS

    @property
    def vocab_size(self) -> int:
        """Ids the samples can hold (bytes, end-of-document, BERT's specials): the least a model needs."""
        return self.special_tokens.vocab_size

    def load_documents(self) -> list[np.ndarray]:
        return load_stdlib_token_documents(self.max_files)

    def data_source(self) -> str:
        return f"max_files={self.max_files}"

    def check_model(self, config) -> None:
        """The trainer's model must take these samples: the ids, the length, the sentence-order labels."""
        if getattr(config, "vocab_size", self.vocab_size) < self.vocab_size:
            raise ValueError(
                f"The model's vocab_size={config.vocab_size} is smaller than the {self.vocab_size} ids of the byte "
                f"corpus with BERT's special tokens; use a model with vocab_size >= {self.vocab_size} (e.g. bert-tiny)."
            )
        if getattr(config, "max_seq_length", self.seq_length) < self.seq_length:
            raise ValueError(
                f"seq_length={self.seq_length} exceeds the model's max_seq_length={config.max_seq_length}; "
                f"use a shorter seq_length."
            )
        if getattr(config, "binary_head", False) and not self.sentence_order:
            raise ValueError(
                "The model has a sentence-order head (binary_head=True) but sentence_order=False gives no labels "
                "for it: set sentence_order=True or use a model with binary_head=False."
            )

    def make_dataset(self, documents: Sequence[np.ndarray], split: str) -> BERTPretrainingDataset:
        return BERTPretrainingDataset(
            documents,
            seq_length=self.seq_length,
            seed=self.seed,
            mask_probability=self.mask_probability,
            sentence_order=self.sentence_order,
            special_tokens=self.special_tokens,
        )
