"""Fixed-length SFT samples from tokenised conversations: cut to fit, optionally packed, loss on responses only.

Every sample has ``seq_length`` positions (pipeline parallelism needs one shape for every
micro-batch). As in the GPT dataset a sample is a window of ``seq_length + 1`` tokens:
``input_ids`` are its first ``seq_length``, ``labels`` its last ``seq_length``, so a
conversation of up to ``seq_length + 1`` tokens fits whole. A label is ``-100`` (no loss)
unless its token is a response token; padding (the end-of-sequence id) has no loss either.

**Packing** puts several conversations into one window, greedily in the given (shuffled)
order: a conversation goes into the current window if it fits, else it starts the next. The
sample then carries ``position_ids`` that restart at 0 with every conversation and
``document_ids`` that keep attention within it (the model's per-document masks,
``data/gpt_dataset.py``), so a packed conversation's logits are those it has alone. The
padding after the last one is a document of its own.

**Overlong** conversations (more than ``seq_length + 1`` tokens) are cut (``"truncate"``: the
end goes, the start, with its prompt, stays) or left out (``"drop"``). A cut conversation that
keeps no response token has nothing to learn and is left out too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_megatron.data.conversations import Encoded
from lightning_megatron.data.gpt_dataset import IGNORE_INDEX

OVERLONG = ("truncate", "drop")


class Fitted(NamedTuple):
    """Conversations cut to a window, and how many were cut and how many left out."""

    encoded: list[Encoded]
    truncated: int
    dropped: int


def fit_to_window(encoded: Sequence[Encoded], window: int, overlong: str) -> Fitted:
    """``encoded`` with each conversation longer than ``window`` tokens cut to it (``"truncate"``) or left out
    (``"drop"``); a cut one without a response token left (none but its first token, which is no target) is left
    out as well."""
    if overlong not in OVERLONG:
        raise ValueError(f"overlong={overlong!r} must be one of {OVERLONG}.")
    kept, truncated, dropped = [], 0, 0
    for conversation in encoded:
        if len(conversation.ids) <= window:
            kept.append(conversation)
        elif overlong == "truncate" and any(conversation.trained[1:window]):
            kept.append(Encoded(conversation.ids[:window], conversation.trained[:window]))
            truncated += 1
        else:
            dropped += 1
    return Fitted(kept, truncated, dropped)


def pack(lengths: Sequence[int], window: int) -> list[list[int]]:
    """Indices of the conversations of each window, in order: each goes into the current window if its length
    fits in what is left, else it starts the next (every length is at most ``window``)."""
    windows: list[list[int]] = []
    free = 0
    for index, length in enumerate(lengths):
        if length > free:
            windows.append([])
            free = window
        windows[-1].append(index)
        free -= length
    return windows


class SFTDataset(Dataset):
    """Samples of ``seq_length`` from conversations fitted to ``seq_length + 1`` tokens (:func:`fit_to_window`),
    one per sample or packed (:func:`pack`), in the order given; ``pad_id`` fills the rest of a window."""

    def __init__(self, encoded: Sequence[Encoded], *, seq_length: int, pad_id: int, packing: bool) -> None:
        self.seq_length, self.pad_id, self.packing = seq_length, pad_id, packing
        self.conversations = [(np.asarray(e.ids, dtype=np.int64), np.asarray(e.trained, dtype=bool)) for e in encoded]
        lengths = [len(ids) for ids, _ in self.conversations]
        too_long = [i for i, length in enumerate(lengths) if length > seq_length + 1]
        if too_long:
            raise ValueError(f"Conversations {too_long[:5]} are longer than seq_length + 1 = {seq_length + 1} tokens; "
                             f"fit them first (fit_to_window).")
        self.samples = pack(lengths, seq_length + 1) if packing else [[i] for i in range(len(lengths))]

    def __len__(self) -> int:
        return len(self.samples)

    def tokens(self) -> tuple[int, int]:
        """(tokens of conversations, tokens of the windows): how full the samples are."""
        return sum(len(ids) for ids, _ in self.conversations), len(self.samples) * (self.seq_length + 1)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        parts = [self.conversations[i] for i in self.samples[index]]
        window = self.seq_length + 1
        padding = window - sum(len(ids) for ids, _ in parts)
        tokens = np.concatenate([ids for ids, _ in parts] + [np.full(padding, self.pad_id, dtype=np.int64)])
        trained = np.concatenate([mask for _, mask in parts] + [np.zeros(padding, dtype=bool)])
        lengths = [len(ids) for ids, _ in parts] + ([padding] if padding else [])
        document = np.repeat(np.arange(len(lengths)), lengths)
        # the target of position i is token i + 1: trained if a response token of the same conversation
        labels = np.where(trained[1:] & (document[1:] == document[:-1]), tokens[1:], IGNORE_INDEX)
        sample = {"input_ids": torch.from_numpy(tokens[:-1].copy()), "labels": torch.from_numpy(labels)}
        if self.packing:
            starts = np.repeat(np.cumsum([0] + lengths[:-1]), lengths)
            sample["position_ids"] = torch.from_numpy(np.arange(window)[:-1] - starts[:-1])
            sample["document_ids"] = torch.from_numpy(document[:-1].copy())
        return sample
