"""What every Hugging Face conversion shares: ``save_pretrained`` directories in and out, and the checks.

The model-specific mappings live in ``hf.py`` (GPT-2) and ``hf_bert.py`` (BERT); ``hf_convert.py``
picks one by ``model_type``. Reading and writing directories needs only ``safetensors`` (never
``transformers``), and never unpickles arbitrary objects: ``.bin`` weights go through
``torch.load(weights_only=True)``. Writes are atomic per file: a crash mid-write leaves the
previous file, never a truncated one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping, Union

import torch
from torch import Tensor, nn

from lightning_megatron.checkpoint.replacement import EXPORT_MARK, check_replaceable, write_atomically

HF_INSTALL_HINT = "pip install 'lightning-megatron[hf]'"
# Both are 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), torch's gelu(approximate="tanh").
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")

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
    if (directory / "model.safetensors").is_file():
        return safetensors_torch().load_file(directory / "model.safetensors")
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        state: dict[str, Tensor] = {}
        for file in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            state.update(safetensors_torch().load_file(directory / file))
        return state
    if (directory / "pytorch_model.bin").is_file():
        return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{directory} holds no Hugging Face weights: expected model.safetensors, "
                            f"model.safetensors.index.json or pytorch_model.bin, as save_pretrained writes them.")


def read_hf_checkpoint(model_or_dir: PathOrModel, *, expected: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Config fields and state dict of a ``transformers`` model or a ``save_pretrained`` directory."""
    fields = read_hf_config(model_or_dir, expected=expected)
    if isinstance(model_or_dir, nn.Module):
        return fields, model_or_dir.state_dict()
    return fields, read_weights(model_or_dir)


# ----------------------------------------------------------------------------- writing
def dtype_name(tensor: Tensor) -> str:
    """``config.json``'s ``dtype`` for weights of ``tensor``'s type, e.g. ``"bfloat16"``."""
    return str(tensor.dtype).removeprefix("torch.")


def write_hf_checkpoint(out_dir: Union[str, os.PathLike], *, fields: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> None:
    """Write ``config.json`` and ``model.safetensors`` as ``save_pretrained`` does.

    ``state_dict`` holds what ``save_pretrained`` stores: tied copies left out (safetensors
    refuses tensors that share memory).
    """
    out = Path(out_dir)
    check_replaceable(out, what="Hugging Face model", hf_export=True)
    tensors = {name: value.detach().cpu().contiguous() for name, value in state_dict.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file = safetensors_torch().save_file
    metadata = {"format": "pt", **EXPORT_MARK}  # the mark lets a later export replace this one
    write_atomically(out / "model.safetensors", lambda path: save_file(tensors, path, metadata=metadata))
    write_atomically(out / "config.json", lambda path: path.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n"))


# ----------------------------------------------------------------------------- checks
def raise_problems(problems: list[str], *, what: str, fix: str = "") -> None:
    """One ``ValueError`` listing every problem, then the fix; nothing when there are none."""
    if problems:
        raise ValueError(f"{what}:\n  - " + "\n  - ".join(problems) + (f"\n{fix}" if fix else ""))


def check_extra_fields(architecture: Mapping[str, Any], extra_fields: Mapping[str, Any], *, config: Any) -> None:
    """Refuse ``config.json`` extras that would overwrite a field our ``config`` decides."""
    clashes = sorted(architecture.keys() & extra_fields.keys())
    if clashes:
        name = type(config).__name__
        raise ValueError(f"extra_fields {clashes} describe the architecture, which comes from the {name}; "
                         f"change the {name} instead.")


def state_dict_shapes(model_class: Callable[[Any], nn.Module], config: Any) -> dict[str, tuple[int, ...]]:
    """Name -> shape of ``model_class(config)``'s full state dict, built on the meta device (free at any size)."""
    with torch.device("meta"):
        return {name: tuple(value.shape) for name, value in model_class(config).state_dict().items()}


def check_names_and_shapes(state: Mapping[str, Tensor], expected: Mapping[str, tuple[int, ...]], *, what: str, fix: str) -> None:
    """Refuse a state dict with missing, unexpected or wrongly shaped entries, naming a few of each."""
    def listed(items: list[str]) -> str:
        return ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")

    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    wrong = [f"{name} {tuple(state[name].shape)} (expected {expected[name]})"
             for name in expected if name in state and tuple(state[name].shape) != expected[name]]
    problems = [f"{label}: {listed(items)}" for label, items in
                (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if items]
    raise_problems(problems, what=f"{what} does not match the config", fix=fix)


def check_tied(state: Mapping[str, Tensor], name: str, tied_to: str, *, what: str, why: str) -> None:
    """Refuse ``state`` when ``state[name]`` differs from ``state[tied_to]``, which ``why`` says must be equal."""
    if not torch.equal(state[name], state[tied_to]):
        raise ValueError(f"{what}: {name} differs from {tied_to}, but {why}. A model where they differ cannot be converted.")


def model_state_dict(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The model's own state dict from a GPT/BERT LightningModule's (names under ``model.``, the rest dropped);
    a state dict with no ``model.`` names is returned as is."""
    if not any(name.startswith("model.") for name in state_dict):
        return dict(state_dict)
    return {name.removeprefix("model."): value for name, value in state_dict.items() if name.startswith("model.")}
