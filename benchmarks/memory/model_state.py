"""``python -m benchmarks.memory model-state``: per-rank model-state bytes, peak memory and tokens/s of ZeRO stages 0-2
against Lightning's DDP and FSDP, in one table.

One GPT, config, per-rank batches, AdamW and learning-rate schedule, at data-parallel
size N=2 (two processes), under five configurations: ``Megatron3DStrategy(zero_stage=0|1|2)``,
Lightning's ``DDPStrategy`` and Lightning's FSDP. Each configuration's model-state bytes
(parameters, gradients, fp32 main parameters, optimizer state) are set beside the ZeRO
paper's prediction for it (Rajbhandari et al. 2020), so a stage that does not shard what
it claims shows up as a ratio far from 1.

Every configuration runs in fresh processes under ``torchrun``: a peak RSS is a
high-water mark that never goes down, so only a fresh process attributes it to one run.
Each rank writes its measurements as JSON for the parent, which prints the table. The
measuring tools (peak memory, step clock, synthetic tokens, the GPT recipe) are
``benchmarks.harness``'s, so this and ``benchmarks.throughput`` measure alike. See ``benchmarks/README.md``.

Example::

    python -m benchmarks.memory model-state                    # small CPU default, about 2 minutes on 2 idle cores
    python -m benchmarks.memory model-state --only megatron_z2 fsdp --hidden 512
    python -m benchmarks.memory model-state --device cuda --hidden 2048 --layers 24 --heads 16 --seq 2048 --vocab 51200
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, Strategy
from torch import Tensor
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from lightning_megatron import Megatron3DStrategy
from lightning_megatron.models.gpt import GPT
from lightning_megatron.models.transformer import TransformerLayer
from benchmarks.memory import ENTRY
from benchmarks.harness.launch import add_worker_flags, read_ranks, run_checked, torchrun, worker_env, worker_rank_and_device
from benchmarks.harness.rounds import Run
from benchmarks.harness.tables import MIB, format_rows
from benchmarks.harness.timing import PeakMemory, Stopwatch, StopwatchCallback
from benchmarks.harness.training import make_loader, make_module, quiet_trainer, total_steps

DATA_PARALLEL_SIZE = 2
CATEGORIES = ("parameters", "gradients", "main_parameters", "optimizer_state")


# ---------------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class Configuration:
    key: str
    label: str
    zero_stage: int  # the ZeRO stage whose formula this configuration's model state is held against


CONFIGURATIONS = (
    Configuration("megatron_z0", "Megatron3DStrategy zero_stage=0", 0),
    Configuration("megatron_z1", "Megatron3DStrategy zero_stage=1", 1),
    Configuration("megatron_z2", "Megatron3DStrategy zero_stage=2", 2),
    Configuration("ddp", "Lightning DDPStrategy", 0),
    Configuration("fsdp", "Lightning FSDP", 3),
)


# ---------------------------------------------------------------------------- arguments
def parse_args(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="samples per step on each rank (the global batch is N times this)")
    parser.add_argument("--vocab", type=int, default=256,
                        help="vocabulary size (256: a multiple of --pad-vocab, so every configuration has the same Ψ)")
    parser.add_argument("--pad-vocab", type=int, default=128,
                        help="Megatron3DStrategy's pad_vocab_to_multiple_of (1 = no padding)")
    parser.add_argument("--steps", type=int, default=15, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="optimizer steps run before the clock starts")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="CPU only: time steps by process CPU time, as harness/timing.py's Stopwatch explains")
    parser.add_argument("--precision", choices=("bf16-true", "32-true"), default="bf16-true")
    parser.add_argument("--glibc-default-malloc", action="store_true",
                        help="keep glibc's dynamic mmap threshold (CPU): peaks then include freed memory glibc retains")
    parser.add_argument("--only", nargs="+", choices=[c.key for c in CONFIGURATIONS], help="run only these configurations")
    parser.add_argument("--seed", type=int, default=1234)
    add_worker_flags(parser, [c.key for c in CONFIGURATIONS])
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------- the ZeRO formulas
def bytes_per_parameter(precision: str) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes per parameter for Adam, as in the ZeRO paper.

    Mixed precision (``bf16-true`` here): 2-byte parameters and gradients, K = 12 bytes of fp32
    master copy, momentum and variance. Pure fp32: 4 + 4, and K = 8 (the moments; the
    parameters are the master copy).
    """
    return (2, 2, 12) if precision == "bf16-true" else (4, 4, 8)


def zero_formula(stage: int, precision: str) -> tuple[int, int]:
    """``(a, b)`` with per-rank model state ``aΨ + bΨ/N``: stage 1 shards the optimizer state, 2 also
    the gradients, 3 also the parameters."""
    param, grad, optim = bytes_per_parameter(precision)
    replicated = (param + grad + optim, param + grad, param, 0)[stage]
    return replicated, param + grad + optim - replicated


def formula_text(a: int, b: int) -> str:
    return " + ".join(term for term, coefficient in ((f"{a}Ψ", a), (f"{b}Ψ/N", b)) if coefficient)


# ---------------------------------------------------------------------------- the Lightning baselines' modules
class ReplicaGPT(GPT):
    """``GPT`` that counts its parameters when it builds them, before DDP or FSDP wrap or shard them.

    After sharding a rank holds only pieces (FSDP1's flat views are 1-D and partial), so Ψ, the
    parameters of one model replica, is counted here.
    """

    replica_numel = 0

    def configure_model(self) -> None:
        if self.model is None:
            super().configure_model()
            self.replica_numel = sum(p.numel() for p in self.model.parameters())


class FullyShardedGPT(ReplicaGPT):
    """FSDP2 on the CPU: ``FSDPStrategy`` refuses ``accelerator="cpu"``, ``ModelParallelStrategy`` takes
    whatever ``configure_model`` applies over its data-parallel mesh.

    Each transformer layer is a unit of its own (gathered for its forward and backward, then
    freed), and the root holds the embedding (tied to the head) and the final norm: the usual
    FSDP wrapping of a transformer.
    """

    def configure_model(self) -> None:
        if self.model is not None:
            return
        super().configure_model()
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks.values():
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def build(key: str, args: argparse.Namespace) -> tuple[GPT, Strategy]:
    """The module and strategy of one configuration."""
    if key.startswith("megatron_z"):
        strategy = Megatron3DStrategy(zero_stage=int(key[-1]), pad_vocab_to_multiple_of=args.pad_vocab)
        return make_module(args), strategy
    if key == "ddp":
        return make_module(args, ReplicaGPT), DDPStrategy()
    if args.device == "cuda":
        return make_module(args, ReplicaGPT), FSDPStrategy(auto_wrap_policy={TransformerLayer})
    return make_module(args, FullyShardedGPT), ModelParallelStrategy(data_parallel_size=DATA_PARALLEL_SIZE, tensor_parallel_size=1)


# ---------------------------------------------------------------------------- counting model state
def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes this rank stores for ``tensors``: a DTensor (FSDP2) counts its local shard."""
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
    return sum(t.numel() * t.element_size() for t in local)


def ddp_bucket_bytes(model: torch.nn.Module) -> int:
    """DDP's all-reduce buckets: with ``gradient_as_bucket_view=False`` (its default) gradients are
    copied into these persistent flat buffers for the all-reduce and back into ``.grad``, so a
    rank holds gradients twice. With views there is one copy, already counted by ``.grad``."""
    if not isinstance(model, DistributedDataParallel) or model.gradient_as_bucket_view:
        return 0
    sizes = model._get_ddp_logging_data()["bucket_sizes"]  # bytes per bucket, comma-separated
    return sum(int(size) for size in sizes.split(","))


def counted_model_state_bytes(trainer: L.Trainer) -> dict[str, int]:
    """The categories of ``Megatron3DStrategy.model_state_bytes``, counted for Lightning's strategies.

    Parameters: the module's unique parameters; gradients: their ``.grad`` plus DDP's buckets;
    optimizer state: the optimizer's non-scalar state tensors (Adam's two moments, not its step
    counters), all local shards. Lightning's precision plugins keep no fp32 main parameters.
    """
    params = list(trainer.lightning_module.parameters())
    state = [v for s in trainer.optimizers[0].state.values() for v in s.values() if isinstance(v, Tensor) and v.dim() > 0]
    return {
        "parameters": tensor_bytes(params),
        "gradients": tensor_bytes(p.grad for p in params if p.grad is not None) + ddp_bucket_bytes(trainer.model),
        "main_parameters": 0,
        "optimizer_state": tensor_bytes(state),
    }


class ModelStateProbe(L.Callback):
    """Reads the model state after the first optimizer step, when the optimizer state exists and
    the gradients are still held (Lightning zeroes them inside the next step)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.psi = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if batch_idx != 0:
            return
        if isinstance(trainer.strategy, Megatron3DStrategy):
            # Whole parameters at tp=1, vocabulary padding included; ZeRO 1-2 never shard them.
            self.bytes, self.psi = trainer.strategy.model_state_bytes, sum(p.numel() for p in pl_module.parameters())
        else:
            self.bytes, self.psi = counted_model_state_bytes(trainer), pl_module.replica_numel


# ---------------------------------------------------------------------------- worker
def worker_main(args: argparse.Namespace) -> None:
    """Train one configuration on this rank and write ``rank{r}.json`` into the result directory."""
    rank, device = worker_rank_and_device(args.device)
    L.seed_everything(args.seed, verbose=False)
    loader = make_loader(args, DATA_PARALLEL_SIZE, rank)
    memory = PeakMemory(device)
    module, strategy = build(args.worker, args)
    stopwatch, probe = StopwatchCallback(Stopwatch(args.warmup, args.steps, device, args.clock)), ModelStateProbe()
    trainer = quiet_trainer(strategy=strategy, accelerator=device.type, devices=DATA_PARALLEL_SIZE,
                            precision=args.precision, max_steps=total_steps(args), callbacks=[stopwatch, probe])
    trainer.fit(module, loader)
    result = {
        "step_seconds": stopwatch.stopwatch.step_seconds(),
        "peak_bytes": memory.peak_bytes(),
        "loss": stopwatch.last_loss.item(),
        "model_state": probe.bytes,
        "psi": probe.psi,
    }
    (args.result_dir / f"rank{rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------- parent
def memory_env(args: argparse.Namespace) -> dict[str, str]:
    """``worker_env`` (one intra-op thread per rank: two ranks fill two cores) with, unless
    ``--glibc-default-malloc``, a fixed glibc mmap threshold.

    A fixed glibc mmap threshold makes the peak RSS follow live tensors. By default glibc raises
    the threshold whenever a large block is freed, so later blocks of that size come from the
    heap, which it keeps after they are freed; at h=512 this put ZeRO-2's peak above ZeRO-0's
    (350 vs 318 MiB) although ZeRO-2 holds 85 MiB less model state. With the threshold fixed at
    64 KiB every tensor of more than 64 KiB is returned to the system when freed (204 vs 290 MiB).
    """
    return worker_env(**({} if args.glibc_default_malloc else {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}))


def launch(configuration: Configuration, args: argparse.Namespace, argv: list[str], result_dir: Path) -> list[dict]:
    """One run of ``configuration`` on two fresh ranks; the per-rank results."""
    cmd = torchrun(DATA_PARALLEL_SIZE, ENTRY, "model-state", *argv, "--worker", configuration.key,
                   "--result-dir", str(result_dir))
    run_checked(cmd, configuration.label, result_dir, memory_env(args))
    return read_ranks(result_dir, DATA_PARALLEL_SIZE)


def run_all(args: argparse.Namespace, argv: list[str], configurations: list[Configuration]) -> dict[str, list[dict]]:
    results = {}
    with tempfile.TemporaryDirectory(prefix="memory-") as tmp:
        for configuration in configurations:
            result_dir = Path(tmp, configuration.key)
            result_dir.mkdir()
            print(f"  {configuration.label} ...", file=sys.stderr, flush=True)
            results[configuration.key] = launch(configuration, args, argv, result_dir)
    return results


def table_row(args: argparse.Namespace, configuration: Configuration, ranks: list[dict]) -> list[str]:
    """The rank with the most model state (ZeRO's padding makes ranks differ by a few bytes); speed
    from the slowest rank per step, peak memory from the largest rank, as in ``throughput.py``."""
    worst = max(ranks, key=lambda r: sum(r["model_state"].values()))
    sizes, psi = worst["model_state"], worst["psi"]
    total = sum(sizes.values())
    a, b = zero_formula(configuration.zero_stage, args.precision)
    predicted = a * psi + b * psi / DATA_PARALLEL_SIZE
    run = Run.from_ranks(ranks, args.batch * args.seq * DATA_PARALLEL_SIZE)
    return [
        configuration.label,
        f"{psi / 1e6:.3f}M",
        *(f"{sizes[name] / MIB:.2f}" for name in CATEGORIES),
        f"{total / MIB:.2f}",
        formula_text(a, b),
        f"{predicted / MIB:.2f}",
        f"{total / predicted:.3f}",
        f"{run.peak_bytes / MIB:.1f}",
        f"{run.tokens_per_s:,.0f}",
        f"{run.loss:.4f}",
    ]


def format_table(args: argparse.Namespace, configurations: list[Configuration], results: dict[str, list[dict]]) -> str:
    header = ["configuration", "Ψ/rank", "params MiB", "grads MiB", "main params MiB", "optim MiB", "total MiB",
              "ZeRO formula", "formula MiB", "total/formula", "peak MiB/rank", "tokens/s", "last loss"]
    rows = [header] + [table_row(args, c, results[c.key]) for c in configurations]
    return format_rows(rows)


def describe(args: argparse.Namespace) -> str:
    return (f"GPT h={args.hidden} layers={args.layers} heads={args.heads} seq={args.seq} vocab={args.vocab}, "
            f"batch {args.batch}/rank, N={DATA_PARALLEL_SIZE} data-parallel ranks, {args.device} {args.precision}, AdamW; "
            f"Megatron pad_vocab_to_multiple_of={args.pad_vocab}; torch {torch.__version__}, lightning {L.__version__}")


def footer(args: argparse.Namespace) -> str:
    fsdp = ("FSDPStrategy(auto_wrap_policy={TransformerLayer})" if args.device == "cuda" else
            "ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) with FSDP2 fully_shard on each "
            "transformer layer and the root in configure_model (FSDPStrategy refuses accelerator='cpu')")
    peak = ("torch.cuda.max_memory_allocated" if args.device == "cuda" else
            "growth of ru_maxrss (peak RSS) over the process's RSS after imports, in a fresh process per configuration"
            + ("" if args.glibc_default_malloc else ", glibc mmap threshold fixed at 64 KiB"))
    notes = [
        f"Lightning FSDP = {fsdp}.",
        "Model state after the first optimizer step, per rank (the rank with the most): Megatron rows from "
        "trainer.strategy.model_state_bytes; Lightning rows counted from the module's parameters, their .grad and "
        "the optimizer's state tensors (local shards), plus DDP's all-reduce buckets in grads "
        "(gradient_as_bucket_view=False, DDP's default, keeps a second copy of the gradients).",
        "ZeRO formula: Adam at the ZeRO stage each row corresponds to (DDP: 0, FSDP: 3), Ψ = parameters of one "
        "model replica, N = 2; " + ("mixed precision: 2-byte params and grads, 12 bytes of fp32 master copy and "
                                    "moments." if args.precision == "bf16-true" else
                                    "fp32: 4-byte params and grads, 8 bytes of moments, no master copy."),
        f"peak MiB/rank: {peak}, the largest rank. tokens/s: global tokens over the median step time "
        f"({args.clock} clock, slowest rank) of {args.steps} steps after {args.warmup} warmup; one run, so noisy on a "
        "shared machine.",
        "last loss: rank 0's training loss at the last step. The Megatron rows must agree (ZeRO does not change the "
        "math); its vocab-parallel cross-entropy runs in fp32, whereas GPT's nn.CrossEntropyLoss under Lightning's "
        "precision runs in the parameters' dtype.",
    ]
    if args.precision == "bf16-true":
        notes.append("Lightning's DDP and FSDP under bf16-true keep no fp32 master weights and hold Adam's moments in "
                     "bf16 (8 bytes/param, not 16): that is why their bytes are lower, and why their numerics and "
                     "losses differ (updates are rounded to bf16).")
    return "\n".join(f"* {note}" for note in notes)


def runnable_configurations(args: argparse.Namespace) -> list[Configuration]:
    """Every configuration needs N processes; on CUDA, one GPU each."""
    if args.device == "cuda" and torch.cuda.device_count() < DATA_PARALLEL_SIZE:
        sys.exit(f"needs {DATA_PARALLEL_SIZE} GPUs, found {torch.cuda.device_count()}")
    return [c for c in CONFIGURATIONS if not args.only or c.key in args.only]


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv, prog)
    if args.worker:
        worker_main(args)
        return
    configurations = runnable_configurations(args)
    results = run_all(args, argv, configurations)
    print(describe(args))
    print(format_table(args, configurations, results))
    print(footer(args))
