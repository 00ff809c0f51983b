"""LoRA (Hu et al. 2021): a frozen linear layer plus a trained low-rank update, ``y = W x + (alpha / r) B A x``.

:func:`apply_lora` attaches the update to every ``nn.Linear`` whose module name matches one of the config's
``targets`` (``fnmatch`` patterns, ``*`` crossing dots: ``"*.attn.qkv"`` matches ``blocks.7.attn.qkv``) and
freezes every other parameter of the model. It works on the plain model, before any parallelism, and does
not rename anything the base model has:

* the base layer stays where it was, with its own parameter names (``blocks.7.attn.qkv.weight``), so the
  model still loads Hugging Face weights and base checkpoints as before;
* the update is two child modules of that layer, ``lora_a`` (``nn.Linear(in, r)``, weight ``[r, in]``) and
  ``lora_b`` (``nn.Linear(r, out)``, weight ``[out, r]``), with an optional ``lora_dropout`` on the input
  (PEFT's ``lora_A``/``lora_B``, whose names and shapes these follow);
* a forward hook of the base layer adds ``scale * lora_b(lora_a(dropout(x)))`` to its output, with ``x`` the
  layer's own input, whatever the layer has become since: the tensor-parallel plan swaps the base layer for a
  parallel one and keeps its submodules and hooks (``tensor_parallel.plan``), and ``peft.plan`` splits
  ``lora_a``/``lora_b`` consistently with it.

``B`` starts at zero, so the adapted model starts as the base model; ``A`` starts as PEFT's (Kaiming-uniform,
``U(-1/sqrt(in), 1/sqrt(in))``), drawn from a generator seeded by the parameter's global name like every other
parameter (``parallel.initialize``), so every layout starts from the same adapters.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_megatron.parallel.initialize import local_initial_values
from lightning_megatron.parallel.names import is_adapter_name
from lightning_megatron.peft.adapters import adapted_layers, initialize_adapter
from lightning_megatron.peft.nf4 import MARK as NF4_MARK, NF4Settings

#: Megatron Bridge's default: every linear layer of attention and the MLP.
DEFAULT_TARGETS = ("*.attn.qkv", "*.attn.proj", "*.mlp.fc", "*.mlp.proj")


@dataclass(frozen=True)
class LoRAConfig:
    """What :func:`apply_lora` attaches.

    Args:
        rank: ``r``, the inner dimension of ``B A``.
        alpha: the update is scaled by ``alpha / rank`` (PEFT's ``lora_alpha``).
        dropout: dropout on the adapter's input (PEFT's ``lora_dropout``); 0 by default.
        targets: ``fnmatch`` patterns of the module names to adapt (relative to the model, ``*`` crosses dots).
        quantize_base: ``"nf4"``: QLoRA, the adapted layers' frozen weights held in 4-bit NF4 (``peft.nf4``; or a
            dict with its block sizes, ``peft.nf4.NF4Settings``); ``None``: as loaded.

    Example::

        LoRAConfig(rank=16, alpha=32, targets=["*.attn.qkv", "*.attn.proj"])
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = field(default=DEFAULT_TARGETS)
    quantize_base: Optional[Union[str, dict, NF4Settings]] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "quantize_base", NF4Settings.of(self.quantize_base))
        if isinstance(self.targets, str):  # a string is a sequence of one-letter patterns
            raise ValueError(f"LoRA targets must be a list of patterns, got the string {self.targets!r}; "
                             f"write targets=[{self.targets!r}].")
        object.__setattr__(self, "targets", tuple(self.targets))
        if not self.targets:
            raise ValueError("LoRA needs at least one target pattern, e.g. targets=['*.attn.qkv'].")
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank!r}.")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be positive, got {self.alpha!r}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}.")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, value: Union["LoRAConfig", dict, None]) -> Optional["LoRAConfig"]:
        """A config from itself, a dict of its fields (a YAML ``lora:`` block), or ``None``."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"rank", "alpha", "dropout", "targets", "quantize_base"}
            if unknown:
                raise ValueError(f"Unknown LoRA settings {sorted(unknown)}; the settings are rank, alpha, dropout, "
                                 f"targets, quantize_base.")
            return cls(**value)
        raise ValueError(f"lora must be a LoRAConfig or a dict of its fields, got {type(value).__name__}.")

    def as_dict(self) -> dict[str, Any]:
        quantize = None if self.quantize_base is None else self.quantize_base.as_setting()
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets),
                "quantize_base": quantize}


def _add_low_rank_update(layer: nn.Module, args: tuple, output: Tensor) -> Tensor:
    x = args[0]
    dropout = getattr(layer, "lora_dropout", None)
    if dropout is not None:
        x = dropout(x)
    return output + layer.lora_b(layer.lora_a(x)) * layer.lora_scale


def _targets(module: nn.Module, config: LoRAConfig) -> list[str]:
    matched = {pattern: [name for name, _ in module.named_modules() if name and fnmatch.fnmatchcase(name, pattern)]
               for pattern in config.targets}
    empty = [pattern for pattern, names in matched.items() if not names]
    if empty:
        examples = [name for name, layer in module.named_modules() if isinstance(layer, nn.Linear)][:6]
        raise ValueError(f"LoRA targets {empty} match no module of {type(module).__name__}; its linear layers are "
                         f"named like {examples}.")
    names = [name for name, _ in module.named_modules() if any(name in found for found in matched.values())]
    wrong = {name: type(module.get_submodule(name)).__name__ for name in names
             if not isinstance(module.get_submodule(name), nn.Linear)}
    if wrong:
        raise ValueError(f"LoRA adapts nn.Linear layers only, but the targets match {wrong}: narrow the patterns "
                         f"(e.g. '*.attn.qkv' rather than '*.attn').")
    return names


def apply_lora(module: nn.Module, config: LoRAConfig, *, seed: Optional[int] = None) -> list[str]:
    """Attach ``config``'s adapters to ``module`` (in place) and freeze everything else; returns the adapted names.

    Call it on the plain model, before the tensor-parallel plan. Adapters of a model on the meta device stay on
    meta (the strategy materialises them with every other parameter); on a real model they are initialised here,
    from ``seed`` (default ``torch.initial_seed()``), exactly as the strategy would.

    Example::

        model = GPT.from_hf("hf_dir").model
        apply_lora(model, LoRAConfig(rank=8, alpha=16))
    """
    if adapted_layers(module):
        raise ValueError(f"{type(module).__name__} already carries LoRA adapters ({adapted_layers(module)[:3]}...); "
                         f"apply LoRA once.")
    names = _targets(module, config)
    for param in module.parameters():
        param.requires_grad_(False)
    for name in names:
        layer = module.get_submodule(name)
        kwargs = {"device": layer.weight.device, "dtype": layer.weight.dtype}
        layer.lora_a = nn.Linear(layer.in_features, config.rank, bias=False, **kwargs)
        layer.lora_b = nn.Linear(config.rank, layer.out_features, bias=False, **kwargs)
        if config.dropout:
            layer.lora_dropout = nn.Dropout(config.dropout)
        layer.lora_scale = config.scale
        layer.register_forward_hook(_add_low_rank_update)
        if config.quantize_base is not None:  # quantised where the global weight is (peft.nf4)
            setattr(layer, NF4_MARK, config.quantize_base)
    if not any(p.is_meta for p in module.parameters()):
        _initialize_adapters(module, torch.initial_seed() if seed is None else seed)
    return names


def _initialize_adapters(module: nn.Module, seed: int) -> None:
    """The adapters' start, by the one rule the strategy uses too (``local_initial_values`` picks the adapter's)."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if is_adapter_name(name):
                param.copy_(local_initial_values(param, name, seed, initialize_adapter))
