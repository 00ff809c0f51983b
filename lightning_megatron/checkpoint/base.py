"""Adapter-only checkpoints: a LoRA run on a pretrained base saves what it trains and a reference to the base.

A LightningModule with LoRA adapters and a ``pretrained`` base (``GPT(pretrained=hf_dir, lora=...)``) gets
checkpoints (sharded and ``checkpoint_format="full"`` alike) that hold

* its adapters, the only parameters it trains, with their optimizer state and fp32 main copies;
* under ``megatron_3d_base`` (in the trainer state, and in ``megatron_3d.json`` for ``checkpoint inspect``): the
  base's path and a fingerprint of it;

and no tensor of the frozen base. Whatever reads the checkpoint reads the base from the reference: a resumed run
and ``load_from_checkpoint`` rebuild the module from ``pretrained`` (its ``configure_model`` loads it), ``checkpoint
convert`` merges the adapters into it. A base whose fingerprint changed since the save is refused, naming both.

The fingerprint is ``config.json``'s SHA-256 and each weight file's name, size and SHA-256 of its first and last
MiB: a safetensors file begins with a header naming every tensor, its shape and its offset, and its bytes then
begin and end with tensor values, so another model, another size or other weights of the same shapes (a
different fine-tune) are told apart in all but contrived cases, reading 2 MiB per file rather than the whole base
at every save. It does not prove that no byte in the middle changed.

Without ``pretrained`` (LoRA on a randomly initialised model: tests, the tiny configs) the frozen base is stored
as well, as any checkpoint stores its weights (the log says so at the first save). Its values come from the seed
and the initialisers' code, and either may differ when the checkpoint is read (another seed, another version):
a checkpoint that relied on them could put its adapters on another base without anyone noticing.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Mapping, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_megatron.parallel.names import is_adapter_name
from lightning_megatron.peft.adapters import adapted_layers
from lightning_megatron.peft.merge import layer_adapters

BASE_KEY = "megatron_3d_base"
SAMPLE_BYTES = 2**20
WEIGHT_SUFFIXES = (".safetensors", ".bin")
_told_stored_base: set[int] = set()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sampled(file: Path) -> str:
    size = file.stat().st_size
    with open(file, "rb") as handle:
        head = handle.read(SAMPLE_BYTES)
        handle.seek(max(size - SAMPLE_BYTES, 0))
        tail = handle.read(SAMPLE_BYTES)
    return _sha256(head + tail)


def fingerprint(directory: str | Path) -> dict[str, Any]:
    """What identifies a Hugging Face base directory (see the module): ``config.json`` and the weight files."""
    directory = Path(directory)
    config = directory / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"The base model directory {directory} has no config.json: it was moved or removed, "
                                f"or is not a save_pretrained directory.")
    files = sorted(file for file in directory.iterdir() if file.is_file() and file.name.endswith(WEIGHT_SUFFIXES))
    return {"config_sha256": _sha256(config.read_bytes()),
            "weights": {file.name: {"bytes": file.stat().st_size, "sampled_sha256": _sampled(file)} for file in files}}


def stores_adapters_only(module: nn.Module) -> bool:
    """Whether ``module``'s checkpoints hold its adapters and a base reference rather than every weight."""
    adapted = bool(adapted_layers(module))
    pretrained = getattr(module, "pretrained", None)
    if adapted and pretrained is None and id(module) not in _told_stored_base:
        _told_stored_base.add(id(module))
        rank_zero_info(f"{type(module).__name__} trains LoRA adapters of a base without `pretrained`: its checkpoints "
                       f"store the frozen base weights too (a randomly initialised base has no other source).")
    return adapted and pretrained is not None


def base_reference(module: nn.Module) -> Optional[dict[str, Any]]:
    """The reference an adapter-only checkpoint of ``module`` records (None when it stores every weight)."""
    if not stores_adapters_only(module):
        return None
    path = Path(module.pretrained).resolve()
    return {"pretrained": str(path), "fingerprint": fingerprint(path)}


def trained_only(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The adapters' entries of a state dict or of checkpoint entries (``state_dict/...lora_a.weight``)."""
    return {name: value for name, value in tensors.items() if is_adapter_name(name)}


def check_base(reference: Mapping[str, Any], pretrained: Optional[str], *, where: str) -> str:
    """Refuse to put an adapter-only checkpoint's adapters on any base but the one it was trained on: ``pretrained``
    (the loading module's; None: the recorded path) must have the recorded fingerprint. Returns the base's path."""
    recorded = reference["pretrained"]
    if pretrained is None:
        pretrained = recorded
    try:
        now = fingerprint(pretrained)
    except FileNotFoundError as error:
        raise RuntimeError(f"{where} stores LoRA adapters only; its base is {recorded}. {error} Put the base model "
                           f"back, or pass pretrained=<its directory> when loading.") from None
    if now != reference["fingerprint"]:
        differs = [key for key in ("config_sha256", "weights") if now.get(key) != reference["fingerprint"].get(key)]
        raise RuntimeError(f"{where} stores LoRA adapters trained on the base {recorded}, but the base at {pretrained} "
                           f"is another model now (its {' and '.join(differs)} differ from those recorded at the "
                           f"save). Load it with the base it was trained on.")
    return str(pretrained)


def check_module_base(reference: Optional[Mapping[str, Any]], module: nn.Module, *, where: str) -> None:
    """Before an adapter-only checkpoint is loaded into ``module``: the module was built on the recorded base."""
    if reference is None:
        return
    pretrained = getattr(module, "pretrained", None)
    if pretrained is None:
        raise RuntimeError(f"{where} stores LoRA adapters only, trained on the base {reference['pretrained']}, but "
                           f"this {type(module).__name__} has no pretrained base: build it with "
                           f"pretrained={reference['pretrained']!r}.")
    check_base(reference, pretrained, where=where)


def load_adapters(module: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
    """Load an adapter-only state dict into ``module`` (its base already loaded from ``pretrained``): with
    ``strict``, every adapter of the module must be there and nothing but adapters."""
    missing, unexpected = module.load_state_dict(state_dict, strict=False)
    missing = [name for name in missing if is_adapter_name(name)]
    if strict and (missing or unexpected):
        saved, built = layer_adapters(unexpected), layer_adapters(missing)
        fused = any(parts and saved.get(layer) == () for layer, parts in built.items())
        why = ("It holds one adapter over each fused layer (LoRA variant 'fused', what lightning-megatron trained "
               "before an adapter per projection, PEFT's, became the default): build the module with the checkpoint's "
               "lora settings and variant: fused (load_from_checkpoint(path, lora={..., 'variant': 'fused'}); in a "
               "config file, variant: fused in the lora block)." if fused else
               "It was saved with other LoRA targets or rank.")
        raise RuntimeError(f"The adapter-only checkpoint does not fit {type(module).__name__}: missing adapters "
                           f"{missing[:4]}, unexpected {unexpected[:4]}. {why}")
