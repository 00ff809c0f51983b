"""Our checkpoints to and from Hugging Face ``save_pretrained`` directories: ``convert``, what
``lightning-megatron checkpoint convert`` runs (``commands.checkpoint``).

``convert`` decides the direction from the source: a checkpoint of ours (a directory with ``megatron_3d.json``, or
a full checkpoint file) goes to a Hugging Face directory, read shard by shard of the output (``checkpoint_source``);
a directory with ``config.json`` is read as a Hugging Face model and saved as a weights-only sharded checkpoint.
A LoRA run's checkpoint exports the merged model or, with ``peft``, its adapters alone (``huggingface.lora_export``).
An export of a run that started from a Hugging Face directory carries that base's tokenizer files and generation
settings (``huggingface.companions``); ``companions_note`` says what it got, or what to add.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence, Union

import lightning as L
import torch

from lightning_megatron.checkpoint.base import BASE_KEY
from lightning_megatron.checkpoint.open import (
    HUGGING_FACE,
    MODEL_PREFIX,
    Checkpoint,
    checkpoint_format,
    model_config,
    open_checkpoint,
    recorded_base,
)
from lightning_megatron.checkpoint.replacement import check_replaceable
from lightning_megatron.checkpoint.sharded import save_sharded
from lightning_megatron.huggingface.adapters import write_peft_adapter
from lightning_megatron.huggingface.companions import GENERATION_CONFIG
from lightning_megatron.huggingface.convert import read_hf, write_hf
from lightning_megatron.huggingface.family import TensorSource
from lightning_megatron.huggingface.io import DEFAULT_MAX_SHARD_SIZE
from lightning_megatron.huggingface.lora_export import adapter_tensors, merged_source
from lightning_megatron.models.gpt import GPTConfig
from lightning_megatron.peft.lora import LoRAConfig


def checkpoint_source(checkpoint: Union[str, Path, Checkpoint]) -> TensorSource:
    """The LightningModule's model tensors of a checkpoint of either format (``GPTModel``/``BERTModel`` names),
    read a few at a time: the index (or the file's memory map) gives every shape and dtype, and each read loads
    only the tensors asked for."""
    saved = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
    prefix = MODEL_PREFIX + "model."
    specs = {name[len(prefix):]: spec for name, spec in saved.specs.items() if name.startswith(prefix)}

    def read(names: Sequence[str]) -> dict[str, torch.Tensor]:
        tensors = saved.read([prefix + name for name in names])
        return {name[len(prefix):]: tensor for name, tensor in tensors.items()}

    return TensorSource(specs, read)


def convert(source: Union[str, Path], out: Union[str, Path], *, model_type: Optional[str] = None,
            max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE, peft: bool = False) -> str:
    """Ours -> Hugging Face when ``source`` is a checkpoint of ours (a sharded directory or a full file), Hugging
    Face -> ours when it is a ``save_pretrained`` directory (``config.json``); ``ValueError`` for anything else.

    Ours -> Hugging Face reads the checkpoint shard by shard of the output (at most ``max_shard_size`` of
    weights in memory, never the whole model); ``model_type`` picks the family where several can hold the
    model (a Llama-shaped GPT: ``llama`` by default, ``mistral``, ``qwen2``). A LoRA run's checkpoint exports
    the merged model (``huggingface.lora_export``; an adapter-only one reads its base from the directory its
    reference names), or with ``peft`` its adapters alone, as a PEFT adapter directory.
    """
    source, out = Path(source), Path(out)
    if checkpoint_format(source, hugging_face=True) != HUGGING_FACE:
        saved = open_checkpoint(source)  # a damaged one is refused before anything is written
        trainer_state = saved.trainer_state()
        hyper = trainer_state.get("hyper_parameters") or {}
        config, lora = model_config(hyper), LoRAConfig.of(hyper.get("lora"))
        reference, tensors = trainer_state.get(BASE_KEY), checkpoint_source(saved)
        if peft:
            if lora is None:
                raise ValueError(f"--peft exports LoRA adapters, but {source} was saved by a run without lora; "
                                 f"leave --peft out to export the model.")
            base = recorded_base(trainer_state)
            write_peft_adapter(out, config, adapter_tensors(tensors), lora, base_model=base, model_type=model_type)
            return f"wrote a PEFT LoRA adapter to {out} (base model: {base or 'not recorded'})"
        if lora is not None:
            tensors = merged_source(tensors, lora.scale, reference, config, where=f"Checkpoint {source}")
        check_replaceable(out, what="Hugging Face model", hf_export=True)
        base = recorded_base(trainer_state)
        usable_base = base is not None and Path(base).is_dir()
        written = write_hf(out, config, tensors, model_type=model_type, max_shard_size=max_shard_size, base=base)
        merged = " (LoRA adapters merged)" if lora is not None else ""
        done = f"wrote a Hugging Face {type(config).__name__.removesuffix('Config')} model{merged} to {out}"
        return f"{done}\n{companions_note(out, base, usable_base, written)}"
    if peft:
        raise ValueError(f"--peft exports the adapters of a checkpoint of ours; {source} is a Hugging Face directory.")
    if model_type is not None:
        raise ValueError(f"--model-type={model_type!r} chooses the family of an export; {source} is read as a Hugging "
                         f"Face directory, whose config.json names its own model_type.")
    check_replaceable(out)
    config, state_dict = read_hf(source)
    tensors = {f"{MODEL_PREFIX}model.{name}": tensor.contiguous() for name, tensor in state_dict.items()}
    trainer_state = {"epoch": 0, "global_step": 0, "pytorch-lightning_version": L.__version__,
                     "hyper_parameters": {"config": asdict(config)}}
    family = "GPT" if isinstance(config, GPTConfig) else "BERT"
    info = {"model": f"lightning_megatron.models.{family}", "global_step": 0, "epoch": 0, "converted_from": str(source),
            "layout": {}, "world_size": 1}
    save_sharded(out, tensors, trainer_state, info, checksums=True)
    return f"wrote a weights-only {family} checkpoint to {out}"


def companions_note(out: Path, base: Optional[str], usable: bool, written: list[str]) -> str:
    """What the export got of the base's tokenizer and generation settings (``written``, by ``write_hf``); without
    them, what the user should add."""
    tokenizer = [name for name in written if name != GENERATION_CONFIG]
    settings = f"; wrote {GENERATION_CONFIG}" if GENERATION_CONFIG in written else ""
    if tokenizer:
        return f"copied the tokenizer of the base {base} ({', '.join(tokenizer)}){settings}"
    why = ("the checkpoint records no base model (`pretrained`)" if base is None else
           f"the base {base} that the checkpoint records holds no tokenizer files" if usable else
           f"the base {base} that the checkpoint records is not there (moved, or a path relative to another directory)")
    return (f"no tokenizer copied: {why}{settings}. A model of the byte tokenizer needs none; for another, copy its "
            f"files into {out} (tokenizer.save_pretrained('{out}')) and set bos/eos_token_id in its config.json.")
