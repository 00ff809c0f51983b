"""What an adapter is: the facts checkpoints and the model need about adapters without depending on how they are
attached (``peft.lora``), and the adapters' initial values, declared to ``parallel.initialize`` on import so that
every layout draws them by the same rule. Whether a name is an adapter's is ``parallel.names.is_adapter_name``."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lightning_megatron.parallel.initialize import declare_child_initializer
from lightning_megatron.parallel.names import ADAPTER_MODULES


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


declare_child_initializer(ADAPTER_MODULES, initialize_adapter)
