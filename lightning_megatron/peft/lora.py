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

Layers that fuse several projections of the original architecture (the model declares them:
``fused_projections()``, e.g. ``blocks.*.attn.qkv`` -> ``q``, ``k``, ``v`` and a SwiGLU ``blocks.*.mlp.fc`` ->
``gate``, ``up``) get one of two parameterisations, ``LoRAConfig.variant``:

* ``"canonical"`` (the default; PEFT's, and Megatron Bridge's ``CanonicalLoRA``): an adapter per projection, as
  PEFT attaches to Llama's ``q_proj``, ``k_proj``, ... ``lora_a`` and ``lora_b`` are ``nn.ModuleDict``s keyed by
  projection (``blocks.0.attn.qkv.lora_a.q.weight`` ``[r, in]``, ``...lora_b.k.weight`` ``[out_k, r]``), and the hook
  lays the projections' updates out as the fused output (the layer's tensor-parallel style's ``join``, the same
  at every layout). A target may name one projection, ``"*.attn.qkv.q"``; a projection left out adds nothing.
  At rank ``r`` this trains ``r * (3 in + out_q + out_k + out_v)`` numbers for a ``qkv``;
* ``"fused"`` (Megatron Bridge's ``LoRA``, its "performant" variant): one ``A`` shared by the fused projections and
  one ``B`` over the whole fused output, as for any single layer: fewer GEMMs and ``2 r in`` fewer numbers for a
  ``qkv`` (``r in`` for ``[gate | up]``), but not PEFT's model: a run parts from PEFT's after a few steps, and its
  export shares one ``A`` among the projections' PEFT adapters.

Layers of one projection (``attn.proj``, ``mlp.proj``, GPT-2's ``c_attn``, which is one module in GPT-2 too) are
the same under both.

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
from lightning_megatron.parallel.names import is_adapter_name, name_matches
from lightning_megatron.peft.adapters import adapted_layers, initialize_adapter
from lightning_megatron.peft.nf4 import MARK as NF4_MARK, NF4Settings
from lightning_megatron.tensor_parallel.styles import PackedColumn, QueryGroupColumn

#: Megatron Bridge's default: every linear layer of attention and the MLP.
DEFAULT_TARGETS = ("*.attn.qkv", "*.attn.proj", "*.mlp.fc", "*.mlp.proj")
#: ``"canonical"``: an adapter per projection of the original architecture (PEFT's); ``"fused"``: one per layer.
VARIANTS = ("canonical", "fused")
FIELDS = ("rank", "alpha", "dropout", "targets", "variant", "quantize_base")


@dataclass(frozen=True)
class LoRAConfig:
    """What :func:`apply_lora` attaches.

    Args:
        rank: ``r``, the inner dimension of ``B A``.
        alpha: the update is scaled by ``alpha / rank`` (PEFT's ``lora_alpha``).
        dropout: dropout on the adapter's input (PEFT's ``lora_dropout``); 0 by default.
        targets: ``fnmatch`` patterns of the module names to adapt (relative to the model, ``*`` crosses dots);
            under ``"canonical"`` also of one projection of a fused layer (``"*.attn.qkv.q"``).
        variant: ``"canonical"`` (an adapter per projection, PEFT's) or ``"fused"`` (one adapter over each fused
            layer, Megatron Bridge's performant LoRA; what this package trained before it had the canonical one):
            see the module.
        quantize_base: ``"nf4"``: QLoRA, the adapted layers' frozen weights held in 4-bit NF4 (``peft.nf4``; or a
            dict with its block sizes, ``peft.nf4.NF4Settings``); ``None``: as loaded.

    Example::

        LoRAConfig(rank=16, alpha=32, targets=["*.attn.qkv", "*.attn.proj"])
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = field(default=DEFAULT_TARGETS)
    variant: str = "canonical"
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
        if self.variant not in VARIANTS:
            raise ValueError(f"LoRA variant must be one of {list(VARIANTS)}, got {self.variant!r}: 'canonical' is "
                             f"PEFT's adapter per projection, 'fused' one adapter over each fused layer.")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, value: Union["LoRAConfig", dict, None]) -> Optional["LoRAConfig"]:
        """A config from itself, a dict of its fields (a YAML ``lora:`` block), or ``None``."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(FIELDS)
            if unknown:
                raise ValueError(f"Unknown LoRA settings {sorted(unknown)}; the settings are {', '.join(FIELDS)}.")
            return cls(**value)
        raise ValueError(f"lora must be a LoRAConfig or a dict of its fields, got {type(value).__name__}.")

    def as_dict(self) -> dict[str, Any]:
        quantize = None if self.quantize_base is None else self.quantize_base.as_setting()
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets),
                "variant": self.variant, "quantize_base": quantize}


def _dropped(layer: nn.Module, x: Tensor) -> Tensor:
    dropout = getattr(layer, "lora_dropout", None)
    return x if dropout is None else dropout(x)


def _add_low_rank_update(layer: nn.Module, args: tuple, output: Tensor) -> Tensor:
    return output + layer.lora_b(layer.lora_a(_dropped(layer, args[0]))) * layer.lora_scale


def _add_projection_updates(layer: nn.Module, args: tuple, output: Tensor) -> Tensor:
    """A fused layer's canonical adapters: each projection's update (its own dropout mask, as PEFT's separate
    modules draw), zero for a projection left out, laid out as the layer's (local) output."""
    layout, x = layer.lora_layout, args[0]
    sizes = layout.local_part_sizes(output.shape[-1], layer.out_features)
    updates = [layer.lora_b[part](layer.lora_a[part](_dropped(layer, x))) if part in layer.lora_a
               else output.new_zeros(*output.shape[:-1], size) for part, size in zip(layer.lora_parts, sizes)]
    return output + layout.join(updates, layer.out_features) * layer.lora_scale


def fused_layers(module: nn.Module) -> dict[str, tuple[Union[PackedColumn, QueryGroupColumn], tuple[str, ...]]]:
    """The layers of ``module`` that fuse projections (its ``fused_projections()``, none without it), each with
    its tensor-parallel layout style (from its ``tensor_parallel_plan()``: where each projection lies in the
    fused output) and the projections' names, in the fused output's order."""
    declared = module.fused_projections() if hasattr(module, "fused_projections") else {}
    plan = module.tensor_parallel_plan() if declared else {}
    found = {}
    for name, _ in module.named_modules():
        parts = next((tuple(parts) for pattern, parts in declared.items() if name_matches(pattern, name)), None)
        if parts is None:
            continue
        styles = [style for pattern, style in plan.items()
                  if name_matches(pattern, name) and isinstance(style, (PackedColumn, QueryGroupColumn))]
        if len(styles) != 1 or len(styles[0].part_styles()) != len(parts):
            raise ValueError(f"{type(module).__name__} declares {name} as the fused projections {parts}, but its "
                             f"tensor-parallel plan gives it {styles or 'no'} layout style with as many parts; "
                             f"declare the layer's PackedColumn or QueryGroupColumn in tensor_parallel_plan().")
        found[name] = (styles[0], parts)
    return found


def _targets(module: nn.Module, config: LoRAConfig,
             fused: dict[str, tuple[object, tuple[str, ...]]]) -> dict[str, Optional[tuple[str, ...]]]:
    """Adapted layer -> the projections adapted (``None``: the layer as one, with one adapter)."""
    matched: set[str] = set()
    chosen: dict[str, Optional[tuple[str, ...]]] = {}
    for name, _ in module.named_modules():
        if not name:
            continue
        whole = [pattern for pattern in config.targets if fnmatch.fnmatchcase(name, pattern)]
        parts = fused[name][1] if config.variant == "canonical" and name in fused else ()
        by_part = {part: [pattern for pattern in config.targets if fnmatch.fnmatchcase(f"{name}.{part}", pattern)]
                   for part in parts}
        matched.update(whole, *by_part.values())
        if whole or any(by_part.values()):
            chosen[name] = (parts if whole else tuple(part for part in parts if by_part[part])) if parts else None
    empty = [pattern for pattern in config.targets if pattern not in matched]
    if empty:
        examples = [name for name, layer in module.named_modules() if isinstance(layer, nn.Linear)][:6]
        projections = [f"{name}.{part}" for name, (_, parts) in list(fused.items())[:1] for part in parts]
        hint = (f"; under variant='canonical' one projection of a fused layer is a target too, e.g. {projections}"
                if projections else "")
        raise ValueError(f"LoRA targets {empty} match no module of {type(module).__name__}; its linear layers are "
                         f"named like {examples}{hint}.")
    wrong = {name: type(module.get_submodule(name)).__name__ for name in chosen
             if not isinstance(module.get_submodule(name), nn.Linear)}
    if wrong:
        raise ValueError(f"LoRA adapts nn.Linear layers only, but the targets match {wrong}: narrow the patterns "
                         f"(e.g. '*.attn.qkv' rather than '*.attn').")
    return chosen


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
    fused = fused_layers(module)
    targets = _targets(module, config, fused)
    for param in module.parameters():
        param.requires_grad_(False)
    for name, parts in targets.items():
        layer = module.get_submodule(name)
        kwargs = {"device": layer.weight.device, "dtype": layer.weight.dtype, "bias": False}
        if parts is None:
            layer.lora_a = nn.Linear(layer.in_features, config.rank, **kwargs)
            layer.lora_b = nn.Linear(config.rank, layer.out_features, **kwargs)
        else:
            layer.lora_layout, layer.lora_parts = fused[name]
            sizes = dict(zip(layer.lora_parts, layer.lora_layout.part_sizes(layer.out_features)))
            layer.lora_a = nn.ModuleDict({part: nn.Linear(layer.in_features, config.rank, **kwargs) for part in parts})
            layer.lora_b = nn.ModuleDict({part: nn.Linear(config.rank, sizes[part], **kwargs) for part in parts})
        if config.dropout:
            layer.lora_dropout = nn.Dropout(config.dropout)
        layer.lora_scale = config.scale
        layer.register_forward_hook(_add_low_rank_update if parts is None else _add_projection_updates)
        if config.quantize_base is not None:  # quantised where the global weight is (peft.nf4)
            setattr(layer, NF4_MARK, config.quantize_base)
    names = list(targets)
    if not any(p.is_meta for p in module.parameters()):
        _initialize_adapters(module, torch.initial_seed() if seed is None else seed)
    return names


def _initialize_adapters(module: nn.Module, seed: int) -> None:
    """The adapters' start, by the one rule the strategy uses too (``local_initial_values`` picks the adapter's)."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if is_adapter_name(name):
                param.copy_(local_initial_values(param, name, seed, initialize_adapter))
