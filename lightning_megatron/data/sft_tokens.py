"""Tokenised conversations cached on disk: formatted and tokenised by one rank, read by every rank.

A chat template renders each conversation once per assistant turn and once more whole (once with
``{% generation %}`` markers: ``data/chat_templates.py``), a few thousand conversations a second
in Python: a large set would cost every rank minutes at every start. So, like the GPT index
arrays, the result is an ``index_cache`` entry (``data/index_cache.py``: global rank 0 builds
while the others wait; checked by size and CRC-32; rebuilt when anything it depends on changes):
every conversation's ``ids`` and ``trained`` flags end to end, and the ``offsets`` where each
starts, in the file's order. Its key holds the data file's size and modification time and the
format's :meth:`identity` (the tokenizer's vocabulary, the template and its rule, or the prompt
style).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lightning_megatron.data.conversations import Conversation, Encoded
from lightning_megatron.data.corpus import ByteTokenizer
from lightning_megatron.data.index_cache import Ranks, load_or_build
from lightning_megatron.data.tokenizers import HFTokenizer, Tokenizer

_VERSION = 1  # bump when what the arrays mean changes: old entries are then rebuilt


def file_identity(path: str | os.PathLike) -> dict[str, Any]:
    """What a cache entry built from ``path`` depends on: the file, its size and its modification time."""
    stat = os.stat(path)
    return {"path": os.path.realpath(path), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def tokenizer_identity(tokenizer: Tokenizer) -> str:
    """A digest of everything a tokenizer maps text to ids by: the byte tokenizer is ``"byte"``; a
    ``tokenizer.json`` its contents; a Hugging Face tokenizer directory its definition (``vocabulary()``)."""
    if isinstance(tokenizer, ByteTokenizer):
        return "byte"
    if isinstance(tokenizer, HFTokenizer):
        return text_digest(tokenizer.path.read_text(encoding="utf-8"))
    return text_digest(tokenizer.vocabulary())


def encode_all(conversations: Sequence[Conversation], encode: Callable[[Conversation], Encoded]) -> dict[str, np.ndarray]:
    """The arrays of a cache entry: ``ids`` (int32) and ``trained`` (uint8) end to end, ``offsets`` (int64, n + 1)."""
    encoded = [encode(conversation) for conversation in conversations]
    lengths = np.array([len(e.ids) for e in encoded], dtype=np.int64)
    return {"ids": np.concatenate([np.asarray(e.ids, dtype=np.int32) for e in encoded]),
            "trained": np.concatenate([np.asarray(e.trained, dtype=np.uint8) for e in encoded]),
            "offsets": np.concatenate([[0], np.cumsum(lengths)])}


def tokenised_conversations(read: Callable[[], Sequence[Conversation]], encode: Callable[[Conversation], Encoded], *,
                            source: dict[str, Any], format_identity: dict[str, Any], cache_dir: str | os.PathLike,
                            ranks: Ranks) -> list[Encoded]:
    """Every conversation that ``read`` gives, through ``encode``, from the cache (built there first when missing)."""
    key = {"kind": "sft-conversations", "version": _VERSION, "source": source, "format": format_identity}
    cached = load_or_build(cache_dir, key, lambda: encode_all(read(), encode), ranks=ranks, what="SFT conversations")
    ids, trained, offsets = (np.asarray(cached.arrays[name]) for name in ("ids", "trained", "offsets"))
    return [Encoded(ids[start:stop].astype(np.int64), trained[start:stop].astype(bool))
            for start, stop in zip(offsets[:-1], offsets[1:])]
