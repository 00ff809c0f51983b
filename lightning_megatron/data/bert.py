"""BERT pre-training data: ``[CLS] A [SEP] B [SEP]`` samples with masked tokens, split over dp ranks.

The built-in corpus (the Python standard library's source, byte-level tokens) needs four more
ids for BERT's special tokens; they sit just above the byte tokenizer's 257
(:data:`BYTE_SPECIAL_TOKENS`), so ``bert-tiny`` has a vocabulary of 261. A preprocessed
``data_prefix`` brings its own tokenizer, a WordPiece ``tokenizer.json`` (``lightning-megatron
train-tokenizer --model wordpiece``, or one saved by transformers' ``BertTokenizerFast``) whose
``[PAD] [CLS] [SEP] [MASK]`` are the special tokens; its documents are read lazily from the
memory-mapped ``.bin``. Data preprocessed with ``--split-sentences`` stores every sentence as a
sequence of the ``.idx``, and samples are then runs of whole sentences cut between two of them,
as in Megatron-LM's BERT dataset.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_megatron.data.base import DataParallelDataModule
from lightning_megatron.data.corpus import ByteTokenizer, load_stdlib_token_documents
from lightning_megatron.data.indexed import IndexedDataset
from lightning_megatron.data.preprocess import load_dataset_tokenizer, read_metadata
from lightning_megatron.data.tokenizers import Tokenizer

IGNORE_INDEX = -100
LINE_BREAK = ord("\n")  # segments of the byte-level corpus start at a line of code where they can
_SPECIAL_ID_NAMES = ("pad_id", "cls_id", "sep_id", "mask_id")  # of SpecialTokens and of HFTokenizer
_SPECIAL_TOKENS = ("[PAD]", "[CLS]", "[SEP]", "[MASK]")


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of BERT's special tokens in a vocabulary of ``vocab_size`` ids.

    Random replacement draws from the ordinary ids: those below ``vocab_size`` that are none
    of the four nor in ``other_special_ids`` ([UNK], an end-of-document id, ...).
    """

    pad_id: int
    cls_id: int
    sep_id: int
    mask_id: int
    vocab_size: int
    other_special_ids: tuple[int, ...] = ()

    def ordinary_ids(self) -> np.ndarray:
        special = [self.pad_id, self.cls_id, self.sep_id, self.mask_id, *self.other_special_ids]
        return np.setdiff1d(np.arange(self.vocab_size), special)

    @classmethod
    def of_tokenizer(cls, tokenizer: Tokenizer) -> SpecialTokens:
        """:data:`BYTE_SPECIAL_TOKENS` for the byte tokenizer; else the ids of ``[PAD] [CLS] [SEP] [MASK]`` in a
        Hugging Face tokenizer, whose other special tokens are no ordinary ids."""
        if isinstance(tokenizer, ByteTokenizer):
            return BYTE_SPECIAL_TOKENS
        ids = {name: getattr(tokenizer, name, None) for name in _SPECIAL_ID_NAMES}
        missing = [token for token, i in zip(_SPECIAL_TOKENS, ids.values()) if i is None]
        if missing:
            raise ValueError(
                f"The tokenizer {getattr(tokenizer, 'path', type(tokenizer).__name__)} has no {', '.join(missing)} "
                f"token; BERT's samples need {' '.join(_SPECIAL_TOKENS)}. Preprocess the data with a WordPiece "
                f"tokenizer: `lightning-megatron train-tokenizer --model wordpiece`, or one saved by transformers' "
                f"BertTokenizerFast."
            )
        others = tuple(sorted(set(getattr(tokenizer, "special_ids", ())) - set(ids.values())))
        return cls(**ids, vocab_size=tokenizer.vocab_size, other_special_ids=others)


# Bytes are 0..255 and end-of-document 256 (ByteTokenizer); BERT's specials come next.
BYTE_SPECIAL_TOKENS = SpecialTokens(
    pad_id=ByteTokenizer.vocab_size,
    cls_id=ByteTokenizer.vocab_size + 1,
    sep_id=ByteTokenizer.vocab_size + 2,
    mask_id=ByteTokenizer.vocab_size + 3,
    vocab_size=ByteTokenizer.vocab_size + 4,
    other_special_ids=(ByteTokenizer.eos_id,),
)


class IndexedDocuments(Sequence):
    """The documents ``documents`` of an indexed dataset, each read when indexed, as a view into the
    memory-mapped ``.bin``; their sentences are the dataset's sequences.

    ``drop_last_token`` leaves out every document's last token, the end-of-document id that
    ``preprocess --append-eos`` appended (BERT's samples bring their own [SEP]).
    """

    def __init__(self, dataset: IndexedDataset, documents: range, *, drop_last_token: bool = False) -> None:
        if documents.step != 1 or not 0 <= documents.start <= documents.stop <= dataset.num_documents:
            raise ValueError(f"documents={documents} is not a contiguous range of the {dataset.num_documents} "
                             f"documents of {dataset.prefix}.")
        self.dataset, self.documents, self.drop_last_token = dataset, documents, drop_last_token
        first = dataset.document_indices[documents.start : documents.stop + 1]
        #: Per document, the index of its first sentence in :attr:`sentence_lengths` (and the end, last).
        self.first_sentence: np.ndarray = first - first[0]
        #: Tokens per sentence of these documents (a view into the memory-mapped .idx).
        self.sentence_lengths: np.ndarray = dataset.sequence_lengths[first[0] : first[-1]]

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, index: int) -> np.ndarray:
        document = self.dataset.document(self.documents[index])
        return document[:-1] if self.drop_last_token and len(document) else document


Documents = Union[Sequence[np.ndarray], IndexedDocuments]


def sentence_windows(sentence_lengths: np.ndarray, first_sentence: np.ndarray, span: int) -> np.ndarray:
    """``[num_windows, 3]`` (document, start, length): every document's sentences, in order, packed greedily into
    windows of at most ``span`` tokens, computed from the lengths alone.

    A window holds whole sentences, as many as fit; a sentence longer than ``span`` is first cut
    into pieces of ``span`` tokens (the last shorter), which are packed as sentences are, so
    every token is in exactly one window. Windows of one token are left out (no two segments).
    With one sentence per document this is every document cut into ``span``-token windows.

    The packing is vectorised over the documents: each step cuts the next window of every
    document at once (a binary search in the running token count), so the steps are as many as
    the most windows of one document, not as many as all the windows.

    Example::

        >>> sentence_windows(np.array([3, 4, 2, 9]), np.array([0, 3, 4]), span=8).tolist()
        [[0, 0, 7], [0, 7, 2], [1, 0, 8]]
    """
    lengths = np.asarray(sentence_lengths, dtype=np.int64)
    pieces = -(-lengths // span)  # per sentence; 0 for an empty one
    piece_sentence = np.repeat(np.arange(len(lengths)), pieces)
    first_piece = np.concatenate([[0], np.cumsum(pieces)])
    within = np.arange(first_piece[-1]) - first_piece[piece_sentence]  # each piece's number in its sentence
    piece_lengths = np.minimum(span, lengths[piece_sentence] - within * span)
    offsets = np.concatenate([[0], np.cumsum(piece_lengths)])  # token offset where each piece starts
    document_first, document_end = first_piece[first_sentence[:-1]], first_piece[first_sentence[1:]]
    documents = np.flatnonzero(document_end > document_first)
    starts, ends = document_first[documents], document_end[documents]
    found = []  # (document, first piece, end piece) of each window
    while len(documents):
        cut = np.minimum(np.searchsorted(offsets, offsets[starts] + span, side="right") - 1, ends)
        found.append((documents, starts, cut))
        going = cut < ends
        documents, starts, ends = documents[going], cut[going], ends[going]
    if not found:
        return np.empty((0, 3), dtype=np.int64)
    document, start, end = (np.concatenate(column) for column in zip(*found))
    order = np.argsort(start, kind="stable")  # pieces are numbered in document order
    document, start, end = document[order], start[order], end[order]
    windows = np.stack([document, offsets[start] - offsets[document_first[document]], offsets[end] - offsets[start]],
                       axis=1)
    return windows[windows[:, 2] >= 2]


class BERTPretrainingDataset(Dataset):
    """Masked-LM samples cut from documents, each the same on every rank and at every layout.

    Every document is cut into windows of at most ``seq_length - 3`` tokens (see
    :func:`sentence_windows`): runs of whole sentences when ``documents`` are the sentences of
    an indexed dataset (:class:`IndexedDocuments`; a document of one sequence is one
    sentence), else windows of exactly that length, a document's shorter last window kept.
    Window ``i`` becomes sample ``i``: it is split in two segments, between two sentences where
    it holds more than one (Megatron-LM's A and B), else after a line break (``line_break_id``,
    byte-level data) where there is one, else anywhere; with ``sentence_order=True`` the
    segments are swapped with probability 1/2 (``sentence_order_label`` 1; ALBERT's and
    Megatron-LM's sentence-order prediction). Of the segments' tokens, ``round(mask_probability
    * n)`` (at least one) are chosen as in the original BERT: 80% become [MASK], 10% a random
    ordinary token (:meth:`SpecialTokens.ordinary_ids`), 10% stay; ``labels`` holds their
    original ids and -100 everywhere else.

    All randomness of sample ``i`` comes from a generator seeded by ``(seed, i)``, so a sample
    is cut and masked identically on every rank, at every parallel layout and in every epoch.
    The window index is built from the documents' lengths only; tokens are read per sample.

    Example::

        >>> ds = BERTPretrainingDataset([np.arange(20, dtype=np.uint16)], seq_length=12, seed=0)
        >>> sample = ds[0]
        >>> sample["input_ids"].shape, int(sample["attention_mask"].sum()), int((sample["labels"] != -100).sum())
        (torch.Size([12]), 12, 1)
    """

    def __init__(
        self,
        documents: Documents,
        *,
        seq_length: int,
        seed: int,
        mask_probability: float = 0.15,
        sentence_order: bool = True,
        special_tokens: SpecialTokens = BYTE_SPECIAL_TOKENS,
        line_break_id: int | None = LINE_BREAK,
    ) -> None:
        if seq_length < 5:
            raise ValueError(f"seq_length={seq_length} is too short: [CLS] A [SEP] B [SEP] needs at least 5 tokens.")
        if not 0.0 < mask_probability < 1.0:
            raise ValueError(f"mask_probability must be in (0, 1), got {mask_probability}.")
        self.documents = documents
        self.seq_length, self.seed = seq_length, seed
        self.mask_probability, self.sentence_order = mask_probability, sentence_order
        self.special_tokens, self.line_break_id = special_tokens, line_break_id
        self._ordinary_ids = special_tokens.ordinary_ids()
        if isinstance(documents, IndexedDocuments):
            self._first_sentence, self._sentence_lengths = documents.first_sentence, documents.sentence_lengths
            lengths = np.array(self._sentence_lengths, dtype=np.int64)
            if documents.drop_last_token:  # the end-of-document id ends each document's last sentence
                last = self._first_sentence[1:][np.diff(self._first_sentence) > 0] - 1
                lengths[last] -= 1
        else:  # one sentence per document
            lengths = np.fromiter(map(len, documents), dtype=np.int64, count=len(documents))
            self._first_sentence, self._sentence_lengths = np.arange(len(documents) + 1), lengths
        #: ``[num_samples, 3]``: (document, start, length) of each sample's tokens.
        self.windows = sentence_windows(lengths, self._first_sentence, seq_length - 3)

    def __len__(self) -> int:
        return len(self.windows)

    def sentence_starts(self, index: int) -> np.ndarray:
        """Offsets inside sample ``index``'s window (between its first and last token) where a sentence starts."""
        document, start, length = (int(x) for x in self.windows[index])
        first, end = self._first_sentence[document], self._first_sentence[document + 1]
        starts = np.cumsum(self._sentence_lengths[first:end], dtype=np.int64) - start
        return starts[(starts > 0) & (starts < length)]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        document, start, length = self.windows[index]
        tokens = np.asarray(self.documents[document][start : start + length], dtype=np.int64)
        special = self.special_tokens
        if tokens.max() >= special.vocab_size:
            raise ValueError(f"Sample {index} holds token id {tokens.max()}, but the tokenizer has {special.vocab_size} "
                             f"ids: the data was made with another tokenizer; pass that one as tokenizer=.")
        rng = np.random.default_rng((self.seed, index))
        cut = self._cut(index, tokens, rng)
        first, second = tokens[:cut], tokens[cut:]
        swapped = self.sentence_order and bool(rng.random() < 0.5)
        if swapped:
            first, second = second, first

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

    def _cut(self, index: int, tokens: np.ndarray, rng: np.random.Generator) -> int:
        """Where segment B starts: at a sentence start inside the window, else after a line break, else anywhere."""
        candidates = self.sentence_starts(index)
        if not len(candidates) and self.line_break_id is not None:
            candidates = np.flatnonzero(tokens[:-1] == self.line_break_id) + 1
        if len(candidates):
            return int(rng.choice(candidates))
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
        input_ids[replaced] = self._ordinary_ids[rng.integers(0, len(self._ordinary_ids), size=len(replaced))]
        return input_ids, labels


class BERTDataModule(DataParallelDataModule):
    """Masked-LM (and sentence-order) pre-training on a preprocessed indexed dataset, or by default on
    the Python standard library's source, byte-tokenised.

    Args:
        seq_length: tokens per sample, [CLS] and [SEP]s included; shorter samples are padded.
        global_batch_size: samples per optimizer step summed over all data-parallel ranks;
            each rank loads ``global_batch_size // data_parallel_size`` of them.
        split: Megatron-LM's train, validation and test weights of the documents (files), as
            contiguous document ranges (see :func:`~lightning_megatron.data.splits.split_document_ranges`).
        max_files: use only the first ``max_files`` stdlib files (all when ``None``); built-in
            corpus only.
        seed: seed of the document split, the training sample order and every sample's masking.
        num_workers: DataLoader worker processes.
        mask_probability: share of each sample's tokens the model must predict (BERT: 0.15).
        sentence_order: swap the two segments of half the samples and label them, for the
            model's sentence-order head (``BERTConfig.binary_head``).
        data_prefix: a Megatron-LM indexed dataset ``PREFIX.bin``/``PREFIX.idx`` (written by
            ``lightning-megatron preprocess``, best with ``--split-sentences``, or by Megatron-LM's
            tools) instead of the built-in corpus. Documents are read per sample from the
            memory-mapped ``.bin``; a document's sentences are its sequences in the ``.idx``.
        tokenizer: ``"byte"`` or a ``tokenizer.json``: the tokenizer the data was made with; by
            default the one ``preprocess`` recorded in ``PREFIX.meta.json``. Its ``[PAD] [CLS]
            [SEP] [MASK]`` are the special tokens (a WordPiece tokenizer's: ``train-tokenizer
            --model wordpiece``, or one saved by transformers' ``BertTokenizerFast``); byte data
            gets :data:`BYTE_SPECIAL_TOKENS`.

    Example::

        trainer.fit(BERT("bert-tiny"), datamodule=BERTDataModule(seq_length=128, global_batch_size=16))
        # after `lightning-megatron preprocess --input wiki.jsonl --tokenizer bert.json --split-sentences
        #        --output-prefix data/wiki`
        datamodule = BERTDataModule(data_prefix="data/wiki")
        trainer.fit(BERT(BERTConfig(vocab_size=datamodule.vocab_size)), datamodule=datamodule)

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
        split: str = "969,30,1",
        max_files: int | None = None,
        seed: int = 1234,
        num_workers: int = 0,
        mask_probability: float = 0.15,
        sentence_order: bool = True,
        data_prefix: str | None = None,
        tokenizer: str | None = None,
    ) -> None:
        super().__init__(global_batch_size=global_batch_size, split=split, seed=seed, num_workers=num_workers)
        self.check_data_choice(max_files=max_files, data_prefix=data_prefix, tokenizer=tokenizer,
                               preprocess_hint=" --split-sentences")
        self.seq_length = seq_length
        self.max_files = max_files
        self.mask_probability = mask_probability
        self.sentence_order = sentence_order
        self.data_prefix = data_prefix
        # every rank checks the files and the tokenizer alike, here, before the Trainer exists
        self.tokenizer: Tokenizer = (load_dataset_tokenizer(data_prefix, tokenizer) if data_prefix is not None
                                     else ByteTokenizer())
        self.special_tokens = SpecialTokens.of_tokenizer(self.tokenizer)
        metadata = read_metadata(data_prefix) if data_prefix is not None else None
        self._drop_eos = bool(metadata and metadata.get("append_eos"))

    @property
    def vocab_size(self) -> int:
        """Ids the samples can hold (the tokenizer's, and for byte data BERT's specials above them): the least
        ``vocab_size`` a model needs."""
        return self.special_tokens.vocab_size

    def open_corpus(self) -> int:
        if self.data_prefix is None:
            self._documents = load_stdlib_token_documents(self.max_files)
            return len(self._documents)
        self._corpus = IndexedDataset(self.data_prefix)
        return self._corpus.num_documents

    def data_source(self) -> str:
        return f"max_files={self.max_files}" if self.data_prefix is None else f"data_prefix={self.data_prefix!r}"

    def check_model(self, config) -> None:
        """The trainer's model must take these samples: the ids, the length, the sentence-order labels."""
        if getattr(config, "vocab_size", self.vocab_size) < self.vocab_size:
            what = ("the byte corpus with BERT's special tokens" if isinstance(self.tokenizer, ByteTokenizer)
                    else f"the tokenizer {getattr(self.tokenizer, 'path', '')}")
            raise ValueError(
                f"The model's vocab_size={config.vocab_size} is smaller than the {self.vocab_size} ids of {what}; use "
                f"a model with vocab_size >= {self.vocab_size} (e.g. BERTConfig(vocab_size=datamodule.vocab_size))."
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

    def make_dataset(self, split: str, documents: range, num_samples: int | None) -> BERTPretrainingDataset:
        if self.data_prefix is None:
            selected: Documents = [self._documents[i] for i in documents]
        else:
            selected = IndexedDocuments(self._corpus, documents, drop_last_token=self._drop_eos)
        return BERTPretrainingDataset(
            selected,
            seq_length=self.seq_length,
            seed=self.seed,
            mask_probability=self.mask_probability,
            sentence_order=self.sentence_order,
            special_tokens=self.special_tokens,
            line_break_id=LINE_BREAK if isinstance(self.tokenizer, ByteTokenizer) else None,
        )
