"""Merging LoRA adapters into the weights they adapt: ``W' = W + scale * B @ A`` (``scale = alpha / rank``).

Pure tensors under our global names (``blocks.0.attn.proj.weight`` with its ``.lora_a.weight`` and
``.lora_b.weight``; a fused layer's per-projection adapters ``blocks.0.attn.qkv.lora_a.q.weight`` ..., whose updates
are laid out as the fused weight's rows), in one process: what an export of a fine-tuned model does with a full state dict or with a
few tensors of it at a time. The product is formed in fp32 and rounded once to the weight's dtype, as PEFT's
``merge_and_unload`` does for fp32 weights.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence

import torch
from torch import Tensor


def adapter_weight_names(layer: str, part: Optional[str] = None) -> tuple[str, str]:
    """The names of ``layer``'s ``A`` and ``B`` (``blocks.0.attn.proj`` -> ``...lora_a.weight``, ``...lora_b.weight``),
    or of one projection's (``blocks.0.attn.qkv``, ``"k"`` -> ``...lora_a.k.weight``, ``...lora_b.k.weight``)."""
    middle = "" if part is None else f".{part}"
    return f"{layer}.lora_a{middle}.weight", f"{layer}.lora_b{middle}.weight"


def layer_adapters(names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """The layers that carry an adapter, from the names of a state dict (or of a checkpoint's index), each with
    its adapted projections (``peft.lora``'s ``"canonical"`` adapters of a fused layer, in name order), or ``()``
    for one adapter over the whole layer."""
    layers: dict[str, list[str]] = {}
    for name in sorted(names):
        if ".lora_a." in name and name.endswith(".weight"):
            layer, rest = name.split(".lora_a.", 1)
            parts = layers.setdefault(layer, [])
            if rest != "weight":
                parts.append(rest.removesuffix(".weight"))
    return {layer: tuple(parts) for layer, parts in layers.items()}


def _delta(weight: Tensor, lora_a: Tensor, lora_b: Tensor, rows: int, what: str) -> Tensor:
    if lora_b.shape[0] != rows or lora_a.shape[1] != weight.shape[1] or lora_a.shape[0] != lora_b.shape[1]:
        raise ValueError(f"LoRA adapters A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)} do not fit {what} of "
                         f"{tuple(weight.shape)}: expected A [r, {weight.shape[1]}] and B [{rows}, r].")
    return lora_b.to(torch.float32) @ lora_a.to(torch.float32)


def merged_weight(weight: Tensor, lora_a: Tensor, lora_b: Tensor, scale: float) -> Tensor:
    """``weight + scale * lora_b @ lora_a`` in ``weight``'s dtype (``weight [out, in]``, ``lora_a [r, in]``,
    ``lora_b [out, r]``)."""
    delta = _delta(weight, lora_a, lora_b, weight.shape[0], "the weight")
    return (weight.to(torch.float32) + scale * delta).to(weight.dtype)


def merged_projections_weight(weight: Tensor, adapters: Mapping[str, tuple[Tensor, Tensor]], layout,
                              parts: Sequence[str], scale: float) -> Tensor:
    """A fused weight plus its projections' updates: ``adapters`` maps a projection to its ``(A, B)``; ``parts``
    are all the layer's projections (one left out adds nothing) and ``layout`` its tensor-parallel style, whose
    ``join`` lays the projections' rows out as the fused weight's (``peft.lora``)."""
    out = weight.shape[0]
    sizes = layout.part_sizes(out)
    deltas = [_delta(weight, *adapters[part], size, f"the {part} rows") if part in adapters
              else weight.new_zeros(size, weight.shape[1], dtype=torch.float32) for part, size in zip(parts, sizes)]
    delta = layout.join([d.T for d in deltas], out).T
    return (weight.to(torch.float32) + scale * delta).to(weight.dtype)
