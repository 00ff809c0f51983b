"""Transformer building blocks in plain PyTorch: no process groups in sight.

Under tensor parallelism the strategy swaps ``qkv``/``fc`` for column-parallel and
``proj`` for row-parallel layers. The fused ``qkv`` output is laid out head by head
(``[head, (q, k, v), head_dim]``), so a contiguous column split hands each rank whole
heads, and ``SelfAttention`` reads its local head count from its weight.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch.nn.functional as F
from torch import Tensor, nn


class CoreAttention(nn.Module):
    """``dropout(softmax(q k^T / sqrt(d))) v``, without parameters.

    A module of its own so that selective activation recomputation (Korthikanti et al.
    2022) can recompute just this part: its saved activations grow with the square of the
    sequence length while its FLOPs are a small share of the layer's.
    """

    def __init__(self, *, attention_dropout: float, causal: bool) -> None:
        super().__init__()
        self.attention_dropout, self.causal = attention_dropout, causal

    def forward(self, q: Tensor, k: Tensor, v: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attention_mask,
            dropout_p=self.attention_dropout if self.training else 0.0,
            is_causal=self.causal and attention_mask is None,
        )


class SelfAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, *, attention_dropout: float, causal: bool) -> None:
        super().__init__()
        self.head_dim = hidden_size // num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.core_attention = CoreAttention(attention_dropout=attention_dropout, causal=causal)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        qkv = self.qkv(x)
        batch, seq = qkv.shape[:2]  # the full sequence, also when x is a sequence-parallel chunk
        local_heads = self.qkv.weight.shape[0] // (3 * self.head_dim)
        q, k, v = qkv.view(batch, seq, local_heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        y = self.core_attention(q, k, v, attention_mask)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, local_heads * self.head_dim))


class MLP(nn.Module):
    """``proj(gelu(fc(x)))``; ``gelu_approximate`` is torch's: ``"tanh"`` (GPT-2) or ``"none"`` (exact erf, BERT)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, gelu_approximate: str = "tanh") -> None:
        super().__init__()
        self.fc = nn.Linear(hidden_size, ffn_hidden_size)
        self.proj = nn.Linear(ffn_hidden_size, hidden_size)
        self.gelu_approximate = gelu_approximate

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.gelu_approximate))


class TransformerLayer(nn.Module):
    """Pre-norm layer: ``x + drop(attn(ln(x)))`` then ``x + drop(mlp(ln(x)))``.

    ``norm_position="post"`` gives the original Transformer/BERT order,
    ``ln(x + drop(attn(x)))`` then ``ln(x + drop(mlp(x)))``; pre-norm is what lets deep
    models train stably (Megatron-LM's BERT finding), post-norm matches Hugging Face BERT.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        ffn_hidden_size: int,
        *,
        dropout: float,
        attention_dropout: float,
        causal: bool,
        layer_norm_eps: float = 1e-5,
        norm_position: str = "pre",
        gelu_approximate: str = "tanh",
    ) -> None:
        super().__init__()
        if norm_position not in ("pre", "post"):
            raise ValueError(f"norm_position must be 'pre' or 'post', got {norm_position!r}.")
        self.post_norm = norm_position == "post"
        self.ln_1 = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.attn = SelfAttention(hidden_size, num_heads, attention_dropout=attention_dropout, causal=causal)
        self.ln_2 = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.mlp = MLP(hidden_size, ffn_hidden_size, gelu_approximate=gelu_approximate)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        if self.post_norm:
            x = self.ln_1(x + self.drop(self.attn(x, attention_mask)))
            return self.ln_2(x + self.drop(self.mlp(x)))
        x = x + self.drop(self.attn(self.ln_1(x), attention_mask))
        return x + self.drop(self.mlp(self.ln_2(x)))


def layer_tensor_parallel_plan(prefix: str) -> dict[str, str]:
    """The plan of every ``TransformerLayer`` under ``prefix`` (e.g. ``"blocks.*"``)."""
    return {
        prefix: "sequence_parallel",
        f"{prefix}.attn": "sharded_dropout",
        f"{prefix}.attn.qkv": "column",
        f"{prefix}.attn.proj": "row",
        f"{prefix}.mlp.fc": "column",
        f"{prefix}.mlp.proj": "row",
    }


class TransformerSizes:
    """What GPTConfig and BERTConfig share: presets by name, head and tensor-parallel checks.

    Subclasses are frozen dataclasses with ``hidden_size``, ``num_heads`` and ``ffn_hidden_size``
    fields, and name their presets with ``presets()``.
    """

    @classmethod
    def presets(cls) -> dict:
        raise NotImplementedError

    def _check_heads(self) -> None:
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}: "
                f"each head needs hidden_size / num_heads channels."
            )

    @property
    def ffn_size(self) -> int:
        """``ffn_hidden_size``, by default ``4 * hidden_size``."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @classmethod
    def from_name(cls, name: str, **overrides):
        """A preset by name, optionally with some fields changed."""
        presets = cls.presets()
        if name not in presets:
            raise ValueError(f"Unknown {cls.__name__[:-6]} preset {name!r}. Available presets: {', '.join(sorted(presets))}.")
        return replace(presets[name], **overrides)

    def validate_tensor_parallel_size(self, tensor_parallel_size: int) -> None:
        check_tensor_parallel_split(tensor_parallel_size, num_heads=self.num_heads, ffn_size=self.ffn_size)


def check_tensor_parallel_split(tensor_parallel_size: int, *, num_heads: int, ffn_size: int) -> None:
    """Fail with the numbers and a fix when a transformer cannot be split ``tensor_parallel_size`` ways."""
    tp = tensor_parallel_size
    problems = [f"{name}={value}" for name, value in (("num_heads", num_heads), ("ffn_hidden_size", ffn_size)) if value % tp]
    if problems:
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0 and ffn_size % d == 0]
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide {' and '.join(problems)}: every rank must hold whole "
            f"attention heads and an equal share of the MLP. Use a tensor_parallel_size in {divisors}."
        )
