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
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import lightning as L
import torch
from torch import Tensor

from lightning_megatron.checkpoint.base import BASE_KEY
from lightning_megatron.checkpoint.full import open_full, verify_full
from lightning_megatron.checkpoint.lora_export import adapter_tensors, merged_source
from lightning_megatron.checkpoint.replacement import (
    INDEX_FILE,
    check_replaceable,
    describe,
    exists,
    finish_interrupted,
    finish_interrupted_saves,
    is_sharded_checkpoint_dir,
    is_torch_file,
    safetensors_metadata,
)
from lightning_megatron.checkpoint.sharded import (
    INFO_FILE,
    open_sharded,
    read_full_tensors,
    save_sharded,
    verify_checksums,
    write_atomically,
)
from lightning_megatron.checkpoint.training_state import LAYOUT_KEY
from lightning_megatron.huggingface import TensorSource, read_hf, write_hf
from lightning_megatron.huggingface.adapters import write_peft_adapter
from lightning_megatron.huggingface.companions import GENERATION_CONFIG
from lightning_megatron.huggingface.io import DEFAULT_MAX_SHARD_SIZE, safetensors_torch
from lightning_megatron.models.bert import BERTConfig
from lightning_megatron.models.gpt import GPTConfig
from lightning_megatron.peft.lora import LoRAConfig

MODEL_PREFIX = "state_dict/"


def _megabytes(size: int) -> str:
    return f"{size / 2**20:,.2f} MiB"


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
    the merged model (``checkpoint.lora_export``; an adapter-only one reads its base from the directory its
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
            tensors = merged_source(tensors, lora.scale, reference, where=f"Checkpoint {source}")
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


def recorded_base(trainer_state: dict[str, Any]) -> Optional[str]:
    """The Hugging Face directory a run started from, as its checkpoint records it: the base reference of an
    adapter-only checkpoint (resolved at the save), else the module's ``pretrained`` hyper-parameter."""
    reference = trainer_state.get(BASE_KEY)
    return reference["pretrained"] if reference is not None else (trainer_state.get("hyper_parameters") or {}).get(
        "pretrained")


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
    p.add_argument("--model-type", choices=("llama", "mistral", "qwen2"), default=None,
                   help="the Hugging Face family of a Llama-shaped GPT export (default: qwen2 for biases on qkv alone, "
                        "else llama)")
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
