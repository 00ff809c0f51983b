"""``lightning-megatron checkpoint``: look into, consolidate and convert sharded checkpoints.

All of them run in one process without torch.distributed, whatever layout saved the checkpoint::

    lightning-megatron checkpoint inspect  runs/last.ckpt [--keys]
    lightning-megatron checkpoint consolidate runs/last.ckpt model.safetensors [--optimizer]
    lightning-megatron checkpoint convert runs/last.ckpt hf_out/ [--model-type mistral] [--max-shard-size 2GB]
                                                                          # ours -> Hugging Face, shard by shard
    lightning-megatron checkpoint convert hf_model/ converted.ckpt        # Hugging Face -> ours (weights only)
    lightning-megatron checkpoint verify runs/last.ckpt                   # every file against its recorded CRC-32
    lightning-megatron checkpoint recover runs/                            # finish saves a crash interrupted

``convert`` decides the direction from the source: a sharded checkpoint directory (it has
``megatron_3d.json``) goes to a Hugging Face ``save_pretrained`` directory, anything else
is read as a Hugging Face model directory.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import lightning as L
import torch

from lightning_megatron.checkpoint.replacement import check_replaceable, finish_interrupted, finish_interrupted_saves, is_sharded_checkpoint_dir
from lightning_megatron.checkpoint.sharded import (
    INFO_FILE,
    open_sharded,
    read_full_tensors,
    save_sharded,
    verify_checksums,
    write_atomically,
)
from lightning_megatron.huggingface import TensorSource, read_hf, write_hf
from lightning_megatron.huggingface.io import DEFAULT_MAX_SHARD_SIZE, safetensors_torch
from lightning_megatron.models.bert import BERTConfig
from lightning_megatron.models.gpt import GPTConfig

MODEL_PREFIX = "state_dict/"


def _megabytes(size: int) -> str:
    return f"{size / 2**20:,.2f} MiB"


def inspect(path: Union[str, Path], *, keys: bool = False) -> str:
    """A readable summary: what saved it (layout, step, model), and the tensors by kind."""
    saved = open_sharded(path)
    info = saved.info
    lines = [f"checkpoint   {saved.path}",
             f"model        {info.get('model')}",
             f"step         global_step={info.get('global_step')} epoch={info.get('epoch')}",
             f"precision    {info.get('precision')}",
             "layout       " + " ".join(f"{name}={value}" for name, value in info.get("layout", {}).items()),
             f"world size   {info.get('world_size')}"]
    groups: dict[str, list] = defaultdict(list)
    for name, md in sorted(saved.tensors().items()):
        groups[name.split("/", 1)[0]].append((name, md))
    files = {item.relative_path for item in (saved.index.storage_data or {}).values()}
    disk = sum((saved.path / name).stat().st_size for name in files)
    lines.append(f"files        {len(files)} shard files, {_megabytes(disk)} on disk")
    checksums = info.get("checksums")
    lines.append(f"checksums    {checksums['algorithm']} of {len(checksums['files'])} files (`checkpoint verify` compares "
                 f"them)" if checksums else "checksums    none recorded")
    for group, members in groups.items():
        size = sum(md.size.numel() * md.properties.dtype.itemsize for _, md in members)
        lines.append(f"{group:<12} {len(members)} tensors, {_megabytes(size)}")
        if keys:
            lines.extend(f"    {name[len(group) + 1:]}  {tuple(md.size)}  {str(md.properties.dtype).removeprefix('torch.')}"
                         for name, md in members)
    return "\n".join(lines)


def consolidate(path: Union[str, Path], out: Union[str, Path], *, optimizer: bool = False) -> Path:
    """Write one plain state dict: the LightningModule's tensors under their names (``.safetensors``, or
    ``.pt`` for ``torch.load(weights_only=True)``); with ``optimizer`` also the optimizer state and fp32
    main parameters under their checkpoint keys (``optimizer/0/<param>/exp_avg``)."""
    saved = open_sharded(path)
    names = [name for name in saved.tensors() if optimizer or name.startswith(MODEL_PREFIX)]
    tensors = {(name[len(MODEL_PREFIX):] if name.startswith(MODEL_PREFIX) else name): tensor.contiguous()
               for name, tensor in read_full_tensors(path, names).items()}
    out = Path(out)
    if out.suffix == ".safetensors":
        metadata = {"format": "lightning-megatron", "source": str(saved.path),
                    "info": json.dumps(saved.info, default=str)}
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


def checkpoint_source(path: Union[str, Path]) -> TensorSource:
    """The LightningModule's model tensors of a sharded checkpoint (``GPTModel``/``BERTModel`` names), read a few
    at a time: the index gives every shape and dtype, and each read loads only the tensors asked for."""
    prefix = MODEL_PREFIX + "model."
    specs = {name[len(prefix):]: torch.empty(tuple(md.size), dtype=md.properties.dtype, device="meta")
             for name, md in open_sharded(path).tensors().items() if name.startswith(prefix)}

    def read(names: Sequence[str]) -> dict[str, torch.Tensor]:
        tensors = read_full_tensors(path, [prefix + name for name in names])
        return {name[len(prefix):]: tensor for name, tensor in tensors.items()}

    return TensorSource(specs, read)


def convert(source: Union[str, Path], out: Union[str, Path], *, model_type: Optional[str] = None,
            max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE) -> str:
    """Ours -> Hugging Face when ``source`` is a sharded checkpoint, else Hugging Face -> ours.

    Ours -> Hugging Face reads the checkpoint shard by shard of the output (at most ``max_shard_size`` of
    weights in memory, never the whole model); ``model_type`` picks the family where several can hold the
    model (a Llama-shaped GPT: ``llama`` by default, ``mistral``, ``qwen2``).
    """
    source, out = Path(source), Path(out)
    if (source / INFO_FILE).is_file():
        check_replaceable(out, what="Hugging Face model", hf_export=True)
        saved = open_sharded(source)
        config = model_config(saved.trainer_state().get("hyper_parameters", {}))
        write_hf(out, config, checkpoint_source(source), model_type=model_type, max_shard_size=max_shard_size)
        return f"wrote a Hugging Face {type(config).__name__.removesuffix('Config')} model to {out}"
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


def verify(path: Union[str, Path]) -> str:
    """Compare every file of a sharded checkpoint with the checksum its save recorded."""
    start = time.perf_counter()
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
    p = commands.add_parser("inspect", help="layout, step and tensors of a sharded checkpoint")
    p.add_argument("path")
    p.add_argument("--keys", action="store_true", help="list every tensor with its global shape and dtype")
    p = commands.add_parser("consolidate", help="write one state dict (.safetensors or .pt)")
    p.add_argument("path")
    p.add_argument("out")
    p.add_argument("--optimizer", action="store_true", help="also the optimizer state and fp32 main parameters")
    p = commands.add_parser("convert", help="to a Hugging Face directory, or from one to a weights-only checkpoint")
    p.add_argument("source")
    p.add_argument("out")
    p.add_argument("--model-type", choices=("llama", "mistral", "qwen2"), default=None,
                   help="the Hugging Face family of a Llama-shaped GPT export (default: qwen2 for biases on qkv alone, "
                        "else llama)")
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                   help=f"most bytes per weight file of an export, e.g. 500MB (default {DEFAULT_MAX_SHARD_SIZE}); "
                        f"also about the most weights held in memory")
    p = commands.add_parser("verify", help="compare every file with the checksum recorded when it was saved")
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
            print(convert(args.source, args.out, model_type=args.model_type, max_shard_size=args.max_shard_size))
        else:
            print({"verify": verify, "recover": recover}[args.command](args.path))
    except (ImportError, OSError, RuntimeError, ValueError) as error:
        parser.exit(1, f"lightning-megatron checkpoint {args.command}: error: {error}\n")
