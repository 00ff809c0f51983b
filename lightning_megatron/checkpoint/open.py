"""Open a checkpoint of either format in one process, whatever layout saved it: what is on disk at a path
(``checkpoint_format``: a sharded directory, a full file, or a Hugging Face directory), every tensor's global name,
shape and dtype without reading it (``open_checkpoint``), and what its hyper-parameters record (the model's config,
the Hugging Face base a run started from).

The library under ``lightning-megatron checkpoint`` (``commands.checkpoint``), ``generate`` (``commands.generate``)
and the Hugging Face export (``huggingface.checkpoints``). Nothing is ever unpickled but tensors and plain
containers (``torch.load(weights_only=True)``, or DCP's index).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from lightning_megatron.checkpoint.base import BASE_KEY
from lightning_megatron.checkpoint.full import open_full
from lightning_megatron.checkpoint.replacement import INDEX_FILE, describe, exists, is_torch_file, safetensors_metadata
from lightning_megatron.checkpoint.sharded import INFO_FILE, open_sharded, read_full_tensors
from lightning_megatron.checkpoint.training_state import LAYOUT_KEY
from lightning_megatron.models.bert import BERTConfig
from lightning_megatron.models.gpt import GPTConfig

MODEL_PREFIX = "state_dict/"

SHARDED, FULL, HUGGING_FACE = "sharded", "full", "Hugging Face"


def not_a_checkpoint(path: Path, *, hugging_face: bool = False) -> str:
    """Why ``path`` is refused: what it is, what was expected, and what to pass instead."""
    hint = ""
    if path.is_file():
        with open(path, "rb") as file:
            magic = file.read(4)
        if magic.startswith(b"PK"):
            hint = " (a zip archive without the record torch.save writes last: a truncated or unfinished save)"
        elif safetensors_metadata(path) is not None:
            hint = (" (a safetensors file: plain weights, as `checkpoint consolidate` writes; load it with "
                    "safetensors.torch.load_file)")
    expected = (f"a sharded checkpoint directory holding {INFO_FILE} (Megatron3DStrategy's default "
                f"checkpoint_format='sharded') or a single checkpoint file saved with "
                f"Megatron3DStrategy(checkpoint_format='full') (a torch.save archive)")
    if hugging_face:
        expected += ", or a Hugging Face save_pretrained directory holding config.json"
    if path.is_dir():  # its entries only: sizing a directory (a home directory, say) could take long
        entries = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in path.iterdir())
        what = (f"a directory holding {', '.join(entries[:4])}" + (f" and {len(entries) - 4} more" if len(entries) > 4
                                                                    else "") if entries else "an empty directory")
    else:
        what = describe(path)
    return (f"{path} is not a checkpoint this command reads: it is {what}{hint}. Expected {expected}. "
            f"Pass the checkpoint itself (e.g. lightning_logs/version_0/checkpoints/last.ckpt), not a directory "
            f"around it nor a file from inside it.")


def checkpoint_format(path: Union[str, Path], *, hugging_face: bool = False) -> str:
    """``"sharded"``, ``"full"`` (or, with ``hugging_face``, ``"Hugging Face"``): what is on disk at ``path``,
    by its contents, never by its name. A missing path counts as sharded, whose reader explains it (and names what
    an interrupted save left). Raises ``ValueError`` for anything else."""
    path = Path(path)
    if not exists(path) or (path / INFO_FILE).is_file() or (path / INDEX_FILE).is_file():  # a damaged one too
        return SHARDED
    if path.is_file() and is_torch_file(path):
        return FULL
    if hugging_face and path.is_dir() and (path / "config.json").is_file():
        return HUGGING_FACE
    raise ValueError(not_a_checkpoint(path, hugging_face=hugging_face))


@dataclass
class Checkpoint:
    """A checkpoint of either format as the commands see it: every tensor's global name (``state_dict/<name>``,
    ``optimizer/<i>/...``), shape and dtype without reading it, and ``read`` for a few tensors at a time."""

    path: Path
    format: str
    info: dict[str, Any]
    specs: dict[str, Tensor]  # meta tensors
    read: Callable[[Sequence[str]], dict[str, Tensor]]
    trainer_state: Callable[[], dict[str, Any]]
    files: list[Path]  # what holds the tensors


def open_checkpoint(path: Union[str, Path]) -> Checkpoint:
    """Open a sharded checkpoint directory or a full checkpoint file (which, from what is on disk) in one process.
    Raises ``ValueError`` for anything else, ``FileNotFoundError``/``RuntimeError`` for a damaged checkpoint."""
    if checkpoint_format(path) == SHARDED:
        saved = open_sharded(path)
        specs = {name: torch.empty(tuple(md.size), dtype=md.properties.dtype, device="meta")
                 for name, md in saved.tensors().items()}
        files = sorted({item.relative_path for item in (saved.index.storage_data or {}).values()})
        return Checkpoint(saved.path, SHARDED, saved.info, specs,
                          lambda names: read_full_tensors(saved.path, list(names)), saved.trainer_state,
                          [saved.path / name for name in files])
    full = open_full(path)
    tensors = full.tensors()
    layout = full.checkpoint.get(LAYOUT_KEY) or {}
    sizes = [layout.get(f"{dim}_parallel_size") for dim in ("tensor", "pipeline", "data")]
    world_size = sizes[0] * sizes[1] * sizes[2] if all(isinstance(n, int) for n in sizes) else None
    info = {"format": FULL, "global_step": full.checkpoint.get("global_step"), "epoch": full.checkpoint.get("epoch"),
            "layout": layout, "world_size": world_size}  # what megatron_3d.json says of a sharded one, where known
    specs = {name: torch.empty(tensor.shape, dtype=tensor.dtype, device="meta") for name, tensor in tensors.items()}

    def read(names: Sequence[str]) -> dict[str, Tensor]:  # copies: out of the memory-mapped file, tied ones apart
        return {name: tensors[name].clone() for name in names}

    return Checkpoint(full.path, FULL, info, specs, read, full.trainer_state, [full.path])


def model_config(hyper_parameters: dict[str, Any]) -> Union[GPTConfig, BERTConfig]:
    """The GPT/BERT config a checkpoint's hyper-parameters describe, recognised by its fields: a BERT config always
    holds BERT's own ones; a GPT config saved before GPTConfig gained fields holds fewer, which take their defaults."""
    config = hyper_parameters.get("config")
    if isinstance(config, dict):
        for config_class in (GPTConfig, BERTConfig):
            if set(config) <= {field.name for field in fields(config_class)}:
                return config_class(**config)
    raise ValueError("The checkpoint's hyper_parameters hold no GPTConfig or BERTConfig under 'config': it was not "
                     "saved from lightning_megatron.models.GPT or BERT (or a subclass), so there is no Hugging Face "
                     "equivalent to convert it to.")


def recorded_base(trainer_state: dict[str, Any]) -> Optional[str]:
    """The Hugging Face directory a run started from, as its checkpoint records it: the base reference of an
    adapter-only checkpoint (resolved at the save), else the module's ``pretrained`` hyper-parameter."""
    reference = trainer_state.get(BASE_KEY)
    return reference["pretrained"] if reference is not None else (trainer_state.get("hyper_parameters") or {}).get(
        "pretrained")
