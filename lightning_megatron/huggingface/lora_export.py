"""What ``lightning-megatron checkpoint convert`` does with a checkpoint of a LoRA run (``hyper_parameters["lora"]``).

* The merged model: every adapted weight becomes ``W + scale * B @ A`` (``peft.merge``; a fused layer's per-projection
  updates laid out as its rows), the adapters' own
  entries disappear, and the result is a plain model that ``write_hf`` exports like any other. The base ``W``
  comes from the checkpoint itself when it stores it (a LoRA run without ``pretrained``), read a few tensors at a
  time; from the Hugging Face directory its reference names when the checkpoint stores adapters only
  (``checkpoint.base``), after checking that directory's fingerprint. That directory is read whole: the export
  then holds the base model in memory once.
* The adapters alone, as a PEFT adapter directory (``huggingface.adapters``).

``GPT.to_hf`` of a module that carries adapters writes the merged model the same way (``write_merged_hf``), from
the module's own state dict.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor

from lightning_megatron.checkpoint.base import check_base
from lightning_megatron.huggingface.convert import read_hf, write_hf
from lightning_megatron.huggingface.family import TensorSource
from lightning_megatron.models.gpt import GPTConfig, GPTModel
from lightning_megatron.parallel.names import is_adapter_name
from lightning_megatron.peft.lora import LoRAConfig, fused_layers
from lightning_megatron.peft.merge import adapter_weight_names, layer_adapters, merged_projections_weight, merged_weight


def fused_layouts(config: GPTConfig) -> dict[str, tuple[Any, tuple[str, ...]]]:
    """The layers of ``config``'s model that fuse projections: layer -> (layout style, projection names)
    (``peft.lora.fused_layers`` of the model, built on the meta device)."""
    with torch.device("meta"):
        return fused_layers(GPTModel(config))


def adapter_tensors(tensors: TensorSource) -> dict[str, Tensor]:
    """Every adapter of a checkpoint's model tensors (our names), read."""
    names = [name for name in tensors.specs if is_adapter_name(name)]
    if not names:
        raise ValueError("The checkpoint's hyper-parameters name LoRA settings, but it holds no adapter tensors.")
    return dict(tensors.read(names))


def base_source(tensors: TensorSource, reference: Optional[Mapping[str, Any]], *, where: str) -> TensorSource:
    """The frozen base's tensors: the reference's Hugging Face directory (checked), else the checkpoint's own."""
    if reference is None:
        specs = {name: spec for name, spec in tensors.specs.items() if not is_adapter_name(name)}
        return TensorSource(specs, tensors.read)
    _, state_dict = read_hf(check_base(reference, None, where=where))
    return TensorSource.of(state_dict)


def merged_source(tensors: TensorSource, scale: float, reference: Optional[Mapping[str, Any]], config: GPTConfig, *,
                  where: str) -> TensorSource:
    """The merged model's tensors (see the module), read a few at a time like ``tensors``; ``config``: the model's
    (which layers fuse projections, for adapters per projection)."""
    base = base_source(tensors, reference, where=where)
    adapted, fused = layer_adapters(tensors.specs), fused_layouts(config)

    def merged(layer: str, weight: Tensor) -> Tensor:
        parts = adapted[layer]
        if not parts:
            names_a_b = adapter_weight_names(layer)
            pair = tensors.read(list(names_a_b))
            return merged_weight(weight, pair[names_a_b[0]], pair[names_a_b[1]], scale)
        if layer not in fused:
            raise ValueError(f"{where} holds adapters of the projections {list(parts)} of {layer}, which does not fuse "
                             f"projections in this model.")
        pairs = {part: adapter_weight_names(layer, part) for part in parts}
        read_pairs = tensors.read([name for pair in pairs.values() for name in pair])
        layout, all_parts = fused[layer]
        return merged_projections_weight(weight, {part: (read_pairs[a], read_pairs[b]) for part, (a, b) in pairs.items()},
                                         layout, all_parts, scale)

    def read(names: Sequence[str]) -> dict[str, Tensor]:
        values = dict(base.read(list(names)))
        for name in names:
            layer = name.removesuffix(".weight")
            if name.endswith(".weight") and layer in adapted:
                values[name] = merged(layer, values[name])
        return values

    return TensorSource(base.specs, read)


def write_merged_hf(out_dir, config, state_dict: Mapping[str, Tensor], *, lora: Optional[LoRAConfig] = None,
                    **kwargs: Any) -> list[str]:
    """``write_hf`` of a module's state dict, its LoRA adapters (``lora``: their settings) merged into the weights
    they adapt first, as ``checkpoint convert`` merges a checkpoint's. A QLoRA module holds its base in 4 bits, not
    as weights to merge into: it is refused, naming the exports that read the base again."""
    if not any(is_adapter_name(name) for name in state_dict):
        return write_hf(out_dir, config, state_dict, **kwargs)
    if lora is None:
        raise ValueError("The state dict holds LoRA adapters: pass the LoRA settings (lora=...) to merge them.")
    if lora.quantize_base is not None:
        raise ValueError("to_hf of a QLoRA module: its base is held in 4-bit NF4, not as weights the adapters could be "
                         "merged into. Export a checkpoint of the run instead: `lightning-megatron checkpoint convert "
                         "CKPT out/` merges the adapters into the pretrained base (read again in full), and `... CKPT "
                         "adapter/ --peft` writes the adapters alone.")
    merged = merged_source(TensorSource.of(state_dict), lora.scale, None, config, where="The module's state dict")
    return write_hf(out_dir, config, merged, **kwargs)
