"""Training throughput and peak memory of ``Megatron3DStrategy`` against its baselines, in one table.

Two comparisons on the same ``GPTModel``, config, batches, AdamW and learning-rate schedule:

(a) one process: ``Megatron3DStrategy(tensor_parallel_size=1)`` against a plain PyTorch loop, with
    Lightning's default single-device strategy on the same module in between (what Lightning's own
    loop costs, so the table separates the strategy's per-step cost from Lightning's);
(b) two processes: ``Megatron3DStrategy(tensor_parallel_size=2)`` against Lightning's
    ``ModelParallelStrategy`` with torch's DTensor tensor-parallel plan on the same layers.

``--model gpt`` (default) is GPT-2-shaped (LayerNorm, learned positions, GELU, tied
embeddings); ``--model llama`` is Llama-shaped (RMSNorm, rotary, SwiGLU, grouped-query
attention, untied output layer: the ``llama-tiny`` preset resized by the size flags, at a
32,000-token vocabulary by default); ``--model gpt llama`` runs both into one table.

Every run is a fresh process (``torchrun`` for two ranks): a process's peak RSS is a
high-water mark that never goes down, so only a fresh process can attribute a peak to one
run, and no run inherits another's allocator caches or warmed-up kernels. Repeats are
interleaved, in reversed order every other round, so slow drift on a shared machine
falls on every variant alike. See ``benchmarks/README.md`` for how to read the table.

Example::

    python -m benchmarks.throughput                      # small CPU default, 2-3 minutes
    python -m benchmarks.throughput --model llama        # Llama-shaped, vocab 32,000
    python -m benchmarks.throughput --device cuda --precision bf16-mixed \
        --hidden 2048 --layers 24 --heads 16 --seq 2048 --batch 8 --vocab 51200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

from lightning_megatron import Megatron3DStrategy
from lightning_megatron.models.gpt import GPT, IGNORE_INDEX, GPTModel
from lightning_megatron.models.mlp import GatedMLP, is_gated
from lightning_megatron.models.transformer import TransformerLayer

from benchmarks.harness.launch import add_worker_flags, read_ranks, run_checked, torchrun, worker_env, worker_rank_and_device
from benchmarks.harness.rounds import Run, abba
from benchmarks.harness.tables import MIB, format_rows
from benchmarks.harness.timing import PeakMemory, Stopwatch, StopwatchCallback
from benchmarks.harness.training import (DEFAULT_VOCAB, gpt_config, make_loader, make_module, model_name, quiet_trainer,
                              total_steps)

MODELS = tuple(DEFAULT_VOCAB)


# ---------------------------------------------------------------------------- variants
@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    processes: int
    baseline: Optional[str] = None  # the key this variant's ratios are taken against


VARIANTS = (
    Variant("plain", "plain PyTorch loop", 1),
    Variant("lightning", "Lightning, single device", 1, baseline="plain"),
    Variant("megatron_tp1", "Megatron3DStrategy tp=1", 1, baseline="plain"),
    Variant("model_parallel_tp2", "ModelParallelStrategy tp=2 (DTensor)", 2),
    Variant("megatron_tp2", "Megatron3DStrategy tp=2", 2, baseline="model_parallel_tp2"),
    # Regional compilation (``compile=True``: inductor, each layer's forward); not run unless named in --only.
    Variant("megatron_tp1_compiled", "Megatron3DStrategy tp=1 compile=True", 1, baseline="megatron_tp1"),
    Variant("megatron_tp2_compiled", "Megatron3DStrategy tp=2 compile=True", 2, baseline="megatron_tp2"),
)
COMPILED = ("megatron_tp1_compiled", "megatron_tp2_compiled")


# ---------------------------------------------------------------------------- arguments
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="samples per step (the global batch: dp=1 everywhere)")
    parser.add_argument("--model", nargs="+", choices=MODELS, default=["gpt"],
                        help="gpt: GPT-2-shaped; llama: Llama-shaped (RMSNorm, rotary, SwiGLU, GQA, untied head); "
                             "several: one table with each model's rows")
    parser.add_argument("--vocab", type=int, default=None,
                        help=f"vocabulary size (default per model: {DEFAULT_VOCAB}; 257 is the project's byte tokenizer)")
    parser.add_argument("--query-groups", type=int, default=None,
                        help="llama: key/value heads (default heads // 2, as llama-tiny)")
    parser.add_argument("--ffn", type=int, default=None,
                        help="MLP width (default gpt: 4 * hidden; llama: 11/4 * hidden for each of gate and up, as llama-tiny)")
    parser.add_argument("--pad-vocab", type=int, default=128,
                        help="Megatron3DStrategy's pad_vocab_to_multiple_of (1 = no padding)")
    parser.add_argument("--on-nonfinite", choices=("error", "skip", "ignore"), default="error",
                        help="Megatron3DStrategy's on_nonfinite (default 'error', the strategy's default: a global "
                             "gradient-norm check every step, which the plain loop does not do; 'ignore' turns it off)")
    parser.add_argument("--clip-grad", type=float, default=None,
                        help="clip gradients to this global norm in every variant (the plain loop: "
                             "torch.nn.utils.clip_grad_norm_; Lightning: Trainer(gradient_clip_val=...)); default: no clipping")
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
    add_worker_flags(parser, [v.key for v in VARIANTS])
    return parser.parse_args(argv)


def for_model(args: argparse.Namespace, model: str) -> argparse.Namespace:
    """A copy of ``args`` for one model, its vocabulary resolved."""
    return argparse.Namespace(**{**vars(args), "model": model, "vocab": args.vocab or DEFAULT_VOCAB[model]})


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


def interleave_gate_up(fc: nn.Linear, world: int) -> None:
    """Reorder a fused ``[gate | up]`` projection's rows to ``[gate_0 | up_0 | gate_1 | up_1 | ...]``.

    ``ColwiseParallel`` (``Shard(0)``) hands rank ``r`` the ``r``-th contiguous block of rows. On
    ``[gate | up]`` that block is half the gate on rank 0 and half the up projection on rank 1, so
    ``GatedMLP``'s local ``chunk(2)`` would multiply gate channels by the wrong up channels:
    plain ``ColwiseParallel`` on the fused ``fc`` is wrong. With the rows interleaved per rank, rank
    ``r``'s block is ``[gate_r | up_r]``, exactly the shard Megatron's ``PackedColumn(2)`` gives it,
    and the unsharded model computes what it computed before (the same rows, reordered consistently
    with the ``chunk``). This is DTensor's usual answer for fused projections: lay the weight out so
    that a contiguous shard is the right one (torchtitan keeps gate and up as two linears instead).
    """
    with torch.no_grad():
        gate, up = fc.weight.chunk(2, dim=0)
        fc.weight.copy_(torch.cat([torch.cat(pair) for pair in zip(gate.chunk(world), up.chunk(world))]))
        if fc.bias is not None:
            gate, up = fc.bias.chunk(2)
            fc.bias.copy_(torch.cat([torch.cat(pair) for pair in zip(gate.chunk(world), up.chunk(world))]))


class LossParallelGPTModel(GPTModel):
    """``GPTModel`` whose loss reads vocab-sharded DTensor logits through ``loss_parallel`` (torchtitan's way)."""

    def pipeline_loss(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, dict]:
        with loss_parallel():
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum",
                                               ignore_index=IGNORE_INDEX)
        return loss.to_local(), {}  # replicated: every rank holds the whole sum


class DTensorLlama(GPT):
    """A Llama-shaped ``GPT`` split by a torchtitan-style DTensor plan, for ``ModelParallelStrategy``.

    Per layer: ``attn.qkv`` ``ColwiseParallel`` (its rows are laid out by query group, so a
    contiguous split hands each rank whole groups: right whenever tp divides the groups, which
    ``configure_model`` checks), ``attn.proj`` and ``mlp.proj`` ``RowwiseParallel``, ``mlp.fc``
    ``ColwiseParallel`` over rows interleaved per rank (``interleave_gate_up``). As torchtitan:
    the embedding ``RowwiseParallel`` (vocabulary-sharded, all-reduced output), the output layer
    ``ColwiseParallel`` with vocabulary-sharded logits, and cross-entropy under ``loss_parallel``
    (forward and backward), so neither side computes or stores full logits. Every rank then does
    the same matmuls as Megatron's plan (same shapes: FLOP-equivalent) with the same collectives
    (an all-reduce after each row-parallel layer, after the embedding, and the loss's). The final
    RMSNorm stays replicated (no sequence parallelism on either side).
    """

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = LossParallelGPTModel(self.config)
        mesh = self.device_mesh["tensor_parallel"]
        world = mesh.size()
        if self.config.query_groups % world:
            raise ValueError(f"DTensorLlama needs tp={world} to divide num_query_groups={self.config.query_groups}: a "
                             f"contiguous split of qkv would cut a query group apart.")
        for block in [m for m in self.model.modules() if isinstance(m, TransformerLayer)]:
            if isinstance(block.mlp, GatedMLP):
                interleave_gate_up(block.mlp.fc, world)
            parallelize_module(block, mesh, DTENSOR_BLOCK_PLAN)
            block.attn.qkv = LocalWeightShape(block.attn.qkv)
        parallelize_module(self.model, mesh, {
            "embedding.wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        })

    def backward(self, loss: Tensor, *args, **kwargs) -> None:
        with loss_parallel():  # the sharded cross-entropy's backward runs under it too
            super().backward(loss, *args, **kwargs)


# ---------------------------------------------------------------------------- workers
Measurement = tuple[list[float], int, float]  # (seconds of each measured step, peak bytes, last loss)


def run_plain(args: argparse.Namespace, device: torch.device, module: Optional[GPT] = None) -> Measurement:
    """The loop a PyTorch user writes, with GPT's own AdamW param groups and learning-rate schedule.

    ``module``: the ``GPT`` to train (default: the size flags' model; ``gpu_check.py`` passes a preset's).
    ``args.precision``: ``"bf16-mixed"`` runs under autocast, ``"bf16-true"`` holds the weights in bf16 (as
    Lightning's ``bf16-true`` does), anything else trains in fp32."""
    loader = make_loader(args)
    memory = PeakMemory(device)
    module = module or make_module(args)
    module.configure_model()
    model = module.model.to(device=device, dtype=torch.bfloat16 if args.precision == "bf16-true" else None)
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
        if args.clip_grad is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
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
    trainer = quiet_trainer(strategy=strategy, accelerator=device.type, devices=devices, precision=args.precision,
                            max_steps=total_steps(args), gradient_clip_val=getattr(args, "clip_grad", None),
                            callbacks=[stopwatch])
    trainer.fit(module, loader)
    return stopwatch.stopwatch.step_seconds(), memory.peak_bytes(), stopwatch.last_loss.item()


def run_single_device(args: argparse.Namespace, device: torch.device) -> Measurement:
    """The same ``GPT`` module under Lightning's default strategy for one device: Lightning's own per-step cost."""
    return run_lightning(args, device, make_module(args), "auto", devices=1)


def run_megatron(args: argparse.Namespace, device: torch.device, tensor_parallel_size: int,
                 compile: bool = False) -> Measurement:
    strategy = Megatron3DStrategy(tensor_parallel_size=tensor_parallel_size, pad_vocab_to_multiple_of=args.pad_vocab,
                                  on_nonfinite=getattr(args, "on_nonfinite", "error"), compile=compile)
    return run_lightning(args, device, make_module(args), strategy, devices=tensor_parallel_size)


def run_model_parallel(args: argparse.Namespace, device: torch.device) -> Measurement:
    strategy = ModelParallelStrategy(tensor_parallel_size=2, data_parallel_size=1)
    module_class = DTensorLlama if model_name(args) == "llama" else DTensorGPT
    return run_lightning(args, device, make_module(args, module_class), strategy, devices=2)


WORKERS: dict[str, Callable[[argparse.Namespace, torch.device], Measurement]] = {
    "plain": run_plain,
    "lightning": run_single_device,
    "megatron_tp1": partial(run_megatron, tensor_parallel_size=1),
    "model_parallel_tp2": run_model_parallel,
    "megatron_tp2": partial(run_megatron, tensor_parallel_size=2),
    "megatron_tp1_compiled": partial(run_megatron, tensor_parallel_size=1, compile=True),
    "megatron_tp2_compiled": partial(run_megatron, tensor_parallel_size=2, compile=True),
}


def worker_main(args: argparse.Namespace) -> None:
    """Run one variant on this rank and write ``rank{r}.json`` into the result directory."""
    rank, device = worker_rank_and_device(args.device)
    L.seed_everything(args.seed, verbose=False)  # identical initial weights in every variant
    step_seconds, peak, loss = WORKERS[args.worker](args, device)
    result = {"step_seconds": step_seconds, "peak_bytes": peak, "loss": loss}
    (args.result_dir / f"rank{rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------- parent
def launch(variant: Variant, args: argparse.Namespace, argv: list[str], result_dir: Path) -> list[dict]:
    """One run of ``variant`` in fresh processes (one thread each by default: see ``worker_env``); the per-rank
    results. Single-rank variants run without torchrun."""
    script = [__spec__.name, *argv, "--worker", variant.key, "--result-dir", str(result_dir)]
    cmd = [sys.executable, "-m", *script] if variant.processes == 1 else torchrun(variant.processes, *script)
    run_checked(cmd, variant.label, result_dir, worker_env(args.threads))
    return read_ranks(result_dir, variant.processes)


Job = tuple[str, Variant]  # (model, variant)


def run_all(args: argparse.Namespace, argv: list[str], jobs: list[Job]) -> dict[Job, list[Run]]:
    """``repeats`` rounds; every other round runs the jobs in reverse order (ABBA) to cancel drift."""
    tokens_per_step = args.batch * args.seq
    runs: dict[Job, list[Run]] = {job: [] for job in jobs}
    with tempfile.TemporaryDirectory(prefix="throughput-") as tmp:
        for repeat in range(args.repeats):
            for model, variant in abba(jobs, repeat):
                result_dir = Path(tmp, f"{model}-{variant.key}-{repeat}")
                result_dir.mkdir()
                print(f"  round {repeat + 1}/{args.repeats}: {model} {variant.label} ...", file=sys.stderr, flush=True)
                # The worker runs one model, its vocabulary resolved (the last --model/--vocab wins in argparse).
                model_argv = [*argv, "--model", model, "--vocab", str(for_model(args, model).vocab)]
                ranks = launch(variant, args, model_argv, result_dir)
                runs[(model, variant)].append(Run.from_ranks(ranks, tokens_per_step))
    return runs


def flops_per_step(args: argparse.Namespace) -> float:
    """Model FLOPs of one training step (forward + backward, no recomputation).

    ``6 * tokens * (matmul weights per token)`` plus attention's ``12 * s * h`` per token and layer
    (``QK^T`` and ``AV``, causal mask not discounted). For a GPT-2-shaped model (``12 h^2`` weights per
    layer) this is DESIGN.md's ``72·B·s·l·h²·(1 + s/6h + V/12lh)``; grouped-query attention and
    SwiGLU change only the per-layer weight count.
    """
    config = gpt_config(args)
    h, d, layers = config.hidden_size, config.head_dim, config.num_layers
    qkv = h * (config.num_heads + 2 * config.query_groups) * d
    mlp = (3 if is_gated(config.activation) else 2) * config.ffn_size * h
    per_token = 6 * (layers * (qkv + h * h + mlp) + config.vocab_size * h) + 12 * args.seq * layers * h
    return args.batch * args.seq * per_token


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
    step_ms = lambda s: 1000 * args.batch * args.seq / s.best_tokens_per_s  # noqa: E731 (the best run's median step)
    row = [
        variant.label,
        str(variant.processes),
        f"{summary.best_tokens_per_s:,.0f}",
        f"{summary.worst_tokens_per_s:,.0f}",
        f"{step_ms(summary):.2f}",
        f"{summary.peak_bytes / MIB:,.1f}",
        f"{summary.best_tokens_per_s / baseline.best_tokens_per_s:.3f}" if baseline else "-",
        f"{step_ms(summary) - step_ms(baseline):+.2f}" if baseline else "-",
        f"{summary.peak_bytes / baseline.peak_bytes:.3f}" if baseline and baseline.peak_bytes > 0 else "-",
        f"{summary.loss:.4f}",
    ]
    if args.device == "cuda":
        steps_per_s = summary.best_tokens_per_s / (args.batch * args.seq)
        tflops = flops_per_step(args) * steps_per_s / variant.processes / 1e12
        row += [f"{tflops:.1f}", f"{tflops / args.peak_tflops:.1%}"]
    return row


def format_table(args: argparse.Namespace, jobs: list[Job], runs: dict[Job, list[Run]]) -> str:
    """One row per job; with several models a leading ``model`` column, each model's ratios against its own rows."""
    summaries = {(model, variant.key): Summary.of(job_runs) for (model, variant), job_runs in runs.items()}
    several = len({model for model, _ in jobs}) > 1
    header = ["model"] * several + ["variant", "procs", "tokens/s", "slowest run", "ms/step", "peak MiB/rank",
                                    "tok/s ratio", "+ms/step", "mem ratio", "last loss"]
    if args.device == "cuda":
        header += ["TFLOP/s/dev", "MFU"]
    rows = [header] + [[model] * several + table_row(for_model(args, model), variant, summaries[(model, variant.key)],
                                                     summaries.get((model, variant.baseline)))
                       for model, variant in jobs]
    return format_rows(rows, left=range(several + 1))


def describe_model(args: argparse.Namespace) -> str:
    config = gpt_config(args)
    if model_name(args) == "llama":
        return (f"llama: Llama-shaped (RMSNorm, rotary, SwiGLU, untied head) h={config.hidden_size} "
                f"layers={config.num_layers} heads={config.num_heads} kv_heads={config.query_groups} "
                f"ffn={config.ffn_size} seq={args.seq} vocab={config.vocab_size} ({config.num_parameters() / 1e6:.2f}M params)")
    return (f"gpt: GPT h={config.hidden_size} layers={config.num_layers} heads={config.num_heads} seq={args.seq} "
            f"vocab={config.vocab_size} ({config.num_parameters() / 1e6:.2f}M params)")


def describe(args: argparse.Namespace) -> str:
    models = "\n".join(describe_model(for_model(args, model)) for model in args.model)
    return (f"{models}\nbatch={args.batch}, {args.device} {args.precision}, "
            f"threads/process={args.threads or 'default'}, "
            f"Megatron pad_vocab_to_multiple_of={args.pad_vocab} on_nonfinite={args.on_nonfinite}, torch {torch.__version__}, lightning {L.__version__}\n"
            f"tokens/s: median step time ({args.clock} clock) over {args.steps} steps after {args.warmup} warmup; best of {args.repeats} "
            f"interleaved runs. Ratios and +ms/step: row against its baseline (1 process: the plain loop; "
            f"Megatron tp=2: ModelParallelStrategy); goal tok/s ratio >= 0.97 for Megatron tp=1.")


def runnable_variants(args: argparse.Namespace) -> list[Variant]:
    """The variants asked for that this machine can run (a CUDA run needs a GPU per process)."""
    variants = [v for v in VARIANTS if v.key in args.only] if args.only else [v for v in VARIANTS if v.key not in COMPILED]
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
    jobs = [(model, variant) for model in dict.fromkeys(args.model) for variant in runnable_variants(args)]
    runs = run_all(args, sys.argv[1:], jobs)
    print(describe(args))
    print(format_table(args, jobs, runs))


if __name__ == "__main__":
    main()
