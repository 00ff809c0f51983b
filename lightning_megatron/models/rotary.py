"""Rotary position embeddings (Su et al. 2021), with Llama-3.1's, linear and YaRN frequency scaling.

Each head's channels are rotated in pairs ``(i, i + head_dim/2)`` by an angle proportional
to the position (the "rotate half" convention of Hugging Face's Llama and Megatron-Core, so
converted weights need no permutation). The module has no parameters: positions live in
``q`` and ``k``, which is why rotary models have no position table and work unchanged under
sequence parallelism (attention sees the whole sequence) and pipeline parallelism.

The rotation saves nothing for backward (:class:`_Rotate`): its gradient is the rotation by the opposite
angles, whose ``cos`` and ``sin`` backward looks up again. Autograd's own ``q * cos + rotate_half(q) * sin``
would save the ``[S, head_dim]`` tables in every layer: whole-sequence tables under tensor and sequence
parallelism, where ``q`` and ``k`` span the whole sequence, so a term no tensor-parallel split divides.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class RopeScaling:
    """A scaling of the rotary frequencies for long contexts, transformers' ``rope_type``:

    * ``"llama3"`` (Llama-3.1's): wavelengths longer than ``original_max_position_embeddings / low_freq_factor``
      are stretched by ``factor``, those shorter than ``... / high_freq_factor`` kept, and those in between
      interpolated smoothly.
    * ``"linear"`` (position interpolation; Gemma 3's global layers): every frequency divided by ``factor``; the
      other fields are not read.
    * ``"yarn"`` (Peng et al. 2023; GPT-OSS): channel pairs that turn fewer than ``beta_slow`` times over
      ``original_max_position_embeddings`` positions are divided by ``factor``, those turning more than ``beta_fast``
      times kept, a linear ramp between (its ends rounded outward when ``truncate``, transformers' default); ``cos``
      and ``sin`` are multiplied by ``attention_factor`` (None: ``0.1 ln(factor) + 1``, the paper's), which scales
      every attention score by its square.

    DeepSeek's YaRN adds ``mscale`` and ``mscale_all_dim`` (None: unset, as in transformers). With both set, the
    default ``attention_factor`` is ``m(mscale) / m(mscale_all_dim)``, ``m(x) = 0.1 x ln(factor) + 1``
    (DeepSeek-V3's 1.0 and 1.0 make it 1); ``mscale_all_dim`` alone leaves it the paper's. DeepSeek's attention also
    multiplies its softmax scale by ``m(mscale_all_dim) ** 2`` (:meth:`softmax_scale_factor`), every channel's
    scores, not just the rotary ones: that belongs to the attention, so a model carries it in
    ``GPTConfig.softmax_scale`` (the DeepSeek-V3 converter and preset set it).
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: Optional[float] = None
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None

    def __post_init__(self) -> None:
        if self.rope_type not in SCALINGS:
            raise ValueError(f"RopeScaling(rope_type={self.rope_type!r}) is not one of {sorted(SCALINGS)}.")
        if self.rope_type != "yarn" and (self.mscale, self.mscale_all_dim) != (None, None):
            raise ValueError(f"RopeScaling(rope_type={self.rope_type!r}, mscale={self.mscale}, mscale_all_dim="
                             f"{self.mscale_all_dim}): mscale and mscale_all_dim are YaRN's; use rope_type='yarn' or "
                             f"leave them None.")
        if self.factor < 1 or self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"RopeScaling needs factor >= 1 and high_freq_factor > low_freq_factor, got {self}.")

    def apply(self, inv_freq: Tensor, base: float) -> Tensor:
        """The scaled ``inv_freq`` (``[head_dim / 2]``, of rotary ``base``)."""
        return SCALINGS[self.rope_type](self, inv_freq, base)

    def cos_sin_factor(self) -> float:
        """What ``cos`` and ``sin`` are multiplied by: YaRN's attention factor, else 1."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return self._yarn_mscale(self.mscale) / self._yarn_mscale(self.mscale_all_dim)
        return self._yarn_mscale(1.0)

    def softmax_scale_factor(self) -> float:
        """What DeepSeek's attention multiplies its softmax scale by: ``m(mscale_all_dim) ** 2`` when YaRN's
        ``mscale_all_dim`` is set (and not 0), else 1 (class docstring)."""
        if self.rope_type != "yarn" or not self.mscale_all_dim:
            return 1.0
        return self._yarn_mscale(self.mscale_all_dim) ** 2

    def _yarn_mscale(self, mscale: float) -> float:
        """YaRN's ``0.1 mscale ln(factor) + 1`` (1 when ``factor`` <= 1)."""
        return 0.1 * mscale * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    def hf_parameters(self) -> dict:
        """transformers' ``rope_parameters`` / ``rope_scaling`` entries of this scaling (``rope_type`` and the
        fields it reads)."""
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        if self.rope_type == "yarn":
            return {"rope_type": "yarn", "factor": self.factor, "beta_fast": self.beta_fast,
                    "beta_slow": self.beta_slow, "truncate": self.truncate,
                    "original_max_position_embeddings": self.original_max_position_embeddings,
                    **{name: value for name, value in (("attention_factor", self.attention_factor),
                                                       ("mscale", self.mscale), ("mscale_all_dim", self.mscale_all_dim))
                       if value is not None}}
        return {"rope_type": self.rope_type, "factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}


def _llama3(scaling: RopeScaling, inv_freq: Tensor, base: float) -> Tensor:
    wavelength = 2 * math.pi / inv_freq
    low_freq_wavelength = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelength = scaling.original_max_position_embeddings / scaling.high_freq_factor
    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(medium, smoothed, scaled)


def _linear(scaling: RopeScaling, inv_freq: Tensor, base: float) -> Tensor:
    return inv_freq / scaling.factor


def _yarn(scaling: RopeScaling, inv_freq: Tensor, base: float) -> Tensor:
    """YaRN's blend of interpolated (``inv_freq / factor``) and kept frequencies, pair by pair (``RopeScaling``)."""
    dim = 2 * inv_freq.shape[0]

    def pair_turning(rotations: float) -> float:  # the (fractional) pair index that turns ``rotations`` times
        length = scaling.original_max_position_embeddings
        return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(scaling.beta_fast), pair_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a step, not a division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


#: ``RopeScaling.rope_type`` -> how it scales the inverse frequencies.
SCALINGS = {"llama3": _llama3, "linear": _linear, "yarn": _yarn}


def rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def inverse_frequencies(head_dim: int, base: float, scaling: Optional[RopeScaling], device=None) -> Tensor:
    """The rotation speed of each channel pair, ``[head_dim / 2]`` fp32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (base ** exponents)
    return inv_freq if scaling is None else scaling.apply(inv_freq, base)


def cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype, factor: float = 1.0) -> tuple[Tensor, Tensor]:
    """``cos`` and ``sin`` of every position's angles, ``[*positions.shape, head_dim]`` in ``dtype``, times ``factor``
    (YaRN's attention factor) in fp32 first."""
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def _factor(scaling: Optional[RopeScaling]) -> float:
    return 1.0 if scaling is None else scaling.cos_sin_factor()


@functools.lru_cache(maxsize=4)
def _cos_sin_from_zero(length: int, head_dim: int, base: float, scaling: Optional[RopeScaling], device: torch.device,
                       dtype: torch.dtype, inference: bool) -> tuple[Tensor, Tensor]:
    """The tables of positions ``0 .. length-1``: one copy for every layer (they all ask for the same ones, in
    forward and again in backward). ``inference``: tensors made under inference mode must stay there."""
    return cos_sin(torch.arange(length, device=device), inverse_frequencies(head_dim, base, scaling, device), dtype,
                   _factor(scaling))


def forget_tables() -> None:
    """Drop the cached position tables: a new world of fake tensors (``lightning-megatron simulate``, one rank after
    another) must make and count its own."""
    _cos_sin_from_zero.cache_clear()


class RotaryEmbedding(nn.Module):
    """Rotates ``q`` ``[B, heads, S, D]`` and ``k`` ``[B, kv_heads, S, D]`` by their positions.

    The angles are computed in fp32 (as Hugging Face's Llama does) and cast to the activations' dtype.
    """

    def __init__(self, head_dim: int, *, base: float = 10000.0, scaling: Optional[RopeScaling] = None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"Rotary position embeddings rotate channel pairs: head_dim={head_dim} must be even.")
        self.head_dim, self.base, self.scaling = head_dim, base, scaling

    def cos_sin(self, seq_length: int, positions: Optional[Tensor], device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The tables that broadcast against ``q`` ``[B, heads, S, D]``: of ``positions`` (``[S]`` or ``[B, S]``), or
        of ``0 .. seq_length-1`` (shared by every layer)."""
        if positions is None and torch.compiler.is_compiling():  # computed in the graph (no Python cache in it)
            positions = torch.arange(seq_length, device=device)
        if positions is None:
            return _cos_sin_from_zero(seq_length, self.head_dim, self.base, self.scaling, torch.device(device), dtype,
                                      torch.is_inference_mode_enabled())
        cos, sin = cos_sin(positions, inverse_frequencies(self.head_dim, self.base, self.scaling, positions.device),
                           dtype, _factor(self.scaling))
        if positions.dim() == 2:  # [B, S, D] -> [B, 1, S, D]: the same angles for every head
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return cos, sin

    def forward(self, q: Tensor, k: Tensor, positions: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """``positions``: ``[S]`` or ``[B, S]`` token positions (per sample: positions that restart at every
        document); by default ``0 .. S-1``."""
        return _Rotate.apply(q, k, positions, self)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}, scaling={self.scaling}"


class _Rotate(torch.autograd.Function):
    """``x * cos + rotate_half(x) * sin`` for ``q`` and ``k``, saving only ``positions`` (an input, if given).

    ``rotate_half`` is a rotation by a quarter turn in each channel pair, whose transpose is its negative, so the
    gradient of ``x`` is ``g * cos - rotate_half(g * sin)``."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, positions: Optional[Tensor], rotary: RotaryEmbedding):
        cos, sin = rotary.cos_sin(q.shape[-2], positions, q.device, q.dtype)
        ctx.save_for_backward(positions)
        ctx.rotary, ctx.seq_length, ctx.device, ctx.dtype = rotary, q.shape[-2], q.device, q.dtype
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    @staticmethod
    def backward(ctx, grad_q: Tensor, grad_k: Tensor):
        (positions,) = ctx.saved_tensors
        cos, sin = ctx.rotary.cos_sin(ctx.seq_length, positions, ctx.device, ctx.dtype)
        grads = [None if g is None else g * cos - rotate_half(g * sin) for g in (grad_q, grad_k)]
        return grads[0], grads[1], None, None
