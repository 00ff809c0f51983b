"""Prompts for ``trainer.predict``: text or token ids, left-padded into batches that ``GPT.predict_step`` continues.

Left padding (as ``transformers`` tokenizers do with ``padding_side="left"``) puts every prompt's last
token in the last column, so one batch is generated together; ``attention_mask`` marks the real tokens.
Each batch also carries the ``generation`` settings (``max_new_tokens``, ``temperature``, ``top_k``,
``top_p``, ``eos_id``, ``seed``), so a config file sets them next to the prompts.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from torch.utils.data import Dataset

from lightning_megatron.data.tokenizers import Tokenizer
from lightning_megatron.generation.generate import left_pad

Prompt = Union[str, Sequence[int]]
GENERATION_SETTINGS = ("max_new_tokens", "temperature", "top_k", "top_p", "eos_id", "seed", "pad_id")


class PromptDataset(Dataset):
    """Token ids of each prompt: strings through ``tokenizer``, lists of ids as they are."""

    def __init__(self, prompts: Sequence[Prompt], tokenizer: Optional[Tokenizer] = None,
                 generation: Optional[dict[str, Any]] = None) -> None:
        if not prompts:
            raise ValueError("No prompts to predict from: give at least one.")
        unknown = set(generation or {}) - set(GENERATION_SETTINGS)
        if unknown:
            raise ValueError(f"Unknown generation settings {sorted(unknown)}; the settings are {list(GENERATION_SETTINGS)}.")
        if tokenizer is None and any(isinstance(p, str) for p in prompts):
            raise ValueError("Text prompts need a tokenizer; pass token ids or a tokenizer.")
        self.prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        empty = [i for i, p in enumerate(self.prompts) if not p]
        if empty:
            raise ValueError(f"Prompts {empty} have no tokens; every prompt needs at least one.")
        self.generation = dict(generation or {})
        if tokenizer is not None and getattr(tokenizer, "eos_id", None) is not None:
            self.generation.setdefault("eos_id", tokenizer.eos_id)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> list[int]:
        return self.prompts[index]

    def collate(self, prompts: list[list[int]]) -> dict[str, Any]:
        """``input_ids`` and ``attention_mask`` ``[B, S]``, left-padded, and the ``generation`` settings."""
        ids, mask = left_pad(prompts, self.generation.get("pad_id", self.generation.get("eos_id", 0)))
        return {"input_ids": ids, "attention_mask": mask, "generation": dict(self.generation)}
