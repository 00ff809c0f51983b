"""Checkpoint save and load time and bytes per rank: our sharded checkpoints against Lightning's DCP, in one table.

The same GPT, trained for ``--steps`` optimizer steps (so that AdamW's state exists), is saved
with ``trainer.save_checkpoint`` and restored by a fresh Trainer and module under

* ``Megatron3DStrategy(tensor_parallel_size=tp, zero_stage=1)``, ``checkpoint_format="sharded"``
  (the default): every rank writes its own shards of the weights and the optimizer state
  (torch.distributed.checkpoint), keyed by global names;
* the same strategy with ``checkpoint_format="full"``: the weights are gathered and rank 0
  writes one file, which is what sharding avoids;
* Lightning's ``ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)`` with
  FSDP2 over dp and torch's DTensor plan over tp (``throughput.py``'s ``DTensorGPT``), whose
  ``save_checkpoint`` writes a DCP directory too: the baseline of the ratios.

Each configuration runs in fresh processes under ``torchrun`` (gloo on the CPU); every rank
writes its timings as JSON and the parent prints the table. See ``benchmarks/README.md``.

Example::

    python -m benchmarks.checkpoint                       # 4 ranks, dp=2 x tp=2, GPT h=512: 1-2 minutes on 2 cores
    python -m benchmarks.checkpoint --hidden 256 --repeats 5
    python -m benchmarks.checkpoint --variants megatron_sharded model_parallel model_parallel_fsdp
    python -m benchmarks.checkpoint --quick               # tiny model, 2 ranks: a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_megatron import Megatron3DStrategy
from lightning_megatron.models.gpt import GPT
from lightning_megatron.models.transformer import TransformerLayer
from benchmarks.memory.model_state import FullyShardedGPT
from benchmarks.harness.launch import add_worker_flags, run_checked, torchrun, worker_env
from benchmarks.harness.tables import MIB, format_rows
from benchmarks.harness.training import SyntheticTokens, gpt_config, quiet_trainer
from benchmarks.throughput import DTensorGPT

DCP_SHARD_FILE = re.compile(r"__(\d+)_\d+\.distcp")  # torch's FileSystemWriter: __<rank>_<file>.distcp


# ---------------------------------------------------------------------------- variants
@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    baseline: bool = False  # the row the ratios are taken against


VARIANTS = (
    Variant("model_parallel", "ModelParallelStrategy (DCP)", baseline=True),
    Variant("model_parallel_fsdp", "ModelParallelStrategy FSDP2 only (DCP)"),
    Variant("megatron_sharded", "Megatron3DStrategy sharded"),
    Variant("megatron_full", "Megatron3DStrategy full"),
)
DEFAULT_VARIANTS = ("model_parallel", "megatron_sharded", "megatron_full")


def layout(variant: str, args: argparse.Namespace) -> str:
    dp = args.ranks // args.tp
    if variant == "model_parallel_fsdp":
        return f"dp={args.ranks} FSDP2"
    if variant == "model_parallel":
        return f"dp={dp} FSDP2 x tp={args.tp} DTensor" if args.tp > 1 else f"dp={dp} FSDP2"
    return f"dp={dp} x tp={args.tp}, ZeRO-1"


# ---------------------------------------------------------------------------- arguments
QUICK = dict(hidden=64, layers=2, heads=2, seq=32, vocab=256, ranks=2, repeats=1)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256,
                        help="vocabulary size (256: a multiple of tp * 128 up to tp=2, so Megatron pads nothing "
                             "and every variant holds the same parameters)")
    parser.add_argument("--batch", type=int, default=2, help="samples per step on each data-parallel rank")
    parser.add_argument("--ranks", type=int, default=4, help="processes (world size)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size; dp = ranks / tp")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps before saving (so Adam's state exists)")
    parser.add_argument("--repeats", type=int, default=5, help="saves and loads per variant; the table shows medians")
    parser.add_argument("--out-dir", type=Path,
                        help="where the checkpoints go (kept: the last save of each variant); default: a temporary "
                             "directory, removed at the end")
    parser.add_argument("--variants", nargs="+", choices=[v.key for v in VARIANTS], default=list(DEFAULT_VARIANTS),
                        help=f"which rows to run (default: {' '.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: changes the defaults to " +
                             " ".join(f"--{k} {v}" for k, v in QUICK.items()) + " (flags given still win)")
    parser.add_argument("--seed", type=int, default=1234)
    add_worker_flags(parser, [v.key for v in VARIANTS])
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    if args.ranks % args.tp:
        parser.error(f"--ranks {args.ranks} is not a multiple of --tp {args.tp}")
    return args


# ---------------------------------------------------------------------------- modules and strategies
class FullyShardedDTensorGPT(DTensorGPT):
    """2-D parallelism as torchtitan composes it: the DTensor tp plan first, then FSDP2 over dp on each
    transformer layer and on the root (embedding, tied head, final norm)."""

    def configure_model(self) -> None:
        if self.model is not None:
            return
        super().configure_model()
        mesh = self.device_mesh["data_parallel"]
        for block in [m for m in self.model.modules() if isinstance(m, TransformerLayer)]:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class RestoreClock:
    """Times a restore inside ``trainer.fit(ckpt_path=...)``: from entering ``strategy.load_checkpoint`` to
    leaving the last restore call that reads tensors. Ours: ``load_checkpoint`` reads the weights (and fp32 main
    parameters), ``load_optimizer_state_dict`` the optimizer state. ``ModelParallelStrategy.load_checkpoint``
    reads both, and Lightning skips its ``load_optimizer_state_dict`` (``lightning_restore_optimizer`` is False).
    In between, Lightning restores the module's hooks, callbacks, loops and precision plugin (microseconds)."""

    def __init__(self) -> None:
        self.start: Optional[float] = None
        self.seconds: Optional[float] = None

    def started(self) -> None:
        self.start = time.perf_counter()

    def ended(self) -> None:
        self.seconds = time.perf_counter() - self.start


class TimedRestore:
    """Mixed into a strategy: a clock from entering ``load_checkpoint`` to the end of the last tensor read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.restore_clock = RestoreClock()

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        self.restore_clock.started()
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self.restore_clock.ended()
        return checkpoint


class TimedMegatron3DStrategy(TimedRestore, Megatron3DStrategy):
    def load_optimizer_state_dict(self, checkpoint) -> None:  # ours reads the optimizer state here
        super().load_optimizer_state_dict(checkpoint)
        self.restore_clock.ended()


class TimedModelParallelStrategy(TimedRestore, ModelParallelStrategy):
    """Lightning's ``load_checkpoint`` reads the optimizer state itself."""


def build(variant: str, args: argparse.Namespace):
    """A fresh module and strategy of one variant."""
    config = gpt_config(args)
    if variant.startswith("megatron"):
        strategy = TimedMegatron3DStrategy(tensor_parallel_size=args.tp, zero_stage=1,
                                           checkpoint_format=variant.removeprefix("megatron_"))
        return GPT(config), strategy
    if variant == "model_parallel_fsdp":
        strategy = TimedModelParallelStrategy(data_parallel_size=args.ranks, tensor_parallel_size=1)
        return FullyShardedGPT(config), strategy
    module = FullyShardedDTensorGPT(config) if args.tp > 1 else FullyShardedGPT(config)
    return module, TimedModelParallelStrategy(data_parallel_size=args.ranks // args.tp, tensor_parallel_size=args.tp)


def make_trainer(strategy, args: argparse.Namespace) -> L.Trainer:
    return quiet_trainer(strategy=strategy, accelerator="cpu", devices=args.ranks, precision="32-true",
                         max_steps=args.steps, num_sanity_val_steps=0)


def make_loader(args: argparse.Namespace) -> DataLoader:
    """No sampler: Lightning injects a ``DistributedSampler`` over the strategy's dp ranks (tp ranks share batches)."""
    dp = args.ranks // args.tp
    dataset = SyntheticTokens(args.steps * args.batch * dp, args.seq, args.vocab, args.seed)
    return DataLoader(dataset, batch_size=args.batch, drop_last=True)


# ---------------------------------------------------------------------------- what a checkpoint holds
def files_written(path: Path) -> dict[str, int]:
    """Every file of a checkpoint (a directory or one file) and its size."""
    if path.is_file():
        return {path.name: path.stat().st_size}
    return {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}


def contents(path: Path) -> dict[str, int]:
    """Tensor bytes by top-level key (``state_dict``, ``optimizer...``, ``main_params``), from the DCP index
    (each stored item's length) or, for a single file, from its tensors."""
    sizes: dict[str, int] = {}
    if path.is_dir():
        index = FileSystemReader(path).read_metadata()
        for item, info in (index.storage_data or {}).items():
            key = item.fqn.split("/")[0].split(".")[0]
            sizes[key] = sizes.get(key, 0) + info.length
        return sizes
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)

    def tensor_bytes(value) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, dict):
            return sum(tensor_bytes(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(tensor_bytes(v) for v in value)
        return 0

    for key, value in checkpoint.items():
        if tensor_bytes(value):
            sizes[key] = tensor_bytes(value)
    return sizes


# ---------------------------------------------------------------------------- worker
def all_ranks(value: Any) -> list:
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def fingerprint(trainer: L.Trainer) -> tuple[float, float]:
    """Sums (in float64) of this rank's local parameter shards and of its optimizer state tensors: a restore at
    the saving layout must give each rank back exactly what it held when it saved."""
    def local_sum(tensors) -> float:
        return sum(float((t.to_local() if isinstance(t, DTensor) else t).detach().double().sum()) for t in tensors)

    optimizers = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
    state = [v for o in optimizers for s in o.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return local_sum(trainer.lightning_module.parameters()), local_sum(state)


def worker_main(args: argparse.Namespace) -> None:
    """Train, save ``repeats`` times, restore ``repeats`` times; rank 0 writes ``result.json``."""
    rank = int(os.environ["RANK"])
    checkpoints = args.result_dir / "checkpoints"
    L.seed_everything(args.seed, verbose=False)
    module, strategy = build(args.worker, args)
    trainer = make_trainer(strategy, args)
    trainer.fit(module, make_loader(args))
    saved = fingerprint(trainer)

    save_seconds, files, path = [], {}, None
    for repeat in range(args.repeats):
        previous, path = path, checkpoints / f"step={args.steps}-save{repeat}.ckpt"
        dist.barrier()
        start = time.perf_counter()
        trainer.save_checkpoint(path)
        save_seconds.append(max(all_ranks(time.perf_counter() - start)))
        if rank == 0:
            files = files_written(path)
            if previous is not None:  # keep only the last save: it is the one restored below
                shutil.rmtree(previous) if previous.is_dir() else previous.unlink()
    dist.barrier()

    restore_seconds, resume_seconds, restored = [], [], []
    for repeat in range(args.repeats):
        module, strategy = build(args.worker, args)
        trainer = make_trainer(strategy, args)
        dist.barrier()
        start = time.perf_counter()
        trainer.fit(module, make_loader(args), ckpt_path=path)  # max_steps reached: restores, runs no step
        resume_seconds.append(max(all_ranks(time.perf_counter() - start)))
        restore_seconds.append(max(all_ranks(strategy.restore_clock.seconds)))
        if trainer.global_step != args.steps:
            raise RuntimeError(f"resumed at step {trainer.global_step}, saved at {args.steps}")
        now = fingerprint(trainer)
        same = all_ranks((now[0] == saved[0], now[1] == saved[1]))
        restored.append({"weights": all(w for w, _ in same), "optimizer": all(o for _, o in same)})

    if rank == 0:
        result = {"save_seconds": save_seconds, "restore_seconds": restore_seconds, "resume_seconds": resume_seconds,
                  "restored": restored, "files": files, "contents": contents(path), "directory": path.is_dir(),
                  "parameters": gpt_config(args).num_parameters()}
        (args.result_dir / "result.json").write_text(json.dumps(result))
    dist.barrier()
    os._exit(0)  # skip gloo's C++ teardown: with several meshes alive it aborts at random (torch 2.13)


# ---------------------------------------------------------------------------- parent
def launch(variant: Variant, args: argparse.Namespace, argv: list[str], result_dir: Path) -> dict:
    cmd = torchrun(args.ranks, __spec__.name, *argv, "--worker", variant.key, "--result-dir", str(result_dir))
    run_checked(cmd, variant.label, result_dir, worker_env())
    return json.loads((result_dir / "result.json").read_text())


def bytes_per_rank(result: dict, ranks: int) -> tuple[list[int], int]:
    """Shard bytes each rank wrote, and the small files (index, trainer state) rank 0 wrote besides.

    DCP names each rank's file ``__<rank>_<n>.distcp``; a single-file checkpoint is rank 0's alone.
    """
    shards, small = [0] * ranks, 0
    for name, size in result["files"].items():
        match = DCP_SHARD_FILE.fullmatch(name)
        if match:
            shards[int(match.group(1))] += size
        elif result["directory"]:
            small += size
        else:
            shards[0] += size
    return shards, small


def run_all(args: argparse.Namespace, argv: list[str], variants: list[Variant], root: Path) -> dict[str, dict]:
    results = {}
    for variant in variants:
        result_dir = root / variant.key
        result_dir.mkdir(parents=True, exist_ok=True)
        print(f"  {variant.label} ...", file=sys.stderr, flush=True)
        results[variant.key] = launch(variant, args, argv, result_dir)
    return results


def restored_text(result: dict) -> str:
    """What every restore gave back, bit for bit on every rank: weights and optimizer state, or less."""
    weights = all(r["weights"] for r in result["restored"])
    optimizer = all(r["optimizer"] for r in result["restored"])
    return "weights+optim" if weights and optimizer else "weights only" if weights else "NO (mismatch)"


def format_table(args: argparse.Namespace, variants: list[Variant], results: dict[str, dict]) -> str:
    def summary(result: dict) -> dict:
        shards, small = bytes_per_rank(result, args.ranks)
        return {"save": result["save_seconds"], "load": result["restore_seconds"], "resume": result["resume_seconds"],
                "max_rank": max(shards), "min_rank": min(shards), "small": small, "total": sum(shards) + small}

    def seconds(values: list[float]) -> str:
        """The median, and the range over repeats: a wide range means the machine was busy."""
        text = f"{statistics.median(values):.3f}"
        return text if len(values) == 1 else f"{text} [{min(values):.2f}-{max(values):.2f}]"

    summaries = {v.key: summary(results[v.key]) for v in variants}
    base = next((summaries[v.key] for v in variants if v.baseline), None)

    def ratio(key: str, name: str) -> str:
        if base is None:
            return "-"
        value, reference = summaries[key][name], base[name]
        if isinstance(value, list):
            value, reference = statistics.median(value), statistics.median(reference)
        return f"{value / reference:.2f}" if reference else "-"

    header = ["strategy / format", "layout", "save s", "load s", "resume s", "restored", "MiB/rank (min-max)",
              "index+state KiB", "total MiB", "save ratio", "load ratio", "MiB/rank ratio"]
    rows = [header]
    for v in variants:
        s = summaries[v.key]
        rows.append([v.label, layout(v.key, args), seconds(s["save"]), seconds(s["load"]),
                     f"{statistics.median(s['resume']):.2f}", restored_text(results[v.key]),
                     f"{s['min_rank'] / MIB:.2f}-{s['max_rank'] / MIB:.2f}", f"{s['small'] / 1024:.1f}",
                     f"{s['total'] / MIB:.2f}", ratio(v.key, "save"), ratio(v.key, "load"), ratio(v.key, "max_rank")])
    return format_rows(rows, left={0, 1, 5})


def describe(args: argparse.Namespace, results: dict[str, dict]) -> str:
    params = next(iter(results.values()))["parameters"]
    return (f"GPT h={args.hidden} layers={args.layers} heads={args.heads} seq={args.seq} vocab={args.vocab}: "
            f"{params / 1e6:.2f}M params, fp32 weights {4 * params / MIB:.1f} MiB, with AdamW's two moments "
            f"{12 * params / MIB:.1f} MiB; {args.ranks} ranks, cpu gloo, 32-true, saved after {args.steps} steps; "
            f"median [min-max] of {args.repeats} saves and {args.repeats} restores; torch {torch.__version__}, "
            f"lightning {L.__version__}")


def variant_text(key: str, args: argparse.Namespace) -> str:
    dp = args.ranks // args.tp
    if key.startswith("megatron"):
        return (f"Megatron3DStrategy(tensor_parallel_size={args.tp}, zero_stage=1, "
                f"checkpoint_format={key.removeprefix('megatron_')!r})")
    if key == "model_parallel" and args.tp > 1:
        return (f"ModelParallelStrategy(data_parallel_size={dp}, tensor_parallel_size={args.tp}); configure_model: "
                "DTensor Colwise/RowwiseParallel on attn.qkv, attn.proj, mlp.fc, mlp.proj (embedding, head and norms "
                "replicated over tp), then FSDP2 fully_shard over dp on each layer and the root")
    size = args.ranks if key == "model_parallel_fsdp" else dp
    return (f"ModelParallelStrategy(data_parallel_size={size}, tensor_parallel_size=1); configure_model: FSDP2 "
            "fully_shard on each layer and the root")


def footer(args: argparse.Namespace, variants: list[Variant], results: dict[str, dict]) -> str:
    held = "; ".join(
        f"{v.label}: " + ", ".join(f"{key} {size / MIB:.1f}" for key, size in sorted(results[v.key]["contents"].items()))
        for v in variants)
    notes = [f"{v.label} = {variant_text(v.key, args)}." for v in variants] + [
        "save s: trainer.save_checkpoint(path) to a new path after training, wall clock, the slowest rank (ranks enter "
        "together).",
        "load s: a fresh module and Trainer resume with trainer.fit(ckpt_path=..., max_steps=the saved step), so no "
        "step runs; timed from entering strategy.load_checkpoint to leaving the last restore call that reads tensors "
        "(ours: load_optimizer_state_dict; ModelParallelStrategy's load_checkpoint reads weights and optimizer state "
        "itself), the slowest rank. resume s: the whole fit call (Trainer setup, configure_model, parallelising, the "
        "restore, teardown), median.",
        "restored: after every restore, each rank's local weights and optimizer state tensors equal what it held when "
        "it saved (float64 sums, all ranks).",
        "MiB/rank: bytes of the shard files each rank wrote (DCP's __<rank>_<n>.distcp; the full format's one file is "
        "rank 0's); index+state: .metadata plus trainer_state.pt and megatron_3d.json (ours) or meta.pt (Lightning), "
        "written by rank 0. total: everything on disk. Ratios: row / the ModelParallelStrategy row (medians; "
        "MiB/rank: the largest rank).",
        f"MiB of tensors, by top-level key: {held}.",
    ]
    if "megatron_full" in args.variants:
        notes.append("Megatron full under ZeRO-1: rank 0 gathers the weights and writes one file; the optimizer state "
                     "in it is rank 0's ZeRO shard only, and loading it restores the weights and warns that the "
                     "optimizer starts fresh, so its load is not a full restore.")
    notes.append("CPU noise: one thread per rank (ranks beyond the cores share them); the DCP saves fsync their files "
                 "(FileSystemWriter's default), torch.save of the full file does not; loads read from the page cache. "
                 "A wide [min-max] means the machine was busy: rerun before trusting a ratio.")
    return "\n".join(f"* {note}" for note in notes)


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return
    variants = [v for v in VARIANTS if v.key in args.variants]
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        results = run_all(args, argv, variants, args.out_dir.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="checkpoint-bench-") as tmp:
            results = run_all(args, argv, variants, Path(tmp))
    print(describe(args, results))
    print(format_table(args, variants, results))
    print(footer(args, variants, results))


if __name__ == "__main__":
    main()
