"""The next token from vocab-parallel logits: greedy, or sampled with temperature, top-k and top-p.

No rank gathers the full logits. Greedy is the vocab-parallel argmax (two all-reduces of one number
per sequence). Sampling uses the Gumbel-max trick: ``argmax(logits / T + g)`` with ``g`` standard
Gumbel noise is an exact draw from ``softmax(logits / T)``. The noise of each step is drawn for the
whole real vocabulary from one generator seeded by the caller, and every rank adds its slice of it,
so the drawn token depends on the seed and the logits only, never on the layout. Top-k and top-p
need only the best candidates: each rank contributes its local best, an all-gather of
``k * tp`` (value, id) pairs gives the global best, and for top-p without top-k the candidate count
doubles until the nucleus provably lies inside it (the global softmax denominator is one more
all-reduce). The rules are ``transformers``' (``TopKLogitsWarper`` then ``TopPLogitsWarper``: top-p
renormalises over what top-k kept, and always keeps the most likely token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_megatron.tensor_parallel.argmax import vocab_parallel_argmax
from lightning_megatron.tensor_parallel.logits import VocabShard, as_plain


@dataclass(frozen=True)
class SamplingSettings:
    """``temperature=0``: greedy. ``top_k=0``: no top-k; ``top_p=1``: no nucleus."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 is greedy decoding).")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 keeps the whole vocabulary).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 keeps the whole vocabulary).")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class VocabParallelSampler:
    """Draws the next token of each sequence from its last-position logits ``[B, V/tp]``."""

    def __init__(self, settings: SamplingSettings, shard: VocabShard, *, seed: int) -> None:
        self.settings, self.shard = settings, shard
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: Tensor) -> Tensor:
        logits = as_plain(logits).float()
        if self.settings.greedy:
            return vocab_parallel_argmax(logits, self.shard.group)
        scores = logits / self.settings.temperature
        # One draw per step for every real token id, on every rank alike: the noise depends on the seed only.
        uniform = torch.rand(scores.shape[0], self.shard.vocab_size, generator=self.generator).clamp_(min=1e-20)
        gumbel = -torch.log(-torch.log(uniform)).to(scores.device)
        if self.settings.top_k == 0 and self.settings.top_p == 1:
            local = torch.full_like(scores, float("-inf"))
            real = slice(0, self.shard.size)
            local[:, real] = scores[:, real] + gumbel[:, self.shard.start:self.shard.start + self.shard.size]
            return vocab_parallel_argmax(local, self.shard.group)
        values, ids = self._candidates(scores)
        return ids.gather(1, (values + gumbel.gather(1, ids)).argmax(dim=1, keepdim=True)).squeeze(1)

    def _candidates(self, scores: Tensor) -> tuple[Tensor, Tensor]:
        """The scores and ids of the tokens top-k and top-p keep (``-inf`` where dropped), the same on every rank."""
        top_k, top_p = self.settings.top_k, self.settings.top_p
        count = min(top_k, self.shard.vocab_size) if top_k else min(64, self.shard.vocab_size)
        while True:
            values, ids = self._global_best(scores, count)
            if top_p == 1:
                return values, ids
            if top_k:  # top-p renormalises over what top-k kept
                probs = torch.softmax(values, dim=1)
            else:
                probs = (values - self._log_sum_exp(scores)[:, None]).exp()
            mass_before = probs.cumsum(dim=1) - probs
            enough = bool((mass_before[:, -1] + probs[:, -1] >= top_p).all())
            if top_k or enough or count == self.shard.vocab_size:
                return values.masked_fill(mass_before >= top_p, float("-inf")), ids
            count = min(2 * count, self.shard.vocab_size)

    def _global_best(self, scores: Tensor, count: int) -> tuple[Tensor, Tensor]:
        """The ``count`` best (score, global id) pairs of every row, best first, ties to the smaller id."""
        real = scores[:, : self.shard.size]
        values, local_ids = real.topk(min(count, real.shape[1]), dim=1)
        ids = local_ids + self.shard.start
        group = self.shard.group
        if group is not None:
            world = dist.get_world_size(group)
            width = count  # every rank sends `count` pairs; a rank with fewer real ids pads with -inf
            padded_values = torch.full((scores.shape[0], width), float("-inf"), device=scores.device)
            padded_ids = torch.full((scores.shape[0], width), self.shard.vocab_size, device=scores.device,
                                    dtype=torch.long)
            padded_values[:, : values.shape[1]], padded_ids[:, : ids.shape[1]] = values, ids
            all_values = [torch.empty_like(padded_values) for _ in range(world)]
            all_ids = [torch.empty_like(padded_ids) for _ in range(world)]
            dist.all_gather(all_values, padded_values, group=group)
            dist.all_gather(all_ids, padded_ids, group=group)
            values, ids = torch.cat(all_values, dim=1), torch.cat(all_ids, dim=1)
        # Best first; among equal scores the smaller id first (sort by id, then a stable sort by score).
        by_id = ids.argsort(dim=1)
        values, ids = values.gather(1, by_id), ids.gather(1, by_id)
        order = values.argsort(dim=1, descending=True, stable=True)[:, :count]
        return values.gather(1, order), ids.gather(1, order)

    def _log_sum_exp(self, scores: Tensor) -> Tensor:
        real = scores[:, : self.shard.size]
        top = real.max(dim=1).values if self.shard.size else scores.new_full(scores.shape[:1], float("-inf"))
        if self.shard.group is not None:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.shard.group)
        total = (real - top[:, None]).exp().sum(dim=1)
        if self.shard.group is not None:
            dist.all_reduce(total, group=self.shard.group)
        return top + total.log()
