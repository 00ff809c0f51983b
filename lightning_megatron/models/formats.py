"""Conversions and readers a model offers (``GPT.from_hf``, ``GPT(...).to_hf``, ``GPT.load_from_checkpoint`` of a
sharded directory) but does not implement.

The Hugging Face package (``lightning_megatron.huggingface``) imports the models to build them. If
the models imported it back, even inside a method, the two would form an import circle and the
models could not be read, imported or tested without the converters. So the converter registers
itself here when it is imported (``lightning_megatron/__init__.py`` imports it), keyed by the config
class it reads and writes, and the models look it up at call time. The sharded-checkpoint reader of
``lightning_megatron.checkpoint`` registers itself the same way.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional


class HFFormat(NamedTuple):
    """``read(model_or_dir) -> (config, full state dict)``; ``write(out_dir, config, state_dict, **options)``;
    ``read_config(directory) -> config`` (no weights read); ``read_peft_adapter(directory, config, base=...) ->
    (LoRAConfig, adapter tensors)`` where the family has LoRA adapters (a PEFT adapter directory)."""

    read: Callable[[Any], tuple[Any, dict]]
    write: Callable[..., list]
    read_config: Callable[[Any], Any]
    read_peft_adapter: Optional[Callable[..., tuple[Any, dict]]] = None


_HF_FORMATS: dict[type, HFFormat] = {}


def register_hf_format(config_class: type, hf_format: HFFormat) -> None:
    """Make ``hf_format`` the Hugging Face converter of models configured by ``config_class``."""
    _HF_FORMATS[config_class] = hf_format


def hf_format_for(config_class: type) -> HFFormat:
    """The registered converter, or a ``RuntimeError`` that says how to register it."""
    try:
        return _HF_FORMATS[config_class]
    except KeyError:
        raise RuntimeError(f"No Hugging Face converter is registered for {config_class.__name__}: import "
                           f"lightning_megatron.huggingface (importing lightning_megatron does) first.") from None


class ShardedCheckpointReader(NamedTuple):
    """How ``load_from_checkpoint`` reads a sharded checkpoint directory, or an adapter-only checkpoint of either
    format (``checkpoint/base.py``), into one process.

    ``base_reference(path)``: the base an adapter-only checkpoint refers to (None for any other);
    ``load_adapters(reference, module, state_dict, strict)``: check the module's base against it, then load."""

    is_sharded: Callable[[Any], bool]
    hyper_parameters: Callable[[Any], dict]
    state_dict: Callable[[Any], dict]
    base_reference: Callable[[Any], Optional[dict]]
    load_adapters: Callable[..., None]


_SHARDED_READER: list[ShardedCheckpointReader] = []


def register_sharded_checkpoint_reader(reader: ShardedCheckpointReader) -> None:
    _SHARDED_READER[:] = [reader]


def sharded_checkpoint_reader() -> ShardedCheckpointReader | None:
    """The registered reader (``lightning_megatron.checkpoint`` registers it at import), if any."""
    return _SHARDED_READER[0] if _SHARDED_READER else None
