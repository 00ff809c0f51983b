"""Merging LoRA adapters into the weights they adapt: ``W' = W + scale * B @ A`` (``scale = alpha / rank``).

Pure tensors under our global names (``blocks.0.attn.qkv.weight`` with its ``.lora_a.weight`` and
``.lora_b.weight``), in one process: what an export of a fine-tuned model does with a full state dict or with a
few tensors of it at a time. The product is formed in fp32 and rounded once to the weight's dtype, as PEFT's
``merge_and_unload`` does for fp32 weights.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor


def adapter_weight_names(layer: str) -> tuple[str, str]:
    """The names of ``layer``'s ``A`` and ``B`` (``blocks.0.attn.qkv`` -> ``...lora_a.weight``, ``...lora_b.weight``)."""
    return f"{layer}.lora_a.weight", f"{layer}.lora_b.weight"


def adapted_layer_names(names: Iterable[str]) -> list[str]:
    """The layers that carry an adapter, from the names of a state dict (or of a checkpoint's index)."""
    suffix = ".lora_a.weight"
    return sorted(name[: -len(suffix)] for name in names if name.endswith(suffix))


def merged_weight(weight: Tensor, lora_a: Tensor, lora_b: Tensor, scale: float) -> Tensor:
    """``weight + scale * lora_b @ lora_a`` in ``weight``'s dtype (``weight [out, in]``, ``lora_a [r, in]``,
    ``lora_b [out, r]``)."""
    if lora_b.shape[0] != weight.shape[0] or lora_a.shape[1] != weight.shape[1] or lora_a.shape[0] != lora_b.shape[1]:
        raise ValueError(f"LoRA adapters A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)} do not fit the weight "
                         f"{tuple(weight.shape)}: expected A [r, {weight.shape[1]}] and B [{weight.shape[0]}, r].")
    delta = lora_b.to(torch.float32) @ lora_a.to(torch.float32)
    return (weight.to(torch.float32) + scale * delta).to(weight.dtype)

