"""The normalisations a transformer layer can use: LayerNorm (GPT-2, BERT) or RMSNorm (Llama and its kin)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


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
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def build_norm(kind: str, size: int, *, eps: float) -> nn.Module:
    """A norm by its config name (``"LayerNorm"`` or ``"RMSNorm"``)."""
    if kind == "LayerNorm":
        return nn.LayerNorm(size, eps=eps)
    if kind == "RMSNorm":
        return RMSNorm(size, eps=eps)
    raise ValueError(f"normalization={kind!r} is not one of {NORMALIZATIONS}.")
