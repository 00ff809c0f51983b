"""LoRA adapters of our GPT as a PEFT adapter directory: ``adapter_config.json`` + ``adapter_model.safetensors``,
which ``peft.PeftModel.from_pretrained(base, directory)`` loads onto the Hugging Face base model.

The adapter of one of our layers becomes the adapters of the Hugging Face module(s) that layer converts to, by
the family's own rules (``mapping.py``), so nothing here knows a family's names:

* a layer that converts to one module unchanged (``attn.proj`` -> ``o_proj``, ``mlp.proj`` -> ``down_proj``):
  ``A`` and ``B`` as they are;
* a fused layer split into several (``attn.qkv``, fused by query group, -> ``q_proj``/``k_proj``/``v_proj``;
  ``mlp.fc`` = ``[gate; up]`` -> ``gate_proj``/``up_proj``): the update ``B A`` splits by rows of ``B`` as the
  weight does (``B`` is ``[out, r]``, a weight with ``r`` inputs), and every part shares ``A``;
* GPT-2's ``Conv1D`` modules keep weights transposed (``[in, out]``) but PEFT's adapters of them are plain
  ``[r, in]``/``[out, r]`` linears (``fan_in_fan_out: true``): ``B``'s rows are reordered as the weight's
  outputs (``c_attn``: head-major to ``[q; k; v]``) and nothing is transposed.

PEFT names a module's adapters ``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight`` and adapts the
modules ``target_modules`` names: their last names (``q_proj``) when every layer's is adapted, else their full
names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from torch import Tensor

from lightning_megatron.checkpoint.replacement import EXPORT_MARK, describe, exists, safetensors_metadata, write_atomically
from lightning_megatron.huggingface.convert import family_for
from lightning_megatron.huggingface.io import safetensors_torch
from lightning_megatron.huggingface.mapping import GPT2QKV, QueryGroups, Transform, Transpose
from lightning_megatron.models.gpt import GPTConfig
from lightning_megatron.peft.lora import LoRAConfig
from lightning_megatron.peft.merge import adapted_layer_names, adapter_weight_names

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def _lora_b_parts(transform: Transform, lora_b: Tensor) -> tuple[Tensor, ...]:
    """``B``'s rows for each Hugging Face module, as ``transform`` splits the weight's rows (never transposed)."""
    if isinstance(transform, Transpose):
        return (lora_b.contiguous(),)
    if isinstance(transform, GPT2QKV):
        return (torch.cat(QueryGroups(transform.heads, transform.heads).to_hf(lora_b)),)
    return tuple(part.contiguous() for part in transform.to_hf(lora_b))


def peft_adapter(config: GPTConfig, adapters: Mapping[str, Tensor], *,
                 model_type: Optional[str] = None) -> tuple[dict[str, Tensor], list[str], bool]:
    """PEFT's tensors for our ``adapters`` (``blocks.0.attn.qkv.lora_a.weight`` ...: every adapter of the model),
    the modules they adapt (Hugging Face names) and whether those are ``Conv1D``s (``fan_in_fan_out``)."""
    mapping = family_for(config, model_type).mapping(config)
    entries = {entry.ours: entry for entry in mapping.entries}
    tensors: dict[str, Tensor] = {}
    modules: list[str] = []
    transposed = False
    for layer in adapted_layer_names(adapters):
        entry = entries.get(f"{layer}.weight")
        if entry is None:
            raise ValueError(f"The adapter of {layer} has no Hugging Face counterpart: {layer}.weight is not a weight "
                             f"the {mapping.texts.hf.removeprefix('The Hugging Face ')} has.")
        lora_a, lora_b = (adapters[name] for name in adapter_weight_names(layer))
        transposed |= isinstance(entry.transform, (Transpose, GPT2QKV))
        for theirs, b_part in zip(entry.theirs, _lora_b_parts(entry.transform, lora_b)):
            module = theirs.removesuffix(".weight")
            modules.append(module)
            tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = lora_a.contiguous().clone()
            tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b_part.clone()
    return tensors, modules, transposed


def _target_modules(adapted: list[str], all_modules: list[str]) -> list[str]:
    """The last names of the adapted modules when each such name is adapted everywhere it occurs, else the full
    names (PEFT matches a target against a module's full name or its last part)."""
    last = sorted({name.rsplit(".", 1)[-1] for name in adapted})
    everywhere = {name for name in all_modules if name.rsplit(".", 1)[-1] in last}
    return last if everywhere == set(adapted) else sorted(adapted)


def adapter_config(lora: LoRAConfig, target_modules: list[str], *, fan_in_fan_out: bool,
                   base_model: Optional[str]) -> dict[str, Any]:
    """``adapter_config.json``'s fields (``peft.LoraConfig``'s names); the others take PEFT's defaults."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "target_modules": target_modules, "bias": "none",
            "fan_in_fan_out": fan_in_fan_out, "base_model_name_or_path": base_model, "inference_mode": True,
            "use_rslora": False, "use_dora": False}


def _check_replaceable(out: Path) -> None:
    """An adapter directory replaces only an empty directory, one without adapter files, or an export of ours."""
    if not exists(out) or (out.is_dir() and not any(exists(out / name) for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS))):
        return
    metadata = safetensors_metadata(out / ADAPTER_WEIGHTS) if exists(out / ADAPTER_WEIGHTS) else None
    if metadata is not None and all(metadata.get(key) == value for key, value in EXPORT_MARK.items()):
        return
    raise FileExistsError(f"Refusing to write a PEFT adapter to {out}: it holds {describe(out)}, an adapter that "
                          f"lightning-megatron did not write. Nothing was written. Choose a new directory.")


def write_peft_adapter(out_dir: Union[str, os.PathLike], config: GPTConfig, adapters: Mapping[str, Tensor],
                       lora: LoRAConfig, *, base_model: Optional[str] = None, model_type: Optional[str] = None) -> None:
    """Write ``adapters`` (our names, full tensors) as a PEFT adapter directory for the Hugging Face model that
    ``config`` exports to (``model_type``: as ``write_hf``'s). Each file is replaced atomically, the config last."""
    out = Path(out_dir)
    tensors, adapted, transposed = peft_adapter(config, adapters, model_type=model_type)
    family = family_for(config, model_type)
    all_modules = sorted({theirs.removesuffix(".weight") for entry in family.mapping(config).entries
                          for theirs in entry.theirs if theirs.endswith(".weight")})
    fields = adapter_config(lora, _target_modules(adapted, all_modules), fan_in_fan_out=transposed,
                            base_model=base_model)
    _check_replaceable(out)
    save_file = safetensors_torch().save_file
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / ADAPTER_WEIGHTS,
                     lambda partial: save_file(tensors, str(partial), metadata={"format": "pt", **EXPORT_MARK}))
    write_atomically(out / ADAPTER_CONFIG,
                     lambda partial: partial.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n"))
