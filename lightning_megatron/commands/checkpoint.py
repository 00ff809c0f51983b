"""``lightning-megatron checkpoint``: look into, consolidate and convert checkpoints.

All of them run in one process without torch.distributed, whatever layout saved the checkpoint, and read both
formats that ``Megatron3DStrategy`` saves: a sharded directory (``checkpoint_format="sharded"``, the default) and a
single file (``checkpoint_format="full"``); which one a path holds is read from the disk::

    lightning-megatron checkpoint inspect  runs/last.ckpt [--keys]
    lightning-megatron checkpoint consolidate runs/last.ckpt model.safetensors [--optimizer]
    lightning-megatron checkpoint convert runs/last.ckpt hf_out/ [--model-type mistral] [--max-shard-size 2GB]
                                                                          # ours -> Hugging Face, shard by shard
    lightning-megatron checkpoint convert lora.ckpt merged_hf/             # a LoRA run's: adapters merged into the base
    lightning-megatron checkpoint convert lora.ckpt adapter/ --peft       # a LoRA run's adapters, for peft
    lightning-megatron checkpoint convert hf_model/ converted.ckpt        # Hugging Face -> ours (weights only)
    lightning-megatron checkpoint verify runs/last.ckpt                   # every file against its recorded CRC-32
    lightning-megatron checkpoint recover runs/                            # finish saves a crash interrupted

``convert`` decides the direction from the source: a checkpoint of ours (a directory with
``megatron_3d.json``, or a full checkpoint file) goes to a Hugging Face ``save_pretrained`` directory, a
directory with ``config.json`` is read as a Hugging Face model. Anything else is refused with what was expected.
A LoRA run's checkpoint (its hyper-parameters hold ``lora``) exports the merged model, ``W + scale * B @ A`` in
every adapted layer, taking the base from the checkpoint or, for an adapter-only checkpoint, from the Hugging Face
directory its reference names (checked against the fingerprint recorded at the save: ``checkpoint.base``); with
``--peft`` it writes the adapters alone as a PEFT adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained(base, directory)`` loads.
An export of a run that started from a Hugging Face directory (``pretrained``, or an adapter-only checkpoint's base)
carries that base's tokenizer files, its special token ids (``config.json``) and a ``generation_config.json``
(``huggingface.companions``), so that ``transformers`` and ``lightning-megatron generate`` use it as is; without a
recorded base the command says what to add.
Nothing is ever unpickled but tensors and plain containers (``torch.load(weights_only=True)``, or DCP's index).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Sequence, Union

import torch

from lightning_megatron.checkpoint.base import BASE_KEY
from lightning_megatron.checkpoint.full import open_full, verify_full
from lightning_megatron.checkpoint.open import (
    FULL,
    MODEL_PREFIX,
    SHARDED,
    checkpoint_format,
    model_config,
    open_checkpoint,
)
from lightning_megatron.checkpoint.replacement import (
    check_replaceable,
    finish_interrupted,
    finish_interrupted_saves,
    is_sharded_checkpoint_dir,
)
from lightning_megatron.checkpoint.sharded import open_sharded, verify_checksums, write_atomically
from lightning_megatron.huggingface.checkpoints import convert
from lightning_megatron.huggingface.convert import model_types_of
from lightning_megatron.models.gpt import GPTConfig
from lightning_megatron.huggingface.io import DEFAULT_MAX_SHARD_SIZE, safetensors_torch


def _megabytes(size: int) -> str:
    return f"{size / 2**20:,.2f} MiB"


def inspect(path: Union[str, Path], *, keys: bool = False) -> str:
    """A readable summary: what saved it (format, layout, step, model), and the tensors by kind."""
    saved = open_checkpoint(path)
    info = saved.info
    model = info.get("model")
    if model is None:
        try:
            model = (f"not recorded (its hyper_parameters hold a "
                     f"{type(model_config(saved.trainer_state().get('hyper_parameters') or {})).__name__})")
        except ValueError:
            model = "not recorded"
    disk = sum(file.stat().st_size for file in saved.files)
    lines = [f"checkpoint   {saved.path}",
             "format       " + ("sharded (a directory: each rank wrote its shards)" if saved.format == SHARDED else
                                "full (one file: checkpoint_format='full', tensors gathered to global names)"),
             f"model        {model}",
             f"step         global_step={info.get('global_step')} epoch={info.get('epoch')}",
             f"precision    {info.get('precision', 'not recorded')}",
             "layout       " + (" ".join(f"{name}={value}" for name, value in info.get("layout", {}).items())
                                  or "not recorded"),
             f"world size   {info.get('world_size')}"]
    base = saved.trainer_state().get(BASE_KEY) if saved.format == FULL else info.get("base")
    if base is not None:
        lines.append(f"base         {base['pretrained']} (adapter-only: the frozen base weights are read from there)")
    groups: dict[str, list] = defaultdict(list)
    for name, spec in sorted(saved.specs.items()):
        groups[name.split("/", 1)[0]].append((name, spec))
    if saved.format == SHARDED:
        lines.append(f"files        {len(saved.files)} shard files, {_megabytes(disk)} on disk")
        checksums = info.get("checksums")
        lines.append(f"checksums    {checksums['algorithm']} of {len(checksums['files'])} files (`checkpoint verify` "
                     f"compares them)" if checksums else "checksums    none recorded")
    else:
        lines.append(f"files        1 file, {_megabytes(disk)} on disk")
        lines.append("checksums    the archive's CRC-32 of each record (`checkpoint verify` compares them)")
        if "optimizer" in groups:
            lines.append("             optimizer state is numbered by position in the optimizer's param groups")
    for group, members in groups.items():
        size = sum(spec.numel() * spec.element_size() for _, spec in members)
        lines.append(f"{group:<12} {len(members)} tensors, {_megabytes(size)}")
        if keys:
            lines.extend(f"    {name[len(group) + 1:]}  {tuple(spec.shape)}  {str(spec.dtype).removeprefix('torch.')}"
                         for name, spec in members)
    return "\n".join(lines)


def consolidate(path: Union[str, Path], out: Union[str, Path], *, optimizer: bool = False) -> Path:
    """Write one plain state dict: the LightningModule's tensors under their names (``.safetensors``, or
    ``.pt`` for ``torch.load(weights_only=True)``); with ``optimizer`` also the optimizer state and fp32
    main parameters under their checkpoint keys (``optimizer/0/<param>/exp_avg``; a full checkpoint holds rank
    zero's optimizer state as saved, its parameters numbered, ``optimizer/0/<position>/exp_avg``, and no main
    parameters). ``path``: a sharded directory or a full checkpoint file."""
    saved = open_checkpoint(path)
    names = [name for name in saved.specs if optimizer or name.startswith(MODEL_PREFIX)]
    tensors = {(name[len(MODEL_PREFIX):] if name.startswith(MODEL_PREFIX) else name): tensor.contiguous()
               for name, tensor in saved.read(names).items()}
    out = Path(out)
    if out.suffix == ".safetensors":
        metadata = {"format": "lightning-megatron", "source": str(saved.path),
                    "info": json.dumps({"format": saved.format, **saved.info}, default=str)}
        save_file = safetensors_torch().save_file

        def write(path: Path) -> None:
            save_file(tensors, str(path), metadata=metadata)
    elif out.suffix == ".pt":
        def write(path: Path) -> None:
            torch.save(tensors, path)
    else:
        raise ValueError(f"Output {out} must end in .safetensors or .pt.")
    check_replaceable(out, what="consolidated state dict")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, write)
    return out


def verify(path: Union[str, Path]) -> str:
    """Compare every file of a sharded checkpoint with the checksum its save recorded; every record of a full
    checkpoint file with the CRC-32 its zip archive recorded (and that it opens with ``weights_only=True``)."""
    start = time.perf_counter()
    if checkpoint_format(path) == FULL:
        records, read = verify_full(path)
        open_full(path)
        seconds = time.perf_counter() - start
        return (f"{path}: 1 file of {records} records, {_megabytes(read)}, every CRC-32 matches the archive's "
                f"({seconds:.2f} s)")
    saved = open_sharded(path)
    read = verify_checksums(saved)
    seconds = time.perf_counter() - start
    files = len(saved.info["checksums"]["files"])
    return (f"{saved.path}: {files} files, {_megabytes(read)}, every {saved.info['checksums']['algorithm']} matches "
            f"({seconds:.2f} s, {read / 2**30 / max(seconds, 1e-9):.2f} GiB/s)")


def recover(path: Union[str, Path]) -> str:
    """Finish what interrupted saves left: for one checkpoint name, or every name in a directory of them."""
    path = Path(path)
    if path.is_dir() and not is_sharded_checkpoint_dir(path):
        done = finish_interrupted_saves(path)
    else:
        done = finish_interrupted(path)
    return "\n".join(done) if done else f"nothing to recover at {path}"


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="lightning-megatron checkpoint", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("inspect", help="format, layout, step and tensors of a checkpoint (sharded or full)")
    p.add_argument("path")
    p.add_argument("--keys", action="store_true", help="list every tensor with its global shape and dtype")
    p = commands.add_parser("consolidate", help="write one state dict (.safetensors or .pt)")
    p.add_argument("path")
    p.add_argument("out")
    p.add_argument("--optimizer", action="store_true", help="also the optimizer state and fp32 main parameters")
    p = commands.add_parser("convert", help="to a Hugging Face directory (a LoRA run's: merged, or with --peft a "
                                            "PEFT adapter), or from one to a weights-only checkpoint")
    p.add_argument("source")
    p.add_argument("out")
    p.add_argument("--model-type", choices=model_types_of(GPTConfig), default=None,
                   help="the Hugging Face family of a GPT export (default: the one its config describes, e.g. qwen2 "
                        "for biases on qkv alone, gemma3_text for four norms a layer, else llama)")
    p.add_argument("--peft", action="store_true",
                   help="a LoRA run's checkpoint: write its adapters as a PEFT adapter directory (adapter_config.json, "
                        "adapter_model.safetensors) instead of the merged model")
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                   help=f"most bytes per weight file of an export, e.g. 500MB (default {DEFAULT_MAX_SHARD_SIZE}); "
                        f"also about the most weights held in memory")
    p = commands.add_parser("verify", help="compare every file with the checksum recorded when it was saved "
                                           "(a full checkpoint: its archive's CRC-32s)")
    p.add_argument("path")
    p = commands.add_parser("recover", help="finish saves a crash interrupted (a checkpoint name, or a directory)")
    p.add_argument("path")
    args = parser.parse_args(list(argv))
    try:
        if args.command == "inspect":
            print(inspect(args.path, keys=args.keys))
        elif args.command == "consolidate":
            print(f"wrote {consolidate(args.path, args.out, optimizer=args.optimizer)}")
        elif args.command == "convert":
            print(convert(args.source, args.out, model_type=args.model_type, max_shard_size=args.max_shard_size,
                          peft=args.peft))
        else:
            print({"verify": verify, "recover": recover}[args.command](args.path))
    except (ImportError, OSError, RuntimeError, ValueError) as error:
        parser.exit(1, f"lightning-megatron checkpoint {args.command}: error: {error}\n")
