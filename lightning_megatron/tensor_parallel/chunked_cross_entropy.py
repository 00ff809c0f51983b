"""The output layer and the vocab-parallel cross-entropy fused, chunk by chunk of tokens.

The unfused path materialises the logits of every token of a micro-batch, ``[tokens, V/tp]`` in the compute
dtype, then their fp32 copy and fp32 softmax for backward: at Llama-3's vocabulary of 128,256 that is more than
any transformer layer keeps. :class:`ChunkedHeadLoss` takes the final norm's output and the head instead, and
runs ``chunk_tokens`` tokens at a time: their logits, the three vocab-parallel reductions
(``cross_entropy.vocab_parallel_loss_terms``), their losses. It keeps only two fp32 numbers per token (the
logits' maximum and the sum of their exponentials), so the logits of one chunk are the largest thing it ever
holds.

Backward recomputes each chunk's logits (one more GEMM of the head per token) and turns them into the softmax
with the kept numbers, exactly as the forward did, then into the input and weight gradients of that chunk. The
other way, computing the gradients during the forward (as Liger-Kernel's fused linear cross-entropy does), saves
that GEMM but must hold the head's weight gradient (``V/tp x hidden``, fp32) and the input gradient from the
forward until the backward: at Llama-3-8B's head that is 2 GiB, more than the logits of a 4k-token chunk. The
recomputation keeps the lower peak.

Tensor parallelism: the head's weight is this rank's vocabulary slice (padding rows masked to ``-inf`` as the
head does). Without sequence parallelism the input is replicated and its gradient is summed over the group
(``copy_to_tensor_parallel``); with it each rank holds a sequence chunk and gathers one token chunk of every rank
at a time (``chunk_tokens / tp`` tokens of each, so that a chunk's logits have the same size at every layout), in
forward and again in backward, reduce-scattering that chunk's input gradient, so that no rank ever holds the
gathered sequence (Megatron-Core's column layer does the same for its whole input).

Soft-capping (``softcap``, ``GPTConfig.final_logit_softcapping``): each chunk's logits become
``cap * tanh(logits / cap)`` in the compute dtype before the fp32 softmax, as ``logits.soft_cap`` does to the head's
logits on the unchunked path; backward recomputes the chunk's ``tanh`` with its logits and multiplies the logits'
gradient by ``1 - tanh^2``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_megatron.tensor_parallel.cross_entropy import local_targets, logits_gradient, vocab_parallel_loss_terms
from lightning_megatron.tensor_parallel.logits import VocabShard
from lightning_megatron.tensor_parallel.mappings import (
    Group,
    all_gather_into,
    copy_to_tensor_parallel,
    reduce_scatter_into,
    sequences_are_whole,
)


class ChunkedHeadLoss(nn.Module):
    """Summed cross-entropy of ``head(hidden)`` against ``labels``, ``chunk_tokens`` tokens of logits at a time.

    Same loss and gradients as ``CrossEntropyLoss(reduction="sum")`` (or ``VocabParallelCrossEntropy``) on the
    head's logits (soft-capped by ``softcap`` where given: ``logits.soft_cap``), to fp32 rounding. ``hidden``: the final norm's output ``[batch, seq, hidden]`` (``seq / tp``
    under sequence parallelism); ``labels`` ``[batch, seq]`` (the whole sequence); ``head``: the output layer, a
    bias-free ``nn.Linear`` or ``VocabParallelHead``.

    Example::

        loss_fn = ChunkedHeadLoss(chunk_tokens=4096)
        loss_sum = loss_fn(model.ln_f(x), labels, model.lm_head)
    """

    def __init__(self, *, chunk_tokens: int, ignore_index: int = -100, softcap: Optional[float] = None) -> None:
        super().__init__()
        check_chunk_tokens(chunk_tokens)
        self.chunk_tokens, self.ignore_index, self.softcap = chunk_tokens, ignore_index, softcap

    def forward(self, hidden: Tensor, labels: Tensor, head: nn.Module) -> Tensor:
        return run_as_forward_of(head, self._head_loss, hidden, labels, head)

    def _head_loss(self, hidden: Tensor, labels: Tensor, head: nn.Module) -> Tensor:
        if getattr(head, "bias", None) is not None:
            raise ValueError(f"ChunkedHeadLoss takes a head without bias, but this {type(head).__name__} has one: "
                             f"build it with bias=False, or use the unchunked loss (loss_chunk_tokens=None).")
        shard = VocabShard.of_head(head)
        sequence_parallel = (getattr(head, "sequence_parallel", False) and shard.group is not None
                             and not sequences_are_whole())
        ranks = dist.get_world_size(shard.group) if sequence_parallel else 1
        if labels.shape[1] != hidden.shape[1] * ranks:
            raise ValueError(f"labels {tuple(labels.shape)} do not match hidden states {tuple(hidden.shape)}: pass "
                             f"the labels of the whole sequence, [batch, {hidden.shape[1] * ranks}] (the hidden "
                             f"states' sequence is split over {ranks} rank(s)).")
        # Token rows in [batch, sequence] order; under sequence parallelism, one row of targets per rank's chunk.
        targets = labels.reshape(labels.shape[0], ranks, -1).transpose(0, 1).reshape(ranks, -1)
        rows = hidden.reshape(-1, hidden.shape[-1])
        if not sequence_parallel:
            rows = copy_to_tensor_parallel(rows, shard.group)  # replicated input: its gradient summed over tp
        device = rows.device.type
        compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else rows.dtype
        # Under sequence parallelism a chunk is gathered from every rank: each gives chunk_tokens / tp of its own.
        chunk = max(1, self.chunk_tokens // ranks)
        losses = _ChunkedHeadCrossEntropy.apply(rows, head.weight, targets, shard, sequence_parallel, chunk,
                                                self.ignore_index, compute_dtype, self.softcap)
        return losses.sum()

    def extra_repr(self) -> str:
        softcap = "" if self.softcap is None else f", softcap={self.softcap}"
        return f"chunk_tokens={self.chunk_tokens}, ignore_index={self.ignore_index}{softcap}"


def run_as_forward_of(module: nn.Module, function, *args):
    """``function(*args)`` run by ``module.__call__`` in place of its ``forward``, so that the hooks on the module
    run around it as around its own forward. The loss uses the head's weight without calling the head; under ZeRO-3
    with pipelining the head is an FSDP unit of its own, whose hooks gather its weight before the forward, gather it
    again before the backward and reduce-scatter its gradient after. (Without them the weight is the dp shard.)"""
    own = module.__dict__.get("forward")
    module.forward = function
    try:
        return module(*args)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def check_chunk_tokens(chunk_tokens: Optional[int], *, name: str = "chunk_tokens") -> None:
    """A chunk is a positive whole number of tokens (``None``, where allowed, is checked by the caller)."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"{name}={chunk_tokens!r} must be a positive number of tokens per chunk of logits "
                         f"(e.g. 4096), or None for the unchunked loss.")


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """Per-token losses ``[ranks, tokens]`` of ``rows @ weight.T``, one chunk of ``chunk`` rows at a time."""

    @staticmethod
    def forward(ctx, rows: Tensor, weight: Tensor, targets: Tensor, shard: VocabShard, sequence_parallel: bool,
                chunk: int, ignore_index: int, compute_dtype: torch.dtype, softcap: Optional[float]) -> Tensor:
        ctx.shard, ctx.sequence_parallel, ctx.chunk = shard, sequence_parallel, chunk
        ctx.ignore_index, ctx.compute_dtype, ctx.softcap = ignore_index, compute_dtype, softcap
        losses, maxima, sums = (targets.new_empty(targets.shape, dtype=torch.float32) for _ in range(3))
        computed = weight.to(compute_dtype)  # cast once, not once per chunk (a copy under autocast only)
        for start in range(0, rows.shape[0], chunk):
            span = slice(start, start + chunk)
            for out, value in zip((losses, maxima, sums), _chunk_loss(ctx, rows[span], computed, targets[:, span])):
                out[:, span] = value.view(targets.shape[0], -1)
        ctx.save_for_backward(rows, weight, targets, maxima, sums)
        return losses

    @staticmethod
    def backward(ctx, grad_losses: Tensor):
        rows, weight, targets, maxima, sums = ctx.saved_tensors
        grad_rows = torch.empty_like(rows)
        # Accumulated in the weight's dtype, where it stays (it becomes the weight's .grad): an fp32 accumulator
        # for a bf16 weight would add twice the weight's size to the peak, as each chunk's product would.
        grad_weight = torch.zeros_like(weight)
        computed = weight.to(ctx.compute_dtype)
        for start in range(0, rows.shape[0], ctx.chunk):
            span = slice(start, start + ctx.chunk)
            grad_rows[span] = _chunk_gradients(ctx, rows[span], computed, targets[:, span], maxima[:, span],
                                               sums[:, span], grad_losses[:, span], grad_weight)
        return grad_rows, grad_weight, None, None, None, None, None, None, None


def _chunk_loss(ctx, rows: Tensor, weight: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A chunk's per-token losses, logits maxima and sums of exponentials; its logits die on return."""
    logits = _chunk_logits(ctx, rows, weight)[1]  # the cap's tanh is not needed (nor held) here
    loss, _, logits_max, sum_exp, *_ = vocab_parallel_loss_terms(logits, targets.reshape(-1), ctx.shard.group,
                                                                 ctx.ignore_index)
    return loss, logits_max, sum_exp


def _chunk_gradients(ctx, rows: Tensor, weight: Tensor, targets: Tensor, maxima: Tensor, sums: Tensor,
                     grad_losses: Tensor, grad_weight: Tensor) -> Tensor:
    """A chunk's input gradient (this rank's rows); adds its weight gradient to ``grad_weight``."""
    group, cast = ctx.shard.group, ctx.compute_dtype
    inputs, logits, tanh = _chunk_logits(ctx, rows, weight)
    # d(cap * tanh(z / cap)) / dz = 1 - tanh^2, made in place of tanh's (fp32) values: no more than a chunk of logits
    slope = None if tanh is None else tanh.float().square_().neg_().add_(1)
    del tanh
    target = targets.reshape(-1)
    # The forward's softmax, rebuilt from its kept maximum and sum: the same operations on the same values.
    softmax = (logits - maxima.reshape(-1, 1)).exp_().div_(sums.reshape(-1, 1))
    del logits
    local_target, owned = local_targets(target, softmax.shape[-1], group)
    scale = grad_losses.reshape(-1) * (target != ctx.ignore_index)
    grad_logits = logits_gradient(softmax, local_target, owned, scale)
    if slope is not None:
        grad_logits.mul_(slope)
    grad_logits = grad_logits.to(cast)
    with _no_autocast(rows):
        if grad_weight.dtype == cast:
            grad_weight.addmm_(grad_logits.t(), inputs)
        else:  # autocast: an fp32 weight, the product in the compute dtype
            grad_weight.add_(grad_logits.t() @ inputs)
        grad_inputs = grad_logits @ weight
    if not ctx.sequence_parallel:
        return grad_inputs
    scattered = grad_inputs.new_empty((grad_inputs.shape[0] // dist.get_world_size(group), grad_inputs.shape[1]))
    reduce_scatter_into(scattered, grad_inputs.contiguous(), group)
    return scattered


def _chunk_logits(ctx, rows: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """The chunk's head input (gathered over the group under sequence parallelism), its fp32 logits (soft-capped in
    the compute dtype where ``ctx.softcap`` says, as ``logits.soft_cap``), padding columns at ``-inf`` as
    ``VocabParallelHead`` sets them, and the cap's ``tanh`` (None without a cap); ``weight`` is already in the compute
    dtype."""
    inputs = rows.to(ctx.compute_dtype)
    if ctx.sequence_parallel:
        gathered = inputs.new_empty((inputs.shape[0] * dist.get_world_size(ctx.shard.group), inputs.shape[1]))
        all_gather_into(gathered, inputs.contiguous(), ctx.shard.group)
        inputs = gathered
    with _no_autocast(rows):
        logits = F.linear(inputs, weight)
    tanh = None
    if ctx.softcap is not None:
        tanh = torch.tanh(logits / ctx.softcap)
        logits = tanh * ctx.softcap
    logits = logits.float()
    if ctx.shard.size != logits.shape[-1]:
        logits[:, ctx.shard.size:] = float("-inf")
    return inputs, logits, tanh


def _no_autocast(like: Tensor):
    """The GEMMs run in the dtype chosen at the forward (autocast's, if it was on), not under a later autocast."""
    return torch.autocast(like.device.type, enabled=False)
