"""The normalisations a transformer layer can use: LayerNorm (GPT-2, BERT), RMSNorm (Llama and its kin) or
ZeroCenteredRMSNorm (Gemma)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

NORMALIZATIONS = ("LayerNorm", "RMSNorm", "ZeroCenteredRMSNorm")


def rms_normalized(x: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x^2) + eps)`` in fp32, whatever ``x``'s dtype: what both RMSNorms scale by their gains."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` (Zhang & Sennrich 2019): LayerNorm without centring or bias.

    The statistics are computed in fp32 whatever the input dtype, as Llama's reference code and
    Megatron-Core's do; under 16-bit training a 16-bit mean of squares loses the small channels.
    """

    def __init__(self, size: int, *, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * rms_normalized(x, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose gain is stored as its offset from one: ``x / sqrt(mean(x^2) + eps) * (1 + weight)``.

    Gemma's (transformers' ``Gemma3RMSNorm``; Megatron-Core's ``layernorm_zero_centered_gamma``): the weight starts
    at zero, so the norm starts as a plain normalisation and weight decay pulls the gain towards one, not towards
    zero. Unlike :class:`RMSNorm` the gain is applied in fp32 and the product cast afterwards, as Gemma's reference
    code does (``RMSNorm`` casts the normalised input first, as Llama's): in 16 bits the two round differently.
    """

    def __init__(self, size: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size))

    def forward(self, x: Tensor) -> Tensor:
        return (rms_normalized(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)

    @staticmethod
    def initialize_own_parameter(name: str, tensor: Tensor, generator: torch.Generator) -> None:
        """The gain's offset starts at zero, whatever model holds the norm (``parallel.initialize``)."""
        tensor.zero_()

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def build_norm(kind: str, size: int, *, eps: float) -> nn.Module:
    """A norm by its config name (one of ``NORMALIZATIONS``)."""
    if kind == "LayerNorm":
        return nn.LayerNorm(size, eps=eps)
    if kind == "RMSNorm":
        return RMSNorm(size, eps=eps)
    if kind == "ZeroCenteredRMSNorm":
        return ZeroCenteredRMSNorm(size, eps=eps)
    raise ValueError(f"normalization={kind!r} is not one of {NORMALIZATIONS}.")
