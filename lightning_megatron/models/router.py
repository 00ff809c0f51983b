"""The top-k router of a Mixture-of-Experts layer: which experts each token goes to, and with what weight.

Scores are computed in fp32 from the router's logits: ``"softmax"`` over the experts (Mixtral,
Qwen-MoE) or ``"sigmoid"`` per expert (DeepSeek-V3). The ``top_k`` experts with the highest
score are chosen (with the aux-loss-free ``expert_bias`` added for the choice only, DeepSeek-V3's
load balancing), and their scores become the combine weights, renormalised to sum to one when
``normalize_topk`` (Mixtral, DeepSeek-V3) or left as they are (Qwen2-MoE's default), then multiplied by
``scaling_factor`` (DeepSeek-V3's ``routed_scaling_factor``).

Group-limited routing (DeepSeek-V3's ``n_group``/``topk_group``): the experts form ``num_groups`` equal groups,
each group is scored by the sum of its two best choice scores (bias included), and a token's ``top_k`` experts are
chosen among the experts of its ``group_topk`` best groups only (transformers' rule; Megatron-Core sums the best
``top_k / group_topk`` of each group, the same two for DeepSeek-V3's 8 of 256 experts in 4 of 8 groups).

Two auxiliary losses keep the routing healthy; both are returned in *token-sum* units (like the
language-model loss before it is divided by the global token count), so that micro-batching and
data parallelism never change them:

* load balancing (Switch Transformer / GShard, as Megatron-Core writes it), per sequence:
  ``E / (S^2 k) * sum_i c_i * sum_t p_ti`` where ``c_i`` counts the sequence's tokens routed
  to expert ``i`` and ``p_ti`` is the token's normalised score. It is 1 for perfectly uniform
  routing. Per sequence (DeepSeek's sequence-wise balance) rather than per micro-batch, so it is
  the same function at every layout; its token-sum contribution is ``coeff * S * value`` per sequence.
* the router z-loss (ST-MoE, Zoph et al. 2022): ``coeff * sum_t logsumexp(logits_t)^2``.

The counts ``c_i`` are computed from the routing of whole sequences (``expert_ids``), which the
MoE layer has even under sequence parallelism (it gathers them); the scores may be those of a
sequence chunk, the sum over chunks is then the full loss (each chunk's share is exact).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SCORE_FUNCTIONS = ("softmax", "sigmoid")


class Routing(NamedTuple):
    """Per token ``[B, S, top_k]``: the chosen experts and their combine weights (fp32); ``scores`` ``[B, S, E]``:
    the normalised scores of every expert (the load-balancing loss reads them); ``logits`` ``[B, S, E]``."""

    expert_ids: Tensor
    weights: Tensor
    scores: Tensor
    logits: Tensor


class TopKRouter(nn.Module):
    """``weight`` ``[E, hidden]`` (Megatron-Core's and Hugging Face's router layout), and with ``bias`` a learned
    ``bias`` ``[E]`` added to the logits (GPT-OSS); ``expert_bias``, when enabled, is a persistent buffer (saved
    in checkpoints) moved by :meth:`update_expert_bias` after each optimizer step, never by gradients."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, score_function: str = "softmax",
                 normalize_topk: bool = True, expert_bias: bool = False, num_groups: Optional[int] = None,
                 group_topk: Optional[int] = None, scaling_factor: Optional[float] = None,
                 bias: bool = False) -> None:
        super().__init__()
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"score_function={score_function!r} is not one of {SCORE_FUNCTIONS}.")
        self.num_experts, self.top_k = num_experts, top_k
        self.score_function, self.normalize_topk = score_function, normalize_topk
        self.num_groups, self.group_topk, self.scaling_factor = num_groups, group_topk, scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
            # Tokens routed to each expert since the last update (training forwards only; integers, which a
            # precision conversion leaves alone); not saved.
            self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        else:
            self.expert_bias = None
            self.tokens_per_expert = None

    def _apply(self, fn, recurse: bool = True):
        """The expert bias stays fp32 through ``.to(bfloat16)`` (``bf16-true``): steps of ``1e-3`` would vanish in bf16."""
        before = self.expert_bias
        super()._apply(fn, recurse)
        after = self.expert_bias
        if after is not None and after.dtype != torch.float32:  # the fp32 values, where the conversion put them
            self._buffers["expert_bias"] = before.to(device=after.device, dtype=torch.float32)
        return self

    def initialize_buffers(self) -> None:
        """Called when the model is materialised (``parallel.initialize``): the bias and the counts start at zero."""
        for buffer in self.buffers(recurse=False):
            buffer.zero_()

    def forward(self, x: Tensor) -> Routing:
        logits = F.linear(x, self.weight, self.bias).float()
        if self.score_function == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        if self.num_groups is not None:
            choice = self._within_best_groups(choice)
        _, expert_ids = torch.topk(choice, self.top_k, dim=-1)
        weights = scores.gather(-1, expert_ids)
        if self.normalize_topk:  # (one expert per token then weighs 1, as Mixtral's and Switch's routers give it)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scaling_factor is not None:
            weights = weights * self.scaling_factor
        if self.score_function == "sigmoid":  # the balance loss reads a distribution over experts
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return Routing(expert_ids, weights, scores, logits)

    def _within_best_groups(self, choice: Tensor) -> Tensor:
        """``choice`` with the experts outside each token's ``group_topk`` best groups at ``-inf`` (a group's score:
        the sum of its two best choice scores, or its one expert's)."""
        groups = choice.unflatten(-1, (self.num_groups, -1))  # [..., G, E / G]
        group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(dim=-1)
        best = group_scores.topk(self.group_topk, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best, True)
        return groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)

    def count_tokens(self, expert_ids: Tensor) -> Tensor:
        """Tokens per expert ``[E]`` of whole sequences' routing; accumulated for the expert-bias update in training.
        An id of ``num_experts`` (an assignment the capacity dropped) counts for none. Counted on the device
        (``torch.bincount`` would read the largest id on the host first)."""
        ids = expert_ids.reshape(-1).long()
        counts = ids.new_zeros(self.num_experts + 1).scatter_add_(0, ids, torch.ones_like(ids))[:-1]
        if self.tokens_per_expert is not None and self.training and torch.is_grad_enabled() and counts_routing():
            self.tokens_per_expert += counts
        return counts

    @torch.no_grad()
    def update_expert_bias(self, global_counts: Tensor, rate: float) -> None:
        """DeepSeek-V3's aux-loss-free balancing: raise the bias of under-loaded experts by ``rate``, lower the
        over-loaded ones' (``global_counts``: the step's tokens per expert over the whole global batch)."""
        counts = global_counts.double()
        self.expert_bias += rate * torch.sign(counts.mean() - counts).float()
        self.tokens_per_expert.zero_()


_counting = True


@contextlib.contextmanager
def routing_uncounted() -> Iterator[None]:
    """Forwards inside are not training steps (torch's pipeline stages run once more to infer shapes): they leave
    the expert loads and the routing statistics alone."""
    global _counting
    previous, _counting = _counting, False
    try:
        yield
    finally:
        _counting = previous


def counts_routing() -> bool:
    """Whether this forward's routing counts: not inside :func:`routing_uncounted`, nor while autograd recomputes
    a checkpointed forward (it was counted the first time)."""
    return _counting and torch._C._current_graph_task_id() == -1


def load_balancing_loss(scores: Tensor, counts: Tensor, top_k: int, seq_length: int) -> Tensor:
    """Token-sum units: ``sum over sequences of S * E / (S^2 k) * sum_i c_si * sum_t p_sti`` (module docstring).

    ``scores`` ``[B, S_local, E]`` (the tokens this rank routed, possibly a sequence chunk); ``counts``
    ``[B, E]``: each whole sequence's tokens per expert; ``seq_length``: the whole sequence's length."""
    num_experts = scores.shape[-1]
    per_expert = scores.sum(dim=1)  # [B, E]
    return (per_expert * counts).sum() * (num_experts / (seq_length * top_k))


def z_loss(logits: Tensor) -> Tensor:
    """Token-sum units: ``sum_t logsumexp(logits_t)^2``."""
    return torch.logsumexp(logits, dim=-1).pow(2).sum()


def sequence_counts(expert_ids: Tensor, num_experts: int) -> Tensor:
    """``[B, E]``: tokens of each sequence routed to each expert (``expert_ids`` ``[B, S, k]``)."""
    ids = expert_ids.reshape(expert_ids.shape[0], -1)
    counts = torch.zeros(ids.shape[0], num_experts, dtype=torch.float32, device=ids.device)
    return counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=ids.device))
