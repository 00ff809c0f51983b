"""LoRA adapters of our GPT as a PEFT adapter directory: ``adapter_config.json`` + ``adapter_model.safetensors``,
which ``peft.PeftModel.from_pretrained(base, directory)`` loads onto the Hugging Face base model.

The adapter of one of our layers becomes the adapters of the Hugging Face module(s) that layer converts to, by
the family's own rules (``mapping.py``), so nothing here knows a family's names:

* a layer that converts to one module unchanged (``attn.proj`` -> ``o_proj``, ``mlp.proj`` -> ``down_proj``):
  ``A`` and ``B`` as they are;
* a fused layer's adapters per projection (``LoRAConfig.variant="canonical"``: ``attn.qkv``'s ``q``, ``k``, ``v``
  -> ``q_proj``/``k_proj``/``v_proj``; ``mlp.fc``'s ``gate``, ``up`` -> ``gate_proj``/``up_proj``): projection ``i``
  is the family's ``i``-th module of the layer, ``A`` as it is and ``B``'s rows in the module's order (where the
  layer's transform puts them, found by converting row indices: the identity for Llama's);
* a fused layer with one adapter (``variant="fused"``) split into several modules: the update ``B A`` splits by
  rows of ``B`` as the weight does (``B`` is ``[out, r]``, a weight with ``r`` inputs), and every part shares
  ``A``;
* GPT-2's ``Conv1D`` modules keep weights transposed (``[in, out]``) but PEFT's adapters of them are plain
  ``[r, in]``/``[out, r]`` linears (``fan_in_fan_out: true``): ``B``'s rows are reordered as the weight's
  outputs (``c_attn``: head-major to ``[q; k; v]``) and nothing is transposed.

PEFT names a module's adapters ``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight`` and adapts the
modules ``target_modules`` names: their last names (``q_proj``) when every layer's is adapted, else their full
names.

:func:`read_peft_adapter` is the way back: a PEFT adapter directory (safetensors only) -> a ``LoRAConfig`` (always
``"canonical"``: PEFT's parameterisation) and our adapters' tensors, exactly inverting the export; what PEFT can
express and this LoRA cannot (DoRA, rsLoRA, trained biases, extra trained modules, per-layer ranks) is refused by
name.
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
from lightning_megatron.huggingface.lora_export import fused_layouts
from lightning_megatron.huggingface.mapping import (
    GPT2QKV,
    Entry,
    QueryGroups,
    Transform,
    Transpose,
    check_names_and_shapes,
)
from lightning_megatron.models.gpt import GPTConfig, GPTModel
from lightning_megatron.peft.lora import LoRAConfig, apply_lora
from lightning_megatron.peft.merge import adapter_weight_names, layer_adapters

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def _lora_b_parts(transform: Transform, lora_b: Tensor) -> tuple[Tensor, ...]:
    """``B``'s rows for each Hugging Face module, as ``transform`` splits the weight's rows (never transposed)."""
    if isinstance(transform, Transpose):
        return (lora_b.contiguous(),)
    if isinstance(transform, GPT2QKV):
        return (torch.cat(QueryGroups(transform.heads, transform.heads).to_hf(lora_b)),)
    return tuple(part.contiguous() for part in transform.to_hf(lora_b))


def _lora_b_ours(transform: Transform, lora_b: Tensor) -> Tensor:
    """The inverse of ``_lora_b_parts`` for a module that is one of our layers: its ``B`` in our row order."""
    if isinstance(transform, Transpose):
        return lora_b.contiguous()
    if isinstance(transform, GPT2QKV):
        return QueryGroups(transform.heads, transform.heads).to_ours(lora_b.chunk(3)).contiguous()
    return transform.to_ours((lora_b,)).contiguous()


def _projection_rows(entry: Entry, layout, out_features: int) -> list[Tensor]:
    """For a fused layer whose projection ``i`` is the Hugging Face module ``entry.theirs[i]``: module ``i``'s rows
    as rows of projection ``i`` (the layout's ``join`` and the family's transform applied to row indices)."""
    sizes = layout.part_sizes(out_features)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    index = layout.join([torch.arange(start, start + size)[None] for start, size in zip(starts, sizes)], out_features)
    rows = []
    for i, module_rows in enumerate(entry.transform.to_hf(index[0][:, None])):
        local = module_rows[:, 0] - starts[i]
        if not torch.equal(local.sort().values, torch.arange(sizes[i])):
            raise ValueError(f"{entry.ours}: the Hugging Face module {entry.theirs[i]} is not projection {i} of the "
                             f"fused layer, so its adapter cannot be one of ours.")
        rows.append(local)
    return rows


def _fused_entry(entry: Entry, fused: Mapping[str, tuple[Any, tuple[str, ...]]]) -> tuple[Any, tuple[str, ...]]:
    layer = entry.ours.removesuffix(".weight")
    layout, parts = fused[layer]
    if len(parts) != len(entry.theirs):
        raise ValueError(f"{layer} fuses the projections {list(parts)}, but the Hugging Face model has "
                         f"{list(entry.theirs)} for it.")
    return layout, parts


def peft_adapter(config: GPTConfig, adapters: Mapping[str, Tensor], *,
                 model_type: Optional[str] = None) -> tuple[dict[str, Tensor], list[str], bool]:
    """PEFT's tensors for our ``adapters`` (``blocks.0.attn.qkv.lora_a.q.weight`` ...: every adapter of the model),
    the modules they adapt (Hugging Face names) and whether those are ``Conv1D``s (``fan_in_fan_out``)."""
    mapping = family_for(config, model_type).mapping(config)
    entries, fused = {entry.ours: entry for entry in mapping.entries}, fused_layouts(config)
    tensors: dict[str, Tensor] = {}
    modules: list[str] = []
    transposed = False

    def add(module: str, lora_a: Tensor, lora_b: Tensor) -> None:
        modules.append(module)
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = lora_a.contiguous().clone()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = lora_b.contiguous().clone()

    for layer, adapted_parts in layer_adapters(adapters).items():
        entry = entries.get(f"{layer}.weight")
        if entry is None:
            raise ValueError(f"The adapter of {layer} has no Hugging Face counterpart: {layer}.weight is not a weight "
                             f"the {mapping.texts.hf.removeprefix('The Hugging Face ')} has.")
        transposed |= isinstance(entry.transform, (Transpose, GPT2QKV))
        if adapted_parts:  # an adapter per projection: projection i is module i
            layout, parts = _fused_entry(entry, fused)
            rows = _projection_rows(entry, layout, mapping.our_shapes[entry.ours][0])
            for part in adapted_parts:
                i = parts.index(part)
                lora_a, lora_b = (adapters[name] for name in adapter_weight_names(layer, part))
                add(entry.theirs[i].removesuffix(".weight"), lora_a, lora_b[rows[i]])
            continue
        lora_a, lora_b = (adapters[name] for name in adapter_weight_names(layer))
        for theirs, b_part in zip(entry.theirs, _lora_b_parts(entry.transform, lora_b)):
            add(theirs.removesuffix(".weight"), lora_a, b_part)
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


#: ``adapter_config.json`` fields whose other values this LoRA cannot compute: field -> (the values it takes, what
#: the field asks for). A field that is absent takes PEFT's default, which is among the values taken.
UNSUPPORTED = {
    "use_dora": ((False, None), "DoRA (a trained magnitude per output feature)"),
    "use_rslora": ((False, None), "rank-stabilised scaling (alpha / sqrt(r))"),
    "bias": (("none", None), "trained biases"),
    "lora_bias": ((False, None), "a trained bias of lora_B"),
    "modules_to_save": ((None, []), "fully trained extra modules"),
    "layers_to_transform": ((None, []), "adapters on some layers picked by index"),
    "layers_pattern": ((None, []), "adapters on some layers picked by index"),
    "layer_replication": ((None, []), "replicated layers"),
    "trainable_token_indices": ((None, [], {}), "trained token embeddings"),
    "target_parameters": ((None, []), "adapters of parameters rather than modules"),
    "use_qalora": ((False, None), "QALoRA"),
}


def _check_supported(fields: Mapping[str, Any], where: Path) -> None:
    problems = [f"{field}={fields[field]!r} asks for {what}" for field, (taken, what) in UNSUPPORTED.items()
                if field in fields and fields[field] not in taken]
    if fields.get("peft_type", "LORA") != "LORA":
        problems.insert(0, f"peft_type={fields['peft_type']!r} is not LoRA")
    for field, default in (("rank_pattern", fields.get("r")), ("alpha_pattern", fields.get("lora_alpha"))):
        differing = {name: value for name, value in (fields.get(field) or {}).items() if value != default}
        if differing:
            problems.append(f"{field}={differing!r} gives some modules another rank or alpha than the config's "
                            f"{default!r}")
    if problems:
        raise ValueError(f"The PEFT adapter in {where} uses what lightning-megatron's LoRA does not compute: "
                         + "; ".join(problems) + ". Train the adapter without these options (PEFT's defaults), or "
                         "merge it into the base with PEFT's merge_and_unload() and fine-tune that model.")


def _check_base(recorded: Optional[str], base: Optional[str], where: Path) -> None:
    """A base the adapter records as a local directory must be the same model as ``base`` (same config.json)."""
    if not recorded or base is None or not Path(recorded).is_dir() or not (Path(recorded) / "config.json").is_file():
        return
    same_dir = Path(recorded).resolve() == Path(base).resolve()
    if not same_dir and json.loads((Path(recorded) / "config.json").read_text()) != \
            json.loads((Path(base) / "config.json").read_text()):
        raise ValueError(f"The PEFT adapter in {where} was trained on {recorded} (base_model_name_or_path), whose "
                         f"config.json differs from the base {base}'s: load it onto pretrained={recorded!r}, or set "
                         f"base_model_name_or_path in its adapter_config.json if {base} is that model.")


def _compact_targets(names: list[str], num_layers: int) -> list[str]:
    """``blocks.*.<rest>`` for what every layer adapts, the full names of the rest (``LoRAConfig.targets``)."""
    by_rest: dict[str, set[str]] = {}
    for name in names:
        if name.startswith("blocks."):
            _, index, rest = name.split(".", 2)
            by_rest.setdefault(rest, set()).add(index)
    everywhere = {rest for rest, layers in by_rest.items() if layers == {str(i) for i in range(num_layers)}}
    return [f"blocks.*.{rest}" for rest in sorted(everywhere)] + \
        sorted(name for name in names if not name.startswith("blocks.") or name.split(".", 2)[2] not in everywhere)


def read_peft_adapter(directory: Union[str, os.PathLike], config: GPTConfig, *, base: Optional[str] = None,
                      model_type: Optional[str] = None) -> tuple[LoRAConfig, dict[str, Tensor]]:
    """A PEFT adapter directory for the Hugging Face model ``config`` exports to: its ``LoRAConfig`` and our
    adapters' full tensors (``blocks.0.attn.qkv.lora_a.q.weight`` ...), the exact inverse of
    :func:`write_peft_adapter`. ``base``: the Hugging Face directory it is loaded onto (checked against the
    adapter's ``base_model_name_or_path`` when that is a local directory)."""
    where = Path(directory)
    if not (where / ADAPTER_CONFIG).is_file() or not (where / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"{where} is not a PEFT adapter directory: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} "
                         f"(PEFT's save_pretrained with safe_serialization, its default; pickled adapter_model.bin "
                         f"files are not read).")
    fields = json.loads((where / ADAPTER_CONFIG).read_text())
    _check_supported(fields, where)
    _check_base(fields.get("base_model_name_or_path"), base, where)
    family = family_for(config, model_type)
    mapping, fused = family.mapping(config), fused_layouts(config)
    theirs = {module.removesuffix(".weight"): (entry, i) for entry in mapping.entries
              for i, module in enumerate(entry.theirs)}
    transposed = any(isinstance(entry.transform, (Transpose, GPT2QKV)) for entry, _ in theirs.values())
    if bool(fields.get("fan_in_fan_out", False)) != transposed:
        raise ValueError(f"The PEFT adapter in {where} sets fan_in_fan_out={fields.get('fan_in_fan_out')!r}, but the "
                         f"{family.model_type} modules it adapts {'are' if transposed else 'are not'} Conv1Ds: it was "
                         f"made for another model.")
    tensors = safetensors_torch().load_file(str(where / ADAPTER_WEIGHTS))
    ours: dict[str, Tensor] = {}
    targets: list[str] = []
    unknown = []
    for key, value in tensors.items():
        module, _, kind = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if not key.startswith(PEFT_PREFIX) or kind not in ("A.weight", "B.weight") or module not in theirs:
            unknown.append(key)
            continue
        if kind == "B.weight":
            continue
        entry, i = theirs[module]
        layer = entry.ours.removesuffix(".weight")
        lora_b = tensors.get(f"{PEFT_PREFIX}{module}.lora_B.weight")
        if lora_b is None:
            unknown.append(key)
            continue
        if layer in fused:
            layout, parts = _fused_entry(entry, fused)
            rows = _projection_rows(entry, layout, mapping.our_shapes[entry.ours][0])[i]
            name_a, name_b = adapter_weight_names(layer, parts[i])
            ours[name_a] = value.contiguous().clone()
            ours[name_b] = lora_b.new_empty(lora_b.shape).index_copy_(0, rows, lora_b)
            targets.append(f"{layer}.{parts[i]}")
        elif len(entry.theirs) == 1:
            name_a, name_b = adapter_weight_names(layer)
            ours[name_a], ours[name_b] = value.contiguous().clone(), _lora_b_ours(entry.transform, lora_b)
            targets.append(layer)
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"The PEFT adapter in {where} holds tensors that are no LoRA adapter of a {family.model_type} "
                         f"module lightning-megatron adapts: {sorted(unknown)[:4]}.")
    lora = LoRAConfig(rank=int(fields["r"]), alpha=float(fields["lora_alpha"]),
                      dropout=float(fields.get("lora_dropout") or 0.0),
                      targets=_compact_targets(_whole_layers(targets, fused), config.num_layers))
    with torch.device("meta"):
        expected = GPTModel(config)
        apply_lora(expected, lora)
    check_names_and_shapes({name: tuple(t.shape) for name, t in ours.items()},
                           {name: tuple(p.shape) for name, p in expected.named_parameters() if p.requires_grad},
                           what=f"The PEFT adapter in {where}", fix=f"Is {where} an adapter of this base model?")
    return lora, ours


def _whole_layers(targets: list[str], fused: Mapping[str, tuple[Any, tuple[str, ...]]]) -> list[str]:
    """``blocks.0.attn.qkv`` for a fused layer whose every projection is adapted, else the projections."""
    whole = [layer for layer, (_, parts) in fused.items() if all(f"{layer}.{part}" in targets for part in parts)]
    return whole + [name for name in targets if name.rpartition(".")[0] not in whole]
