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


def vocab_parallel_loss_terms(logits: Tensor, target: Tensor, group: Optional[dist.ProcessGroup],
                              ignore_index: int) -> tuple[Tensor, ...]:
    """Per-token losses of fp32 logits ``[N, V/tp]`` and what their gradient needs, with the three reductions.

    Returns ``(loss, exp_logits, logits_max, sum_exp, local_target, owned, valid)``: ``exp_logits`` is
    ``exp(logits - logits_max)``, to be divided by ``sum_exp`` for the softmax; ``owned``: the target is in this
    rank's slice and not ignored. Shared by the loss over whole logits and the chunked one
    (``chunked_cross_entropy``), which keeps ``logits_max`` and ``sum_exp`` to rebuild a chunk's softmax in backward.
    ``group=None``: the whole vocabulary on this rank, nothing to reduce."""
    logits_max = logits.max(dim=-1).values
    _all_reduce(logits_max, dist.ReduceOp.MAX, group)
    shifted = logits - logits_max.unsqueeze(-1)

    local_target, owned = local_targets(target, logits.shape[-1], group)
    # where, not a product: a rank holding only padding rows has -inf logits, and -inf * 0 is nan.
    target_logit = torch.where(owned, shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), 0.0)
    _all_reduce(target_logit, dist.ReduceOp.SUM, group)

    exp_logits = shifted.exp()
    sum_exp = exp_logits.sum(dim=-1)
    _all_reduce(sum_exp, dist.ReduceOp.SUM, group)

    valid = target != ignore_index
    loss = (sum_exp.log() - target_logit) * valid
    return loss, exp_logits, logits_max, sum_exp, local_target, owned & valid, valid


def local_targets(target: Tensor, local_vocab: int, group: Optional[dist.ProcessGroup]) -> tuple[Tensor, Tensor]:
    """Each target's column in this rank's slice of ``local_vocab`` columns (clamped into it), and whether this
    rank holds it."""
    vocab_start = dist.get_rank(group) * local_vocab if group is not None else 0
    owned = (target >= vocab_start) & (target < vocab_start + local_vocab)
    return (target - vocab_start).clamp(0, local_vocab - 1), owned


def logits_gradient(softmax: Tensor, local_target: Tensor, owned: Tensor, grad_loss: Tensor) -> Tensor:
    """``d loss / d logits`` = ``(softmax - one_hot(target)) * grad_loss``, computed in place in ``softmax``
    (``grad_loss`` already zero at ignored tokens)."""
    softmax.scatter_add_(-1, local_target.unsqueeze(-1), -owned.to(softmax.dtype).unsqueeze(-1))
    return softmax.mul_(grad_loss.unsqueeze(-1))


def _all_reduce(x: Tensor, op, group: Optional[dist.ProcessGroup]) -> None:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, group: dist.ProcessGroup, ignore_index: int) -> Tensor:
        loss, exp_logits, _, sum_exp, local_target, owned, valid = vocab_parallel_loss_terms(
            logits.float(), target, group, ignore_index)
        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, owned, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        softmax, local_target, owned, valid = ctx.saved_tensors
        return logits_gradient(softmax, local_target, owned, grad_loss * valid), None, None, None


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
