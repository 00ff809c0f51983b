"""The predicted token (argmax over the vocabulary) of vocab-parallel logits, without gathering them.

Accuracy metrics need the predicted id at each position, but under tensor parallelism each
rank holds only its slice of the vocabulary's logits. A model computes predictions with the
plain :class:`Argmax` module; the plan's ``"vocab"`` style swaps it for
:class:`VocabParallelArgmax`, which needs two O(tokens) all-reduces (the global max, then the
smallest id that reaches it) instead of gathering O(tokens x vocab) logits.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_megatron.tensor_parallel.logits import as_plain


class Argmax(nn.Module):
    """``logits.argmax(-1)``: a module only so that a tensor-parallel plan can swap it (style ``"vocab"``)."""

    def forward(self, logits: Tensor) -> Tensor:
        return logits.argmax(dim=-1)


@torch.no_grad()
def vocab_parallel_argmax(logits: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Global ids of the largest logit, from logits split along the last dimension over ``group``.

    Ties go to the smallest id, as ``torch.argmax`` does; padding rows hold ``-inf`` and never win.
    """
    logits = as_plain(logits)
    if group is None:
        return logits.argmax(dim=-1)
    local_max, local_ids = logits.max(dim=-1)
    global_max = local_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    vocab_start = dist.get_rank(group) * logits.shape[-1]
    no_winner = torch.iinfo(torch.long).max
    winners = torch.where(local_max == global_max, local_ids + vocab_start, no_winner)
    dist.all_reduce(winners, op=dist.ReduceOp.MIN, group=group)
    return winners


class VocabParallelArgmax(nn.Module):
    """Drop-in replacement for :class:`Argmax` on vocab-parallel logits ``[..., V/tp]``."""

    def __init__(self, *, group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        self.group = group

    def forward(self, logits: Tensor) -> Tensor:
        return vocab_parallel_argmax(logits, self.group)
