"""Cross-entropy over vocab-parallel logits, without ever gathering the full vocabulary.

Each rank holds logits for its slice of the vocabulary. The softmax needs only three
reductions over the tensor-parallel group, each of one number per token: the max (for
stability), the sum of exponentials, and the logit of the target (held by one rank).
Memory and communication stay O(tokens), not O(tokens x vocab).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_megatron.tensor_parallel.logits import as_plain


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, group: dist.ProcessGroup, ignore_index: int) -> Tensor:
        local_vocab = logits.shape[-1]
        vocab_start = dist.get_rank(group) * local_vocab
        logits = logits.float()

        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        owned = (target >= vocab_start) & (target < vocab_start + local_vocab)
        local_target = (target - vocab_start).clamp(0, local_vocab - 1)
        # where, not a product: a rank holding only padding rows has -inf logits, and -inf * 0 is nan.
        target_logit = torch.where(owned, shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), 0.0)
        dist.all_reduce(target_logit, group=group)

        exp_logits = shifted.exp()
        sum_exp = exp_logits.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)

        valid = target != ignore_index
        loss = (sum_exp.log() - target_logit) * valid
        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, owned & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        softmax, local_target, owned, valid = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -owned.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor, target: Tensor, group: Optional[dist.ProcessGroup], ignore_index: int = -100
) -> Tensor:
    """Per-token losses (``reduction="none"``) of logits split along the last dimension over ``group``."""
    logits = as_plain(logits)
    if group is None:
        return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction="none")
    return _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index)


class VocabParallelCrossEntropy(nn.Module):
    """Drop-in replacement for ``nn.CrossEntropyLoss`` on vocab-parallel logits ``[N, V/tp]``."""

    def __init__(self, *, group: Optional[dist.ProcessGroup] = None, ignore_index: int = -100, reduction: str = "mean"):
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}.")
        self.group, self.ignore_index, self.reduction = group, ignore_index, reduction

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        losses = vocab_parallel_cross_entropy(logits, target, self.group, self.ignore_index)
        if self.reduction == "sum":
            return losses.sum()
        if self.reduction == "mean":
            return losses.sum() / (target != self.ignore_index).sum()
        return losses
