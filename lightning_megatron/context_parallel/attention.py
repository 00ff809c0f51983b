"""The attention a context-parallel layout installs in each ``CoreAttention``: ring or all-gather."""

from __future__ import annotations

from typing import Callable, Optional

import torch.distributed as dist
from torch import Tensor, nn

from lightning_megatron.context_parallel.all_gather import all_gather_attention
from lightning_megatron.context_parallel.documents import DocumentMask
from lightning_megatron.context_parallel.ring import ring_attention
from lightning_megatron.tensor_parallel.mappings import sequences_are_whole

#: ``context_parallel_attention=`` choices: ring attention (K/V passed round the ring, overlapped with compute)
#: or one all-gather of K/V per layer (suits grouped-query attention with few key/value heads).
VARIANTS = {"ring": ring_attention, "all_gather": all_gather_attention}


class ContextParallelAttention(nn.Module):
    """Attention of this rank's part of the sequence over the whole sequence (``CoreAttention.context_parallel``).

    Inside ``tensor_parallel.mappings.full_sequences()`` (generation, predict: every rank holds whole
    sequences) it steps aside and the plain local attention runs.
    """

    def __init__(self, group: dist.ProcessGroup, variant: str = "ring") -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"context_parallel_attention={variant!r} is not one of {sorted(VARIANTS)}.")
        self.group, self.variant = group, variant
        self.size = dist.get_world_size(group)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, attention_mask: Optional[Tensor], *, causal: bool,
                local: Callable[..., Tensor], window: Optional[int] = None, sinks: Optional[Tensor] = None) -> Tensor:
        """``window``: the attention's sliding window (each query sees the ``window`` keys ending at its global
        position), None for none; ``sinks``: ``[H]`` sink logits of the heads (merged once into each query's
        softmax, after every rank's keys: ``blocks.merge_sinks``), None for none; ``local`` takes them itself."""
        if sequences_are_whole():
            return local(q, k, v, attention_mask, causal)
        if isinstance(attention_mask, DocumentMask):
            return VARIANTS[self.variant](q, k, v, causal=causal, group=self.group, window=window, sinks=sinks,
                                          documents=self._documents(attention_mask, q.shape[2]))
        return VARIANTS[self.variant](q, k, v, causal=causal, group=self.group, window=window, sinks=sinks,
                                      key_mask=self._key_mask(attention_mask, q.shape[2]))

    def _documents(self, documents: DocumentMask, length: int) -> DocumentMask:
        """The document ids must cover the whole sequence (``[B, n * S_l]``, in the ring's order)."""
        if documents.ids.shape[1] != self.size * length:
            raise RuntimeError(
                f"Context parallelism takes the document ids of the whole sequence, [B, {self.size * length}] in the "
                f"ring's order (split_batch keeps the model's key_masks entries whole); this attention got "
                f"{list(documents.ids.shape)}. Declare the entry in sequence_inputs().key_masks.")
        return documents

    def _key_mask(self, attention_mask: Optional[Tensor], length: int) -> Optional[Tensor]:
        """``[B, n * S_l]`` from the ``[B, 1, 1, n * S_l]`` key-padding mask a model builds from the whole-sequence
        mask ``inputs.split_batch`` hands it; other masks cannot be split by position here."""
        if attention_mask is None:
            return None
        total = self.size * length
        if attention_mask.dim() != 4 or attention_mask.shape[1:3] != (1, 1) or attention_mask.shape[3] != total:
            raise RuntimeError(
                f"Context parallelism takes a key-padding mask [B, 1, 1, {total}] over the whole sequence (in the "
                f"ring's order, as split_batch gives it); this attention got a mask of shape "
                f"{list(attention_mask.shape)}. Masks over query and key positions cannot be split; give packed "
                f"documents as a DocumentMask of their ids.")
        return attention_mask[:, 0, 0, :].bool()

    def extra_repr(self) -> str:
        return f"variant={self.variant!r}, size={self.size}"
