"""Training throughput and peak memory of ``Megatron3DStrategy`` against its baselines, in one table.

Two comparisons on the same ``GPTModel``, config, batches, AdamW and learning-rate schedule:

(a) one process: ``Megatron3DStrategy(tensor_parallel_size=1)`` against a plain PyTorch loop;
(b) two processes: ``Megatron3DStrategy(tensor_parallel_size=2)`` against Lightning's
    ``ModelParallelStrategy`` with torch's DTensor tensor-parallel plan on the same layers.

Every run is a fresh process (``torchrun`` for two ranks): a process's peak RSS is a
high-water mark that never goes down, so only a fresh process can attribute a peak to one
run, and no run inherits another's allocator caches or warmed-up kernels. Repeats are
interleaved, in reversed order every other round, so slow drift on a shared machine
falls on every variant alike. See ``benchmarks/README.md`` for how to read the table.

Example::

    python benchmarks/throughput.py                      # small CPU default, 2-3 minutes
    python benchmarks/throughput.py --device cuda --precision bf16-mixed \
        --hidden 2048 --layers 24 --heads 16 --seq 2048 --batch 8 --vocab 51200
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_megatron import Megatron3DStrategy
from lightning_megatron.models.gpt import GPT, GPTConfig, GPTModel
from lightning_megatron.models.transformer import TransformerLayer

REPO_ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


# ---------------------------------------------------------------------------- variants
@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    processes: int
    baseline: Optional[str] = None  # the key this variant's ratios are taken against


VARIANTS = (
    Variant("plain", "plain PyTorch loop", 1),
    Variant("megatron_tp1", "Megatron3DStrategy tp=1", 1, baseline="plain"),
    Variant("model_parallel_tp2", "ModelParallelStrategy tp=2 (DTensor)", 2),
    Variant("megatron_tp2", "Megatron3DStrategy tp=2", 2, baseline="model_parallel_tp2"),
)


# ---------------------------------------------------------------------------- arguments
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="samples per step (the global batch: dp=1 everywhere)")
    parser.add_argument("--vocab", type=int, default=257, help="vocabulary size (257: the project's byte tokenizer)")
    parser.add_argument("--pad-vocab", type=int, default=128,
                        help="Megatron3DStrategy's pad_vocab_to_multiple_of (1 = no padding)")
    parser.add_argument("--steps", type=int, default=30, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="optimizer steps run before the clock starts")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant, interleaved")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="CPU only: 'cpu' times steps by the CPU time the run's processes got (process_time), "
                             "which other jobs on a shared machine cannot inflate; see Stopwatch")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads per process (OMP_NUM_THREADS; 0 = torch's default); see launch()")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="peak TFLOP/s of one device for MFU (H200 dense bf16: 989)")
    parser.add_argument("--only", nargs="+", choices=[v.key for v in VARIANTS], help="run only these variants")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--worker", choices=[v.key for v in VARIANTS], help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def gpt_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, max_seq_length=args.seq, hidden_size=args.hidden,
                     num_layers=args.layers, num_heads=args.heads)


def total_steps(args: argparse.Namespace) -> int:
    return args.warmup + args.steps


def make_module(args: argparse.Namespace, cls: type[GPT] = GPT) -> GPT:
    """GPT whose learning-rate warmup spans the whole run.

    The cosine after warmup is sized by the Trainer's step count, which a loop outside the
    Trainer does not have; inside the warmup the schedule depends on the step alone, so
    every variant runs the same learning rates and should end at the same loss.
    """
    return cls(gpt_config(args), warmup_steps=total_steps(args))


# ---------------------------------------------------------------------------- data
class SyntheticTokens(Dataset):
    """Random token ids made once in memory: loading costs every variant the same (almost nothing)."""

    def __init__(self, num_samples: int, seq: int, vocab: int, seed: int) -> None:
        tokens = torch.randint(vocab, (num_samples, seq + 1), generator=torch.Generator().manual_seed(seed))
        self.input_ids, self.labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}


def make_loader(args: argparse.Namespace) -> DataLoader:
    """Exactly ``warmup + steps`` batches in a fixed order; the explicit sampler keeps Lightning from re-sampling.

    With dp=1 in every variant all ranks (and the plain loop) see the same batch at every step.
    """
    dataset = SyntheticTokens(total_steps(args) * args.batch, args.seq, args.vocab, args.seed)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False)
    return DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True)


# ---------------------------------------------------------------------------- measurement
class PeakMemory:
    """Peak memory this run added on top of what the process held before the model existed.

    CUDA: ``max_memory_allocated`` (tensors only, not the caching allocator's reserve).
    CPU: growth of ``ru_maxrss``, the kernel's high-water mark of resident memory. tracemalloc
    cannot be used: it sees only Python allocations, not torch's C++ allocator. RSS also counts
    allocator slack and thread-local arenas, which is what the machine really pays. The
    baseline is taken after imports and data, where the high-water mark equals the current
    RSS to within a MiB (imports leave no transient peak), so the growth charges each run
    exactly its model, optimizer, activations and framework machinery.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline = torch.cuda.memory_allocated(device)
        else:
            self.baseline = self._max_rss()

    @staticmethod
    def _max_rss() -> int:
        scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return self._max_rss() - self.baseline


class Stopwatch:
    """The duration of every measured step: from its start to the next step's start (the last: to its end).

    A period covers everything done between two steps (data, trainer bookkeeping, the
    optimizer), so framework overhead is charged; taking the median over steps rejects
    the spikes that other processes cause on a shared machine. On CUDA the marks are
    events on the current stream, so timing adds no host synchronisation to the loop.

    ``clock="cpu"`` (CPU runs) reads ``time.process_time`` instead: the CPU seconds this
    process got, all its threads. Jobs competing for the cores can stretch wall time many
    times over but barely move CPU time; the price is that idle waiting (a rank blocked in
    a collective on a slower peer) is not counted, so use it for single-threaded,
    CPU-bound comparisons on a busy machine, and wall time otherwise.
    """

    def __init__(self, warmup: int, steps: int, device: torch.device, clock: str = "wall") -> None:
        self.first, self.last, self.device = warmup, warmup + steps - 1, device
        self.cpu_clock = clock == "cpu" and device.type == "cpu"
        self.marks: list = []

    def _mark(self):
        if self.device.type != "cuda":
            return time.process_time() if self.cpu_clock else time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step_started(self, step: int) -> None:
        if self.first <= step <= self.last:
            self.marks.append(self._mark())

    def step_ended(self, step: int) -> None:
        if step == self.last:
            self.marks.append(self._mark())

    def step_seconds(self) -> list[float]:
        if len(self.marks) != self.last - self.first + 2:
            raise RuntimeError(f"Timed {len(self.marks) - 1} steps instead of {self.last - self.first + 1}: "
                               "is the loader long enough and --steps positive?")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [start.elapsed_time(end) / 1000 for start, end in zip(self.marks, self.marks[1:])]
        return [end - start for start, end in zip(self.marks, self.marks[1:])]


class StopwatchCallback(L.Callback):
    """Drives a ``Stopwatch`` from Lightning's batch hooks and keeps the last step's loss."""

    def __init__(self, stopwatch: Stopwatch) -> None:
        self.stopwatch = stopwatch
        self.last_loss: Optional[Tensor] = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.stopwatch.step_started(batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.stopwatch.step_ended(batch_idx)
        self.last_loss = outputs["loss"]


# ---------------------------------------------------------------------------- the DTensor baseline
class LocalWeightShape(nn.Module):
    """A DTensor-parallel linear whose ``.weight`` reads as this rank's shard.

    ``SelfAttention`` counts its local heads as ``self.qkv.weight.shape[0] // (3 * head_dim)``:
    right for Megatron's layers, which hold plain local tensors, but a DTensor's ``.shape`` is
    the global shape, while ``ColwiseParallel`` hands back the local output. Wrapping the
    linear leaves the attention code and its math untouched; each rank holds whole heads
    because qkv is laid out head by head.
    """

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear

    @property
    def weight(self) -> Tensor:
        return self.linear.weight.to_local()

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)


DTENSOR_BLOCK_PLAN = {
    "attn.qkv": ColwiseParallel(),
    "attn.proj": RowwiseParallel(),
    "mlp.fc": ColwiseParallel(),
    "mlp.proj": RowwiseParallel(),
}


class DTensorGPT(GPT):
    """``GPT`` split by torch's DTensor plan, as ``ModelParallelStrategy`` expects in ``configure_model``.

    The same four linears per block as Megatron's column/row plan; embedding, final norm
    and head stay replicated, which is what a plain DTensor plan for these layers gives.
    """

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = GPTModel(self.config)
        mesh = self.device_mesh["tensor_parallel"]
        for block in [m for m in self.model.modules() if isinstance(m, TransformerLayer)]:
            parallelize_module(block, mesh, DTENSOR_BLOCK_PLAN)
            block.attn.qkv = LocalWeightShape(block.attn.qkv)


# ---------------------------------------------------------------------------- workers
Measurement = tuple[list[float], int, float]  # (seconds of each measured step, peak bytes, last loss)


def run_plain(args: argparse.Namespace, device: torch.device) -> Measurement:
    """The loop a PyTorch user writes, with GPT's own AdamW param groups and learning-rate schedule."""
    loader = make_loader(args)
    memory = PeakMemory(device)
    module = make_module(args)
    module.configure_model()
    model = module.model.to(device)
    recipe = module.configure_optimizers()
    optimizer, scheduler = recipe["optimizer"], recipe["lr_scheduler"]["scheduler"]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed")
    stopwatch = Stopwatch(args.warmup, args.steps, device, args.clock)
    for step, batch in enumerate(loader):
        stopwatch.step_started(step)
        ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        with autocast:
            loss_sum, num_tokens = model.loss(ids, labels)
            loss = loss_sum / num_tokens
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        stopwatch.step_ended(step)
    return stopwatch.step_seconds(), memory.peak_bytes(), loss.item()


def run_lightning(args: argparse.Namespace, device: torch.device, module: L.LightningModule, strategy, devices: int) -> Measurement:
    """``Trainer.fit`` as a user runs it, timed from its own batch hooks."""
    loader = make_loader(args)
    memory = PeakMemory(device)
    stopwatch = StopwatchCallback(Stopwatch(args.warmup, args.steps, device, args.clock))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=device.type,
        devices=devices,
        precision=args.precision,
        max_steps=total_steps(args),
        callbacks=[stopwatch],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    return stopwatch.stopwatch.step_seconds(), memory.peak_bytes(), stopwatch.last_loss.item()


def run_megatron(args: argparse.Namespace, device: torch.device, tensor_parallel_size: int) -> Measurement:
    strategy = Megatron3DStrategy(tensor_parallel_size=tensor_parallel_size, pad_vocab_to_multiple_of=args.pad_vocab)
    return run_lightning(args, device, make_module(args), strategy, devices=tensor_parallel_size)


def run_model_parallel(args: argparse.Namespace, device: torch.device) -> Measurement:
    strategy = ModelParallelStrategy(tensor_parallel_size=2, data_parallel_size=1)
    return run_lightning(args, device, make_module(args, DTensorGPT), strategy, devices=2)


WORKERS: dict[str, Callable[[argparse.Namespace, torch.device], Measurement]] = {
    "plain": run_plain,
    "megatron_tp1": partial(run_megatron, tensor_parallel_size=1),
    "model_parallel_tp2": run_model_parallel,
    "megatron_tp2": partial(run_megatron, tensor_parallel_size=2),
}


def worker_main(args: argparse.Namespace) -> None:
    """Run one variant on this rank and write ``rank{r}.json`` into the result directory."""
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(args.device, local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    L.seed_everything(args.seed, verbose=False)  # identical initial weights in every variant
    step_seconds, peak, loss = WORKERS[args.worker](args, device)
    result = {"step_seconds": step_seconds, "peak_bytes": peak, "loss": loss}
    (args.result_dir / f"rank{rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------- parent
def launch(variant: Variant, args: argparse.Namespace, argv: list[str], result_dir: Path) -> list[dict]:
    """One run of ``variant`` in fresh processes; the per-rank results.

    One thread per process by default, which is also what torchrun gives each rank: on a
    shared CPU a multi-threaded matmul waits for its slowest thread, and runs here got
    10-60x slower whenever another job was busy, while single-threaded runs stayed within
    a few percent of each other.
    """
    script = [str(Path(__file__).resolve()), *argv, "--worker", variant.key, "--result-dir", str(result_dir)]
    if variant.processes == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={variant.processes}", *script]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONWARNINGS="ignore")
    if args.threads > 0:
        env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.run(cmd, env=env, cwd=result_dir, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant.label} failed (exit code {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(variant.processes)]


@dataclass
class Run:
    """One run over all its ranks: the slowest rank sets each step's time, the largest rank the memory."""

    tokens_per_s: float
    peak_bytes: int
    loss: float

    @classmethod
    def from_ranks(cls, ranks: list[dict], tokens_per_step: int) -> "Run":
        step_seconds = [max(per_rank) for per_rank in zip(*(r["step_seconds"] for r in ranks))]
        return cls(tokens_per_step / statistics.median(step_seconds), max(r["peak_bytes"] for r in ranks), ranks[0]["loss"])


def run_all(args: argparse.Namespace, argv: list[str], variants: list[Variant]) -> dict[str, list[Run]]:
    """``repeats`` rounds; every other round runs the variants in reverse order (ABBA) to cancel drift."""
    tokens_per_step = args.batch * args.seq
    runs: dict[str, list[Run]] = {v.key: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="throughput-") as tmp:
        for repeat in range(args.repeats):
            for variant in variants if repeat % 2 == 0 else variants[::-1]:
                result_dir = Path(tmp, f"{variant.key}-{repeat}")
                result_dir.mkdir()
                print(f"  round {repeat + 1}/{args.repeats}: {variant.label} ...", file=sys.stderr, flush=True)
                runs[variant.key].append(Run.from_ranks(launch(variant, args, argv, result_dir), tokens_per_step))
    return runs


def flops_per_step(args: argparse.Namespace) -> float:
    """Model FLOPs of one training step (forward + backward, no recomputation), as in DESIGN.md."""
    b, s, layers, h, v = args.batch, args.seq, args.layers, args.hidden, args.vocab
    return 72 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (12 * layers * h))


@dataclass(frozen=True)
class Summary:
    """A variant over its runs. Speed: the best run, because noise on a shared machine only ever
    slows a run down (timeit's rule); the slowest run is shown to make the noise visible.
    Memory: the median run (noise does not move it much either way)."""

    best_tokens_per_s: float
    worst_tokens_per_s: float
    peak_bytes: float
    loss: float

    @classmethod
    def of(cls, runs: list[Run]) -> "Summary":
        speeds = [r.tokens_per_s for r in runs]
        return cls(max(speeds), min(speeds), statistics.median(r.peak_bytes for r in runs), runs[-1].loss)


def table_row(args: argparse.Namespace, variant: Variant, summary: Summary, baseline: Optional[Summary]) -> list[str]:
    row = [
        variant.label,
        str(variant.processes),
        f"{summary.best_tokens_per_s:,.0f}",
        f"{summary.worst_tokens_per_s:,.0f}",
        f"{summary.peak_bytes / MIB:,.1f}",
        f"{summary.best_tokens_per_s / baseline.best_tokens_per_s:.3f}" if baseline else "-",
        f"{summary.peak_bytes / baseline.peak_bytes:.3f}" if baseline and baseline.peak_bytes > 0 else "-",
        f"{summary.loss:.4f}",
    ]
    if args.device == "cuda":
        steps_per_s = summary.best_tokens_per_s / (args.batch * args.seq)
        tflops = flops_per_step(args) * steps_per_s / variant.processes / 1e12
        row += [f"{tflops:.1f}", f"{tflops / args.peak_tflops:.1%}"]
    return row


def format_table(args: argparse.Namespace, variants: list[Variant], runs: dict[str, list[Run]]) -> str:
    summaries = {key: Summary.of(key_runs) for key, key_runs in runs.items()}
    header = ["variant", "procs", "tokens/s", "slowest run", "peak MiB/rank", "tok/s ratio", "mem ratio", "last loss"]
    if args.device == "cuda":
        header += ["TFLOP/s/dev", "MFU"]
    rows = [header] + [table_row(args, v, summaries[v.key], summaries.get(v.baseline)) for v in variants]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def describe(args: argparse.Namespace) -> str:
    config = gpt_config(args)
    return (f"GPT h={args.hidden} layers={args.layers} heads={args.heads} seq={args.seq} vocab={args.vocab} "
            f"({config.num_parameters() / 1e6:.2f}M params), batch={args.batch}, {args.device} {args.precision}, "
            f"threads/process={args.threads or 'default'}, "
            f"Megatron pad_vocab_to_multiple_of={args.pad_vocab}, torch {torch.__version__}, lightning {L.__version__}\n"
            f"tokens/s: median step time ({args.clock} clock) over {args.steps} steps after {args.warmup} warmup; best of {args.repeats} "
            f"interleaved runs. Ratios: row / the baseline row above it (goal tok/s >= 0.97).")


def runnable_variants(args: argparse.Namespace) -> list[Variant]:
    """The variants asked for that this machine can run (a CUDA run needs a GPU per process)."""
    variants = [v for v in VARIANTS if not args.only or v.key in args.only]
    if args.device != "cuda":
        return variants
    gpus = torch.cuda.device_count()
    for variant in variants:
        if variant.processes > gpus:
            print(f"skipping {variant.label}: needs {variant.processes} GPUs, found {gpus}", file=sys.stderr)
    return [v for v in variants if v.processes <= gpus]


def main() -> None:
    args = parse_args()
    if args.worker:
        worker_main(args)
        return
    variants = runnable_variants(args)
    runs = run_all(args, sys.argv[1:], variants)
    print(describe(args))
    print(format_table(args, variants, runs))


if __name__ == "__main__":
    main()
