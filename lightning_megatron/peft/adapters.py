"""What an adapter is, by name: the few facts that parameter initialisation, the tensor-parallel plan, FP8 and
checkpoints need about adapters without depending on how they are attached (``peft.lora``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

#: The child modules an adapted layer gets; a parameter under one of them is an adapter parameter.
ADAPTER_MODULES = ("lora_a", "lora_b")


def is_adapter_name(name: str) -> bool:
    """Whether a parameter or module name lies inside an adapter (``...qkv.lora_a.weight``)."""
    return any(part in ADAPTER_MODULES for part in name.split("."))


def adapted_layers(module: nn.Module) -> list[str]:
    """The names of the layers of ``module`` that carry an adapter, in module order."""
    return [name for name, layer in module.named_modules() if isinstance(getattr(layer, "lora_a", None), nn.Module)]


def initialize_adapter(name: str, tensor: Tensor, generator: torch.Generator) -> None:
    """PEFT's initial adapters: ``lora_a`` Kaiming-uniform (``U(-1/sqrt(in), 1/sqrt(in))``), ``lora_b`` zero."""
    if ".lora_b." in f".{name}":
        tensor.zero_()
    else:
        bound = 1.0 / math.sqrt(tensor.shape[-1])
        tensor.uniform_(-bound, bound, generator=generator)
