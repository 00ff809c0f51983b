"""Hugging Face ``save_pretrained`` directories in and out, needing only ``safetensors`` (never ``transformers``).

Reading never unpickles arbitrary objects: ``.bin`` weights go through ``torch.load(weights_only=True)``.
Writing produces what ``save_pretrained`` does: ``config.json`` and ``model.safetensors``, or, for a
model larger than ``max_shard_size``, ``model-00001-of-0000N.safetensors`` files with
``model.safetensors.index.json``. Each shard is made by a function called only when its turn comes,
so an export holds one shard in memory, never the model. Every file is replaced atomically (a crash
mid-write leaves the previous file, never a truncated one) and carries the export mark that lets a
later export, and only one of ours, replace it (``checkpoint/replacement.py``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping, Sequence, Union

import torch
from torch import Tensor, nn

from lightning_megatron.checkpoint.replacement import (
    EXPORT_MARK,
    HF_INDEX_FILE,
    check_replaceable,
    is_our_hf_export,
    remove,
    write_atomically,
)

HF_INSTALL_HINT = "pip install 'lightning-megatron[hf]'"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers 4.x's default (5.x's is 50GB: one file for almost any model)
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}

PathOrModel = Union[str, os.PathLike, nn.Module]


def safetensors_torch() -> ModuleType:
    """``safetensors.torch``, or an ``ImportError`` that names the extra to install."""
    try:
        import safetensors.torch
    except ImportError as error:
        raise ImportError(f"Hugging Face checkpoint files need the optional `safetensors` package: {HF_INSTALL_HINT}") from error
    return safetensors.torch


# ----------------------------------------------------------------------------- reading
def config_fields(hf_config: Union[Mapping[str, Any], Any]) -> dict[str, Any]:
    """The fields of a ``transformers`` config object, or a copy of a parsed ``config.json``."""
    return hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)


def read_hf_config(model_or_dir: PathOrModel, *, expected: str) -> dict[str, Any]:
    """The config fields of a ``transformers`` model or of a ``save_pretrained`` directory's ``config.json``.

    ``expected`` names the models the caller accepts, for the ``TypeError`` on anything else.
    """
    if isinstance(model_or_dir, (str, os.PathLike)):
        path = Path(model_or_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path.parent} has no config.json: pass a directory written by save_pretrained.")
        return json.loads(path.read_text())
    if isinstance(model_or_dir, nn.Module) and hasattr(model_or_dir, "config"):
        return config_fields(model_or_dir.config)
    raise TypeError(f"Expected {expected} or a save_pretrained directory, got {type(model_or_dir).__name__}.")


def read_weights(directory: Union[str, os.PathLike]) -> dict[str, Tensor]:
    """The state dict in ``directory``: ``model.safetensors``, sharded safetensors or ``pytorch_model.bin``."""
    directory = Path(directory)
    if (directory / SINGLE_FILE).is_file():
        return safetensors_torch().load_file(directory / SINGLE_FILE)
    index = directory / HF_INDEX_FILE
    if index.is_file():
        state: dict[str, Tensor] = {}
        for file in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            state.update(safetensors_torch().load_file(directory / file))
        return state
    if (directory / "pytorch_model.bin").is_file():
        return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{directory} holds no Hugging Face weights: expected {SINGLE_FILE}, {HF_INDEX_FILE} or "
                            f"pytorch_model.bin, as save_pretrained writes them.")


def weight_names(directory: Union[str, os.PathLike]) -> list[str]:
    """The tensor names of ``directory``'s weights without reading them (the safetensors headers, or the index);
    ``pytorch_model.bin`` keeps them inside its pickle, so it gives none."""
    directory = Path(directory)
    if (directory / SINGLE_FILE).is_file():
        with safetensors_torch().safe_open(str(directory / SINGLE_FILE), framework="pt") as weights:
            return list(weights.keys())
    index = directory / HF_INDEX_FILE
    return list(json.loads(index.read_text())["weight_map"]) if index.is_file() else []


def read_hf_checkpoint(model_or_dir: PathOrModel, *, expected: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Config fields and state dict of a ``transformers`` model or a ``save_pretrained`` directory."""
    fields = read_hf_config(model_or_dir, expected=expected)
    if isinstance(model_or_dir, nn.Module):
        return fields, model_or_dir.state_dict()
    return fields, read_weights(model_or_dir)


# ----------------------------------------------------------------------------- writing
def dtype_name(dtype: torch.dtype) -> str:
    """``config.json``'s ``dtype`` for weights of ``dtype``, e.g. ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def size_in_bytes(size: Union[int, str]) -> int:
    """``max_shard_size`` as ``save_pretrained`` reads it: bytes, or a string such as ``"5GB"`` or ``"500MiB"``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(size).upper())
    if match is None or float(match[1]) <= 0:
        raise ValueError(f"max_shard_size={size!r} is not a size: give bytes (an int) or a string like '5GB', "
                         f"'500MB' or '2GiB'.")
    return int(float(match[1]) * _UNITS[match[2] or "B"])


def shard_file_names(count: int) -> list[str]:
    """``save_pretrained``'s names: ``model.safetensors`` alone, else ``model-00001-of-0000N.safetensors``."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{index:05d}-of-{count:05d}.safetensors" for index in range(1, count + 1)]


def _write_json(path: Path, content: Mapping[str, Any]) -> None:
    write_atomically(path, lambda partial: partial.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n"))


def _weight_files(directory: Path) -> set[str]:
    return {path.name for path in directory.iterdir()
            if path.name in (SINGLE_FILE, HF_INDEX_FILE) or _SHARD_FILE.fullmatch(path.name)}


def _write_shard(path: Path, make_shard: Callable[[], Mapping[str, Tensor]], save_file: Callable) -> tuple[list[str], int]:
    """Make one shard's tensors and write them; they are freed on return, before the next shard is made."""
    tensors = {key: value.detach().cpu().contiguous() for key, value in make_shard().items()}
    metadata = {"format": "pt", **EXPORT_MARK}  # the mark lets a later export replace this one
    write_atomically(path, lambda partial: save_file(tensors, str(partial), metadata=metadata))
    return list(tensors), sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def write_hf_directory(out_dir: Union[str, os.PathLike], *, fields: Mapping[str, Any],
                       shards: Sequence[Callable[[], Mapping[str, Tensor]]]) -> None:
    """Write a ``save_pretrained`` directory: ``shards`` are called one after another, each returning the
    tensors of one weight file (what ``save_pretrained`` stores: tied copies left out, since safetensors
    refuses tensors that share memory), then the index (several shards), then ``config.json``.

    Weight files of an earlier export of ours that the new one does not rewrite (a single file replaced by
    shards, or more shards than now) are removed, so ``from_pretrained`` cannot find stale weights.
    """
    out = Path(out_dir)
    check_replaceable(out, what="Hugging Face model", hf_export=True)
    replacing_ours = is_our_hf_export(out)
    save_file = safetensors_torch().save_file  # before anything is written: the ImportError names the extra
    out.mkdir(parents=True, exist_ok=True)
    names = shard_file_names(len(shards))
    weight_map: dict[str, str] = {}
    total_size = 0
    for name, make_shard in zip(names, shards):
        written, size = _write_shard(out / name, make_shard, save_file)
        weight_map.update(dict.fromkeys(written, name))
        total_size += size
    if len(names) > 1:
        _write_json(out / HF_INDEX_FILE, {"metadata": {"total_size": total_size, **EXPORT_MARK},
                                          "weight_map": dict(sorted(weight_map.items()))})
    if replacing_ours:
        for stale in sorted(_weight_files(out) - set(names) - ({HF_INDEX_FILE} if len(names) > 1 else set())):
            remove(out / stale)
    _write_json(out / "config.json", fields)
