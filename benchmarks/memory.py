"""Per-rank model-state bytes, peak memory and tokens/s of ZeRO stages 0-2 against Lightning's DDP and FSDP, in one table.

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
``throughput.py``'s, so both benchmarks measure alike. See ``benchmarks/README.md``.

``--activations`` measures the other half of a rank's memory instead: the bytes autograd saves
for backward (activations) per rank, at context parallelism 1/2/4 (ring and all-gather attention)
on one long sequence next to tensor + sequence parallelism, all layouts in one ``torchrun`` launch
of four processes, each against its expected share of the whole-sequence baseline.

Example::

    python benchmarks/memory.py                          # small CPU default, about 2 minutes on 2 idle cores
    python benchmarks/memory.py --activations            # activation bytes per rank, Llama-shaped, 8192 tokens
    python benchmarks/memory.py --only megatron_z2 fsdp --hidden 512
    python benchmarks/memory.py --device cuda --hidden 2048 --layers 24 --heads 16 --seq 2048 --vocab 51200
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
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
from torch.utils.data import DataLoader, DistributedSampler

from lightning_megatron import Megatron3DStrategy
from lightning_megatron.models.gpt import GPT
from lightning_megatron.models.transformer import TransformerLayer
from throughput import MIB, REPO_ROOT, PeakMemory, Run, Stopwatch, StopwatchCallback, SyntheticTokens, make_module, total_steps

DATA_PARALLEL_SIZE = 2
ACTIVATION_RANKS = 4  # every activation layout runs over the same four processes, dp filling what it leaves
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
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--activations", action="store_true",
                        help="measure the activation bytes per rank of context and sequence parallelism instead "
                             "(defaults then: --hidden 64 --layers 2 --heads 4 --seq 8192 --pad-vocab 1; fp32 on the "
                             "CPU, one sample per rank: --batch, --steps, --warmup, --precision, --only do not apply)")
    parser.add_argument("--hidden", type=int, help="default 256 (--activations: 64)")
    parser.add_argument("--layers", type=int, help="default 4 (--activations: 2)")
    parser.add_argument("--heads", type=int, help="default 4 (--activations: 4)")
    parser.add_argument("--seq", type=int, help="default 128 (--activations: 8192)")
    parser.add_argument("--batch", type=int, default=4, help="samples per step on each rank (the global batch is N times this)")
    parser.add_argument("--vocab", type=int, default=256,
                        help="vocabulary size (256: a multiple of --pad-vocab, so every configuration has the same Ψ)")
    parser.add_argument("--pad-vocab", type=int,
                        help="Megatron3DStrategy's pad_vocab_to_multiple_of (1 = no padding); default 128 "
                             "(--activations: 1, so that tp=4 holds exactly a quarter of the logits)")
    parser.add_argument("--steps", type=int, default=15, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="optimizer steps run before the clock starts")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="CPU only: time steps by process CPU time, as throughput.py's Stopwatch explains")
    parser.add_argument("--precision", choices=("bf16-true", "32-true"), default="bf16-true")
    parser.add_argument("--glibc-default-malloc", action="store_true",
                        help="keep glibc's dynamic mmap threshold (CPU): peaks then include freed memory glibc retains")
    parser.add_argument("--only", nargs="+", choices=[c.key for c in CONFIGURATIONS], help="run only these configurations")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--worker", choices=[c.key for c in CONFIGURATIONS] + ["activations"], help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = ACTIVATION_DEFAULTS if args.activations or args.worker == "activations" else MODEL_STATE_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


MODEL_STATE_DEFAULTS = {"hidden": 256, "layers": 4, "heads": 4, "seq": 128, "pad_vocab": 128}
ACTIVATION_DEFAULTS = {"hidden": 64, "layers": 2, "heads": 4, "seq": 8192, "pad_vocab": 1}


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
def make_loader(args: argparse.Namespace, rank: int) -> DataLoader:
    """``warmup + steps`` batches of this rank's share; the explicit sampler gives every configuration the
    same per-rank batches (Lightning leaves a ``DistributedSampler`` alone)."""
    dataset = SyntheticTokens(total_steps(args) * args.batch * DATA_PARALLEL_SIZE, args.seq, args.vocab, args.seed)
    sampler = DistributedSampler(dataset, num_replicas=DATA_PARALLEL_SIZE, rank=rank, shuffle=False)
    return DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True)


def worker_main(args: argparse.Namespace) -> None:
    """Train one configuration on this rank and write ``rank{r}.json`` into the result directory."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device(args.device, local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    L.seed_everything(args.seed, verbose=False)
    loader = make_loader(args, rank)
    memory = PeakMemory(device)
    module, strategy = build(args.worker, args)
    stopwatch, probe = StopwatchCallback(Stopwatch(args.warmup, args.steps, device, args.clock)), ModelStateProbe()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=device.type,
        devices=DATA_PARALLEL_SIZE,
        precision=args.precision,
        max_steps=total_steps(args),
        callbacks=[stopwatch, probe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
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
def worker_env(args: argparse.Namespace) -> dict[str, str]:
    """One intra-op thread per rank (what torchrun defaults to): two ranks then fill two cores, and a
    multi-threaded matmul on a shared CPU waits for its slowest thread.

    A fixed glibc mmap threshold makes the peak RSS follow live tensors. By default glibc raises
    the threshold whenever a large block is freed, so later blocks of that size come from the
    heap, which it keeps after they are freed; at h=512 this put ZeRO-2's peak above ZeRO-0's
    (350 vs 318 MiB) although ZeRO-2 holds 85 MiB less model state. With the threshold fixed at
    64 KiB every tensor of more than 64 KiB is returned to the system when freed (204 vs 290 MiB).
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    if not args.glibc_default_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    return env


def launch(configuration: Configuration, args: argparse.Namespace, argv: list[str], result_dir: Path) -> list[dict]:
    """One run of ``configuration`` on two fresh ranks; the per-rank results."""
    script = [str(Path(__file__).resolve()), *argv, "--worker", configuration.key, "--result-dir", str(result_dir)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={DATA_PARALLEL_SIZE}", *script]
    env = worker_env(args)
    proc = subprocess.run(cmd, env=env, cwd=result_dir, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{configuration.label} failed (exit code {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(DATA_PARALLEL_SIZE)]


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
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


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


# ---------------------------------------------------------------------------- --activations: the layouts
@dataclass(frozen=True)
class ActivationLayout:
    key: str
    context_parallel: int
    tensor_parallel: int = 1  # with sequence parallelism whenever > 1
    attention: str = "ring"  # the context-parallel attention: "ring" or "all_gather"

    @property
    def data_parallel(self) -> int:
        return ACTIVATION_RANKS // (self.context_parallel * self.tensor_parallel)

    @property
    def label(self) -> str:
        parts = []
        if self.context_parallel > 1 or self.tensor_parallel == 1:
            parts.append(f"cp{self.context_parallel}" + {"ring": " ring", "all_gather": " all-gather"}[self.attention]
                         * (self.context_parallel > 1))
        if self.tensor_parallel > 1:
            parts.append(f"tp{self.tensor_parallel}+SP")
        if self.data_parallel > 1:
            parts.append(f"dp{self.data_parallel}")
        return " x ".join(parts)

    @property
    def expected(self) -> float:
        """The share of the whole-sequence rank's activations this layout should hold: each rank holds 1/cp of
        the tokens, and tp+SP divides both the sequence-parallel activations (norms, residuals, dropout) by
        splitting the sequence and the tensor-parallel ones (attention, MLP, logits) by splitting the heads, the
        MLP width and the vocabulary, so 1/tp in all (Korthikanti et al. 2022, what is not divided aside)."""
        return 1.0 / (self.context_parallel * self.tensor_parallel)

    @property
    def expected_text(self) -> str:
        return "1" if self.expected == 1 else f"1/{self.context_parallel * self.tensor_parallel}"


ACTIVATION_LAYOUTS = (
    ActivationLayout("cp1", 1),
    ActivationLayout("cp2", 2),
    ActivationLayout("cp4", 4),
    ActivationLayout("cp2-ag", 2, attention="all_gather"),
    ActivationLayout("cp4-ag", 4, attention="all_gather"),
    ActivationLayout("tp2-sp", 1, 2),
    ActivationLayout("tp4-sp", 1, 4),
    ActivationLayout("cp2-tp2-sp", 2, 2),
)


def activation_gpt_config(args: argparse.Namespace):
    """``llama-tiny`` resized by the flags: RMSNorm, rotary, SwiGLU of width 2h, heads/2 key/value groups, untied
    output layer, no dropout."""
    from lightning_megatron.models.gpt import GPTConfig

    return GPTConfig.from_name("llama-tiny", vocab_size=args.vocab, max_seq_length=args.seq, hidden_size=args.hidden,
                               num_layers=args.layers, num_heads=args.heads,
                               num_query_groups=max(1, args.heads // 2), ffn_hidden_size=2 * args.hidden,
                               dropout=0.0, attention_dropout=0.0)


# ---------------------------------------------------------------------------- --activations: counting
class SavedActivations:
    """The storages autograd saves for backward while active (``saved_tensors_hooks``), each counted once by its
    ``data_ptr`` with its whole ``nbytes`` (a saved view keeps its whole storage alive; ``q``, ``k`` and ``v`` are
    views of one ``qkv`` output), parameters' storages left out (model state, not activations). A storage is
    attributed to ``attention core`` when it is first saved inside a ``CoreAttention`` forward (SDPA, the ring,
    the all-gather of K/V), to ``rest`` otherwise."""

    def __init__(self, module: torch.nn.Module) -> None:
        from lightning_megatron.models.attention import CoreAttention

        self.parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.storages: dict[int, tuple[int, str]] = {}
        self.region = "rest"
        self.cores = [m for m in module.modules() if isinstance(m, CoreAttention)]
        self.handles: list = []
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda saved: saved)

    def pack(self, tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.parameters and pointer not in self.storages:
            self.storages[pointer] = (storage.nbytes(), self.region)
        return tensor

    def _enter(self, *_) -> None:
        self.region = "attention core"

    def _leave(self, *_) -> None:
        self.region = "rest"

    def __enter__(self) -> "SavedActivations":
        for core in self.cores:
            self.handles += [core.register_forward_pre_hook(self._enter), core.register_forward_hook(self._leave)]
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)
        for handle in self.handles:
            handle.remove()

    def bytes(self, region: Optional[str] = None) -> int:
        return sum(n for n, where in self.storages.values() if region is None or where == region)


def activation_batch(args: argparse.Namespace) -> dict[str, Tensor]:
    """One sample of ``--seq`` tokens, the same on every rank (so every layout computes the same loss)."""
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab, (1, args.seq + 1), generator=generator)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def measure_activations(layout: ActivationLayout, args: argparse.Namespace) -> dict:
    """Build the model for ``layout`` by the strategy's own steps, cut this rank's part of the batch with the
    splitter the strategy applies, and count what one forward + loss saves for backward."""
    import torch.distributed as dist

    from lightning_megatron.parallel import ParallelConfig, ParallelState, TensorParallelRNG
    from lightning_megatron.parallel.initialize import initialize_parameters
    from lightning_megatron.preparation import apply_recompute, prepare_context_parallel, split_pipeline
    from lightning_megatron.tensor_parallel import parallelize

    config = ParallelConfig(tensor_parallel_size=layout.tensor_parallel, data_parallel_size=layout.data_parallel,
                            context_parallel_size=layout.context_parallel,
                            sequence_parallel=layout.tensor_parallel > 1)
    state = ParallelState.create(config, "cpu")
    module = GPT(activation_gpt_config(args))
    with torch.device("meta"):
        module.configure_model()
    rng = TensorParallelRNG(args.seed, state.tensor_parallel_rank, "cpu")
    parallelize(module, module.tensor_parallel_plan(), state, rng=rng, pad_vocab_to_multiple_of=args.pad_vocab)
    apply_recompute(module, "none", rng)
    splitter = prepare_context_parallel(module, state, layout.attention)
    split_pipeline(module, state)  # pp = 1: nothing to split
    initialize_parameters(module, args.seed, device="cpu", only_meta=True)
    module.train()
    batch = activation_batch(args)  # every dp rank's own one-sample batch (the same sample)
    batch = batch if splitter is None else splitter(batch)
    side = {key: value for key, value in batch.items() if key not in ("input_ids", "labels")}
    with SavedActivations(module) as saved:
        loss_sum, tokens = module.model.loss(batch["input_ids"], batch["labels"], **side)
    totals = torch.stack([loss_sum.detach().float(), tokens.float()])
    if state.replica_group is not None:  # the dp x cp ranks hold the other tokens (and copies of the sample)
        dist.all_reduce(totals, group=state.replica_group)
    del loss_sum  # drops the graph and what it saved
    return {"bytes": saved.bytes(), "attention_core": saved.bytes("attention core"), "storages": len(saved.storages),
            "tokens": int(tokens), "loss": (totals[0] / totals[1]).item()}


def activation_worker(args: argparse.Namespace) -> None:
    """Every layout, one after another over the same four processes; ``rank{r}.json`` per rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.manual_seed(args.seed)
    rank = dist.get_rank()
    results = {layout.key: measure_activations(layout, args) for layout in ACTIVATION_LAYOUTS}
    (args.result_dir / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    os._exit(0)  # skip gloo's C++ teardown: with several meshes alive it aborts at random (torch 2.13)


# ---------------------------------------------------------------------------- --activations: the parent
def check_activation_args(args: argparse.Namespace) -> None:
    if args.device != "cpu":
        sys.exit("--activations runs on the CPU (gloo; the counting does not depend on the device, but which SDPA "
                 "kernel runs, and so what it saves, does)")
    if args.seq % 8:  # cp4: 2 * 4 load-balanced chunks; cp2 x tp2+SP: 2 * 2 chunks, each rank's share over tp2
        sys.exit(f"--seq must be a multiple of 8 (cp4 cuts it into 8 chunks); got {args.seq}")
    if args.heads % 4 or args.vocab % 4:
        sys.exit("--heads and --vocab must divide by tp=4")


def launch_activations(args: argparse.Namespace, result_dir: Path) -> list[dict]:
    script = [str(Path(__file__).resolve()), "--worker", "activations", "--result-dir", str(result_dir),
              *(f"--{name.replace('_', '-')}={getattr(args, name)}"
                for name in ("hidden", "layers", "heads", "seq", "vocab", "pad_vocab", "seed"))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ACTIVATION_RANKS}",
           *script]
    proc = subprocess.run(cmd, env=worker_env(args), cwd=result_dir, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"--activations failed (exit code {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-6000:]}")
    return [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(ACTIVATION_RANKS)]


def format_activation_table(ranks: list[dict]) -> str:
    header = ["layout", "tokens/rank", "activations MiB/rank", "attention core MiB", "rest MiB", "vs cp1", "expected",
              "deviation", "max/min over ranks", "loss"]
    baseline = max(r["cp1"]["bytes"] for r in ranks)
    rows = [header]
    for layout in ACTIVATION_LAYOUTS:
        mine = [r[layout.key] for r in ranks]
        worst = max(mine, key=lambda m: m["bytes"])
        ratio = worst["bytes"] / baseline
        rows.append([
            layout.label,
            f"{worst['tokens']:,}",
            f"{worst['bytes'] / MIB:.2f}",
            f"{worst['attention_core'] / MIB:.2f}",
            f"{(worst['bytes'] - worst['attention_core']) / MIB:.2f}",
            f"{ratio:.3f}",
            f"{layout.expected_text} = {layout.expected:.3f}",
            f"{100 * (ratio / layout.expected - 1):+.1f}%",
            f"{worst['bytes'] / min(m['bytes'] for m in mine):.3f}",
            f"{worst['loss']:.4f}",
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def describe_activations(args: argparse.Namespace) -> str:
    config = activation_gpt_config(args)
    return (f"Llama-shaped GPT h={config.hidden_size} layers={config.num_layers} heads={config.num_heads} "
            f"kv-groups={config.query_groups} ffn={config.ffn_hidden_size} vocab={config.vocab_size} "
            f"(pad_vocab_to_multiple_of={args.pad_vocab}), one sample of {args.seq} tokens per dp rank, fp32, "
            f"dropout 0, cpu; {ACTIVATION_RANKS} processes, every layout in one torchrun launch; "
            f"torch {torch.__version__}")


def activation_footer() -> str:
    notes = [
        "activations MiB/rank: the bytes of the storages autograd saves for backward during one training forward + "
        "loss of the micro-batch (saved_tensors_hooks; each storage once, by data_ptr, with its nbytes; parameters' "
        "storages left out), on the rank with the most; attention core: the storages first saved inside "
        "CoreAttention (SDPA / ring / all-gather attention), rest: everything else (norms, qkv, rotary, MLP, "
        "residuals, logits, cross-entropy). tokens/rank: the sequence positions a rank's loss covers (tp+SP ranks "
        "hold 1/tp of them between the layers).",
        "vs cp1: over the whole-sequence rank's (cp1 x dp4). expected: 1/cp for context parallelism (each rank "
        "holds 1/cp of the tokens; the ring saves q, k, v, out, lse of its own tokens only); 1/tp for tp+SP "
        "(Korthikanti et al. 2022: SP divides the norm/residual activations by tp along the sequence, and the "
        "tensor-parallel attention, MLP and vocabulary splits divide the rest by tp). deviation: measured over "
        "expected, minus 1.",
        "Not divided, so above the expected share: all-gather attention saves the gathered keys and values of the "
        "whole sequence (linear in S, 2 G d values per token); tp+SP "
        "saves the all-gathered full-sequence inputs of the column-parallel layers (qkv, MLP fc, lm_head; "
        "Megatron-Core saves the local chunk and gathers again in backward), the rotary cos/sin, the whole embedding "
        "output (at one sample the sequence scatter's chunk is a view of it, which the first norm saves) and, where "
        "tp exceeds the key/value groups, the replicated K/V heads.",
        "max/min over ranks: the largest rank's bytes over the smallest's (every context-parallel rank holds the "
        "same number of tokens; the load-balanced chunks even out the attention work, which saved bytes do not "
        "depend on). loss: the layout's loss over every token (the same sample everywhere, so every row must agree).",
    ]
    return "\n".join(f"* {note}" for note in notes)


def activations_main(args: argparse.Namespace) -> None:
    check_activation_args(args)
    with tempfile.TemporaryDirectory(prefix="memory-activations-") as tmp:
        print(f"  {len(ACTIVATION_LAYOUTS)} layouts on {ACTIVATION_RANKS} ranks ...", file=sys.stderr, flush=True)
        ranks = launch_activations(args, Path(tmp))
    print(describe_activations(args))
    print(format_activation_table(ranks))
    print(activation_footer())


def runnable_configurations(args: argparse.Namespace) -> list[Configuration]:
    """Every configuration needs N processes; on CUDA, one GPU each."""
    if args.device == "cuda" and torch.cuda.device_count() < DATA_PARALLEL_SIZE:
        sys.exit(f"needs {DATA_PARALLEL_SIZE} GPUs, found {torch.cuda.device_count()}")
    return [c for c in CONFIGURATIONS if not args.only or c.key in args.only]


def main() -> None:
    args = parse_args()
    if args.worker == "activations":
        activation_worker(args)
        return
    if args.worker:
        worker_main(args)
        return
    if args.activations:
        activations_main(args)
        return
    configurations = runnable_configurations(args)
    results = run_all(args, sys.argv[1:], configurations)
    print(describe(args))
    print(format_table(args, configurations, results))
    print(footer(args))


if __name__ == "__main__":
    main()
