"""Rotary position embeddings (Su et al. 2021), with Llama-3.1's frequency scaling.

Each head's channels are rotated in pairs ``(i, i + head_dim/2)`` by an angle proportional
to the position (the "rotate half" convention of Hugging Face's Llama and Megatron-Core, so
converted weights need no permutation). The module has no parameters: positions live in
``q`` and ``k``, which is why rotary models have no position table and work unchanged under
sequence parallelism (attention sees the whole sequence) and pipeline parallelism.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1's scaling of the rotary frequencies for long contexts (``rope_type="llama3"``).

    Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are
    stretched by ``factor``, those shorter than ``... / high_freq_factor`` kept, and those in
    between interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.factor < 1 or self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"RopeScaling needs factor >= 1 and high_freq_factor > low_freq_factor, got {self}.")

    def apply(self, inv_freq: Tensor) -> Tensor:
        wavelength = 2 * math.pi / inv_freq
        low_freq_wavelength = self.original_max_position_embeddings / self.low_freq_factor
        high_freq_wavelength = self.original_max_position_embeddings / self.high_freq_factor
        scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position_embeddings / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
        return torch.where(medium, smoothed, scaled)


def rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotates ``q`` ``[B, heads, S, D]`` and ``k`` ``[B, kv_heads, S, D]`` by their positions.

    The angles are computed in fp32 (as Hugging Face's Llama does) and cast to the activations' dtype.
    """

    def __init__(self, head_dim: int, *, base: float = 10000.0, scaling: Optional[RopeScaling] = None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"Rotary position embeddings rotate channel pairs: head_dim={head_dim} must be even.")
        self.head_dim, self.base, self.scaling = head_dim, base, scaling
        self._cache: Optional[tuple[tuple, Tensor, Tensor]] = None

    def inverse_frequencies(self, device=None) -> Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        inv_freq = 1.0 / (self.base ** exponents)
        return inv_freq if self.scaling is None else self.scaling.apply(inv_freq)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``cos`` and ``sin`` of every position's angles, ``[*positions.shape, head_dim]`` in ``dtype``."""
        angles = positions.float()[..., None] * self.inverse_frequencies(positions.device)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, q: Tensor, k: Tensor, positions: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """``positions``: ``[S]`` or ``[B, S]`` token positions (per sample: positions that restart at every
        document); by default ``0 .. S-1``, whose angles are cached for the last (length, device, dtype) seen:
        every layer of a forward pass asks for the same ones."""
        if positions is not None:
            cos, sin = self.cos_sin(positions, q.dtype)
            if positions.dim() == 2:  # [B, S, D] -> [B, 1, S, D]: the same angles for every head
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        else:
            key = (q.shape[-2], q.device, q.dtype, torch.is_inference_mode_enabled())  # inference tensors stay there
            if self._cache is None or self._cache[0] != key:
                self._cache = (key, *self.cos_sin(torch.arange(q.shape[-2], device=q.device), q.dtype))
            cos, sin = self._cache[1], self._cache[2]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}, scaling={self.scaling}"
