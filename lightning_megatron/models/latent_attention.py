"""Multi-head latent attention (DeepSeek-V2 and V3): queries, keys and values from low-rank latents.

Per token, ``kv_down`` projects the hidden state to a latent of ``kv_lora_rank`` channels plus one rotary key of
``qk_rope_head_dim`` channels that every head shares; the latent is normalised and ``kv_up`` makes each head's
key part without positions (``qk_nope_head_dim``) and its value (``v_head_dim``). Queries come the same way from
a latent of ``q_lora_rank`` channels (``q_down``, its norm, ``q_up``), or from one projection ``q`` when
``q_lora_rank`` is None (DeepSeek-V2-Lite). Each head's query and key are ``[nope | rope]``; rotary positions
turn the rope parts only. The softmax scale is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5`` unless given.

Tensor parallelism splits as Megatron-Core does: the down projections and their norms are replicated (under
sequence parallelism they run on this rank's sequence chunk and their gradients are summed over tp, as a layer
norm's), the up projections are split by heads and ``proj`` by its input. The latents, and the rotary key that
every rank's heads read, enter the tensor-parallel region once (``region``: f, or one sequence all-gather; a
``tensor_parallel.region.TensorParallelRegion`` set by the plan), so their gradients are summed over the heads
of every rank; ``q_up`` and ``kv_up`` are split inside that region and do not communicate. Without ``q_lora_rank``,
``q`` is an ordinary column-parallel layer of the hidden state.

Values narrower than the query/key heads (DeepSeek-V3: 128 against 192) are padded with zeros to the heads' width
for attention and cut back after it, so every attention path (SDPA, packed documents, sliding windows, context
parallelism, the KV cache) runs unchanged; wider values pad the queries and keys instead (zeros leave the scores
alone; the scale is set explicitly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_megatron.models.attention import CoreAttention
from lightning_megatron.models.moe import OneProcessRegion
from lightning_megatron.models.rotary import RopeScaling
from lightning_megatron.tensor_parallel.region import InsideRegion


@dataclass(frozen=True)
class MLAConfig:
    """The sizes of multi-head latent attention (``GPTConfig.mla``), transformers' and Megatron-Core's names:
    ``q_lora_rank`` (None: queries from one projection of the hidden state), ``kv_lora_rank``, each head's
    ``qk_nope_head_dim`` channels without positions and ``qk_rope_head_dim`` rotary ones (the key's rotary part is
    one head shared by all), and ``v_head_dim``."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: Optional[int] = None

    def __post_init__(self) -> None:
        sizes = {"kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
                 "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim,
                 **({} if self.q_lora_rank is None else {"q_lora_rank": self.q_lora_rank})}
        bad = [f"{name}={value!r}" for name, value in sizes.items() if not isinstance(value, int) or value < 1]
        if bad:
            raise ValueError(f"MLAConfig: {', '.join(bad)}; every size must be a positive integer (q_lora_rank may "
                             f"be None: queries from one projection).")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLAConfig.qk_rope_head_dim={self.qk_rope_head_dim}: rotary positions turn channel "
                             f"pairs, so it must be even.")

    @property
    def qk_head_dim(self) -> int:
        """Channels of one query or key head: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def softmax_scale(self, rope_scaling: Optional[RopeScaling]) -> Optional[float]:
        """``GPTConfig.softmax_scale`` of DeepSeek's attention under ``rope_scaling``: ``qk_head_dim ** -0.5`` times
        YaRN's ``RopeScaling.softmax_scale_factor()`` (``mscale_all_dim``); None (that default) when the factor is 1."""
        factor = 1.0 if rope_scaling is None else rope_scaling.softmax_scale_factor()
        return None if factor == 1.0 else self.qk_head_dim ** -0.5 * factor

    def num_parameters(self, hidden_size: int, num_heads: int, *, bias: bool) -> int:
        """Weights of one attention: the projections, the latents' norm gains (and the biases of the down
        projections and ``proj`` when ``bias``)."""
        h, heads = hidden_size, num_heads
        if self.q_lora_rank is None:
            queries = h * heads * self.qk_head_dim
        else:
            queries = (h + bias + 1) * self.q_lora_rank + self.q_lora_rank * heads * self.qk_head_dim
        keys_values = ((h + bias) * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
                       + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim))
        return queries + keys_values + heads * self.v_head_dim * h + bias * h


class MultiLatentAttention(nn.Module):
    """``proj(attention(q, k, v))`` with ``q``, ``k``, ``v`` from latents (module docstring). ``norm(size)`` builds
    a latent's norm; ``rotary`` turns ``qk_rope_head_dim`` channels; ``bias``: biases on the down projections and
    ``proj`` (transformers' ``attention_bias``). ``window``, ``softmax_scale`` (None: ``qk_head_dim ** -0.5``) and
    ``softcap`` are :class:`CoreAttention`'s."""

    def __init__(self, hidden_size: int, num_heads: int, config: MLAConfig, *, norm: Callable[[int], nn.Module],
                 rotary: nn.Module, attention_dropout: float, causal: bool = True, bias: bool = False,
                 window: Optional[int] = None, softmax_scale: Optional[float] = None,
                 softcap: Optional[float] = None) -> None:
        super().__init__()
        self.config = config
        qk, rope = config.qk_head_dim, config.qk_rope_head_dim
        if config.q_lora_rank is None:
            self.q = nn.Linear(hidden_size, num_heads * qk, bias=False)
        else:
            self.q_down = nn.Linear(hidden_size, config.q_lora_rank, bias=bias)
            self.q_down_norm = norm(config.q_lora_rank)
            self.q_up = nn.Linear(config.q_lora_rank, num_heads * qk, bias=False)
        self.kv_down = nn.Linear(hidden_size, config.kv_lora_rank + rope, bias=bias)
        self.kv_down_norm = norm(config.kv_lora_rank)
        self.kv_up = nn.Linear(config.kv_lora_rank, num_heads * (config.qk_nope_head_dim + config.v_head_dim),
                               bias=False)
        self.rotary = rotary
        self.width = max(qk, config.v_head_dim)  # what attention sees: the narrower of q/k and v padded to it
        scale = softmax_scale if softmax_scale is not None or self.width == qk else qk ** -0.5
        self.core_attention = CoreAttention(attention_dropout=attention_dropout, causal=causal, window=window,
                                            softmax_scale=scale, softcap=softcap)
        self.proj = nn.Linear(num_heads * config.v_head_dim, hidden_size, bias=bias)
        self.region = OneProcessRegion()  # the tensor-parallel region the latents enter (set by the plan)

    def forward(self, x: Tensor, attention_mask: Optional[Tensor] = None, positions: Optional[Tensor] = None,
                kv_cache=None) -> Tensor:
        """As ``SelfAttention.forward``; ``x`` is a sequence chunk under sequence parallelism."""
        config = self.config
        latent, k_rope = self.kv_down(x).split([config.kv_lora_rank, config.qk_rope_head_dim], dim=-1)
        parts = [self.kv_down_norm(latent), k_rope]
        if config.q_lora_rank is not None:
            parts.insert(0, self.q_down_norm(self.q_down(x)))
        entered = self.region.enter(torch.cat(parts, dim=-1))  # one collective for all of them
        batch, seq = entered.shape[:2]
        if config.q_lora_rank is None:
            q = self.q(x)
            latent, k_rope = entered.split([config.kv_lora_rank, config.qk_rope_head_dim], dim=-1)
        else:
            q_latent, latent, k_rope = entered.split(
                [config.q_lora_rank, config.kv_lora_rank, config.qk_rope_head_dim], dim=-1)
            q = self.q_up(q_latent)
        q = q.view(batch, seq, -1, config.qk_head_dim).transpose(1, 2)
        heads = q.shape[1]  # this rank's
        q_nope, q_rope = q.split([config.qk_nope_head_dim, config.qk_rope_head_dim], dim=-1)
        kv = self.kv_up(latent).view(batch, seq, heads, -1).transpose(1, 2)
        k_nope, v = kv.split([config.qk_nope_head_dim, config.v_head_dim], dim=-1)
        q_rope, k_rope = self.rotary(q_rope, k_rope.view(batch, seq, 1, -1).transpose(1, 2), positions)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, heads, -1, -1)], dim=-1)
        q, k, v = (F.pad(t, (0, self.width - t.shape[-1])) if t.shape[-1] < self.width else t for t in (q, k, v))
        causal = None
        if kv_cache is not None:
            k, v = kv_cache.append(self, k, v)
            attention_mask, causal = kv_cache.mask, kv_cache.causal
        y = self.core_attention(q, k, v, attention_mask, causal=causal)[..., :config.v_head_dim]
        return self.proj(y.transpose(1, 2).reshape(batch, seq, heads * config.v_head_dim))


def mla_tensor_parallel_plan(prefix: str, config: MLAConfig) -> dict[str, object]:
    """The attention of the layers under ``prefix``: the latents' region, the up projections split by heads inside
    it (``q`` by heads with its own communication when there is no query latent), ``proj`` row-parallel; attention
    dropout acts on this rank's heads. The down projections and norms stay replicated (the layer's
    ``"sequence_parallel"`` entry sums their gradients over tp under sequence parallelism)."""
    queries = ({f"{prefix}.attn.q": "column"} if config.q_lora_rank is None
               else {f"{prefix}.attn.q_up": InsideRegion("column")})
    # "experts_region": the style that hands a module its TensorParallelRegion (MoE layers' first user).
    return {f"{prefix}.attn": "experts_region", f"{prefix}.attn.core_attention": "sharded_dropout", **queries,
            f"{prefix}.attn.kv_up": InsideRegion("column"), f"{prefix}.attn.proj": "row"}


__all__ = ["MLAConfig", "MultiLatentAttention", "mla_tensor_parallel_plan"]
