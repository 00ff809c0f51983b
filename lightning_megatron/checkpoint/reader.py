"""The reader behind ``GPT.load_from_checkpoint`` / ``BERT.load_from_checkpoint`` for what Lightning's own loader
cannot read: sharded checkpoint directories (any saving layout), and adapter-only checkpoints of either format,
whose base comes from the module's ``pretrained`` weights (``checkpoint.base``). It registers itself in
``models/formats.py`` when ``lightning_megatron.checkpoint`` is imported, so the models need not import it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from torch import nn

from lightning_megatron.checkpoint.base import BASE_KEY, check_module_base, load_adapters
from lightning_megatron.checkpoint.full import open_full
from lightning_megatron.checkpoint.replacement import is_torch_file
from lightning_megatron.checkpoint.sharded import consolidated_state_dict, is_sharded_checkpoint, open_sharded
from lightning_megatron.models.formats import ShardedCheckpointReader, register_sharded_checkpoint_reader


def _trainer_state(path) -> dict[str, Any]:
    """Everything but the weights, of either format."""
    if is_sharded_checkpoint(path):
        return open_sharded(path).trainer_state()
    return open_full(path).trainer_state()


def _state_dict(path) -> dict[str, Any]:
    return consolidated_state_dict(path) if is_sharded_checkpoint(path) else dict(open_full(path).checkpoint["state_dict"])


def _base_reference(path) -> Optional[dict[str, Any]]:
    if not (is_sharded_checkpoint(path) or is_torch_file(Path(path))):
        return None  # not ours to read: Lightning's loader says what it is
    return _trainer_state(path).get(BASE_KEY)


def _load_adapters(reference: Mapping[str, Any], module: nn.Module, state_dict: Mapping[str, Any], strict: bool) -> None:
    check_module_base(reference, module, where="This checkpoint")
    load_adapters(module, state_dict, strict=strict)


register_sharded_checkpoint_reader(ShardedCheckpointReader(
    is_sharded=is_sharded_checkpoint,
    hyper_parameters=lambda path: _trainer_state(path).get("hyper_parameters", {}),
    state_dict=_state_dict,
    base_reference=_base_reference,
    load_adapters=_load_adapters,
))
