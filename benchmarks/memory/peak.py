"""``python -m benchmarks.memory peak``: the peak activation memory per rank of one training step's forward and
backward, on the CPU, for tensor, sequence and pipeline parallelism with and without activation recomputation.

The ``activations`` mode counts what autograd *saves* for backward; a rank's memory high-water mark is
more than that: the temporaries of the forward and of the backward (the logits' softmax, the gradients flowing back,
a recomputed layer's activations) come on top, and under pipelining several micro-batches are in flight at once.
This harness measures the peak itself: every storage an op allocates during the step, from its allocation until it
dies, with a ``TorchDispatchMode`` (``lightning_megatron.plan.probes.LiveStorages``), so the peak is exact in bytes
and does not depend on the allocator.

Each layout is built as ``Megatron3DStrategy`` builds it (``parallelize``, ``apply_recompute``, ``split_pipeline``,
``initialize_parameters``, ``build_step_gradients``, the 1F1B runner of ``tests/workers/layout_runs.py``), without
the Lightning Trainer, and trained one step (so that gradient buffers and optimizer state exist); the forward and
backward (up to the last backward, not the optimizer step) of each of the next ``REPEATS`` steps is measured:

* ``peak_bytes``: the peak of the bytes allocated during a measured step and still alive, the least over the
  steps (``peak_bytes_max`` the most; see ``measure_layout`` for why they may differ), leaving out the
  storages that at its end hold a parameter's ``.grad`` or a gradient buffer of the step's bookkeeping (model state:
  with dp = 1 autograd allocates the gradients in the step, with dp > 1 they are copied into buffers that exist
  before it). What existed before the step (parameters, buffers, optimizer state) is not counted.
* ``forward_peak_bytes``: the same peak before the first backward op (for pp = 1 the forward and the loss; under
  1F1B the forwards this rank's stage runs before its first backward).
* ``saved_bytes``: what ``plan.probes.SavedActivations`` counts for one micro-batch's forward (with its loss
  on the last stage): the storages autograd saves for backward, parameters left out.

Every layout runs over the same two processes (``torch.distributed.run``, gloo, one thread each), data parallelism
filling what tensor and pipeline parallelism leave. Example::

    python -m benchmarks.memory peak                                     # every layout, about 40 s on 2 cores
    python -m benchmarks.memory peak --layouts tp1-none,pp2-none --json

From another mode (``planner``)::

    from benchmarks.memory.peak import measure
    rows = measure(["tp2-sp-none", "tp2-sp-full"])   # one dict per (layout, rank), as --json prints
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor, nn

from benchmarks.harness.launch import REPO_ROOT, add_worker_flags, read_ranks, torchrun, worker_env
from benchmarks.harness.tables import MIB, format_rows
from benchmarks.memory import ENTRY
from lightning_megatron.plan.probes import LiveStorages, SavedActivations

RANKS = 2  # every layout runs over the same two processes
SEED = 1234
VOCAB = 257
LLAMA3_VOCAB = 128256
PAD_VOCAB = 128  # the strategy's default pad_vocab_to_multiple_of
WORKERS = REPO_ROOT / "tests" / "workers"  # layout_runs.start_worker_pipeline
PROGRESS = "activation_peak: "  # the workers' lines the parent passes on to its stderr
MODES = ("none", "selective", "full")
REPEATS = 3  # measured steps per layout (see measure_layout)


# ---------------------------------------------------------------------------- the layouts
@dataclass(frozen=True)
class Layout:
    key: str
    model: str  # "gpt" (learned positions, GELU, LayerNorm, tied embeddings), "llama" (the llama-tiny preset) or
    # "qwen3" (llama with Qwen3's per-head q/k norms and heads twice hidden / heads wide) or "mla" (deepseek-v3-tiny's
    # multi-head latent attention and dense SwiGLU layers)
    tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    pipeline_parallel_size: int = 1
    activation_checkpointing: str = "none"  # "none", "selective" or "full"
    micro_batch_size: int = 2
    micro_batches: int = 1  # per step and rank
    seq_length: int = 512
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    virtual_pipeline_size: int = 1  # > 1: interleaved 1F1B
    vocab_size: int = VOCAB
    loss_chunk_tokens: Optional[int] = None  # the chunked loss (GPTConfig.loss_chunk_tokens)

    @property
    def pipeline_schedule(self) -> str:
        return "interleaved_1f1b" if self.virtual_pipeline_size > 1 else "1f1b"

    @property
    def data_parallel_size(self) -> int:
        return RANKS // (self.tensor_parallel_size * self.pipeline_parallel_size)

    def settings(self) -> dict:
        return {**{name: value for name, value in asdict(self).items() if name != "key"},
                "data_parallel_size": self.data_parallel_size}


PIPELINE = dict(pipeline_parallel_size=2, micro_batch_size=1, micro_batches=4)  # 1F1B
# Llama-3's vocabulary (128,256) on the tiny Llama, 128 tokens a micro-batch: unchunked, and the chunked loss at 32
# tokens a chunk ("chunk-": its unchunked twin is the same key without it). pp2 only on request (--layouts): its first
# stage's peak is the untied 128k-row embedding's gradient, model state that the planner does not count there.
LLAMA3_LAYOUTS = tuple(
    Layout(f"{prefix}llama3-{key}", "llama", seq_length=128, vocab_size=LLAMA3_VOCAB, loss_chunk_tokens=chunk,
           **settings)
    for prefix, chunk in (("", None), ("chunk-", 32))
    for key, settings in (("tp1-none", dict(micro_batch_size=1)),
                          ("tp2-sp-none", dict(micro_batch_size=1, tensor_parallel_size=2, sequence_parallel=True)),
                          ("pp2-none", dict(PIPELINE, micro_batches=2))))
LAYOUTS = (
    *(Layout(f"tp1-{mode}", "gpt", activation_checkpointing=mode) for mode in MODES),
    *(Layout(f"tp2-{mode}", "gpt", tensor_parallel_size=2, activation_checkpointing=mode) for mode in MODES),
    *(Layout(f"tp2-sp-{mode}", "gpt", tensor_parallel_size=2, sequence_parallel=True, activation_checkpointing=mode)
      for mode in MODES),
    *(Layout(f"pp2-{mode}", "gpt", activation_checkpointing=mode, **PIPELINE) for mode in MODES),
    *(Layout(f"pp2v2-{mode}", "gpt", activation_checkpointing=mode, virtual_pipeline_size=2, **PIPELINE)
      for mode in ("none", "full")),
    Layout("llama-tp1-none", "llama"),
    Layout("llama-tp2-sp-none", "llama", tensor_parallel_size=2, sequence_parallel=True),
    Layout("llama-tp2-sp-full", "llama", tensor_parallel_size=2, sequence_parallel=True,
           activation_checkpointing="full"),
    Layout("llama-pp2-none", "llama", **PIPELINE),
    Layout("qwen3-tp2-sp-none", "qwen3", tensor_parallel_size=2, sequence_parallel=True),
    Layout("mla-tp2-sp-none", "mla", tensor_parallel_size=2, sequence_parallel=True),
    # Other sizes than the ones above, so that a prediction tuned to one shape shows it (the planner's check).
    *(Layout(f"wide-{key}", model, seq_length=384, hidden_size=96, num_layers=2, num_heads=6, **settings)
      for key, model, settings in (
          ("tp2-sp-selective", "gpt", dict(tensor_parallel_size=2, sequence_parallel=True,
                                           activation_checkpointing="selective")),
          ("llama-tp1-full", "llama", dict(activation_checkpointing="full")),
          ("llama-pp2-selective", "llama", dict(activation_checkpointing="selective", **PIPELINE)))),
    *(layout for layout in LLAMA3_LAYOUTS if "pp2" not in layout.key),
)
LAYOUTS_BY_KEY = {layout.key: layout for layout in (*LAYOUTS, *LLAMA3_LAYOUTS)}


def model_config(layout: Layout):
    from lightning_megatron.models.gpt import GPTConfig

    sizes = dict(vocab_size=layout.vocab_size, loss_chunk_tokens=layout.loss_chunk_tokens,
                 max_seq_length=layout.seq_length, hidden_size=layout.hidden_size,
                 num_layers=layout.num_layers, num_heads=layout.num_heads, dropout=0.0, attention_dropout=0.0)
    if layout.model == "gpt":
        return GPTConfig(**sizes)
    if layout.model == "mla":
        return GPTConfig.from_name("deepseek-v3-tiny", **sizes, ffn_hidden_size=176 * layout.hidden_size // 64,
                                   moe=None)
    qwen3 = dict(kv_channels=2 * layout.hidden_size // layout.num_heads, qk_layernorm=True) if layout.model == "qwen3" \
        else {}
    return GPTConfig.from_name("llama-tiny", **sizes, num_query_groups=layout.num_heads // 2,
                               ffn_hidden_size=176 * layout.hidden_size // 64, **qwen3)


# ---------------------------------------------------------------------------- counting
@contextlib.contextmanager
def saving_first_forward(stage: nn.Module, saved):
    """``saved`` (a ``SavedActivations``) active from the pipeline stage's first forward to its second, so it sees
    the first micro-batch's forward and, on the last stage, its loss. The backward in between (1F1B's first backward
    on the last stage) saves nothing: grad mode is off there, and recomputation saves under its own hooks."""
    forwards = 0

    def before_forward(*_) -> None:
        nonlocal forwards
        forwards += 1
        if forwards == 1:
            saved.__enter__()
        elif forwards == 2:
            saved.__exit__(None, None, None)

    handle = stage.register_forward_pre_hook(before_forward)
    try:
        yield
    finally:
        handle.remove()
        if forwards == 1:
            saved.__exit__(None, None, None)


# ---------------------------------------------------------------------------- the model, as the strategy builds it
@dataclass
class Built:
    state: object  # ParallelState
    module: nn.Module  # the LightningModule
    optimizer: torch.optim.Optimizer
    step: object  # StepGradients
    runner: object  # PipelineRunner (pp > 1) or None
    stage: Optional[nn.Module]  # this rank's pipeline stage (pp > 1)


def start_pipeline(split, state, step, micro_batch_size: int, schedule: str):
    """The test workers' ``start_worker_pipeline``: ``preparation.start_pipeline`` (1F1B or interleaved) with the strategy's
    ``before_backward`` wiring to the step's gradient bookkeeping."""
    if str(WORKERS) not in sys.path:
        sys.path.insert(0, str(WORKERS))
    from layout_runs import start_worker_pipeline

    return start_worker_pipeline(split, state, step, micro_batch_size, schedule)


def build(layout: Layout) -> Built:
    from lightning_megatron.models import GPT
    from lightning_megatron.optim.step import build_step_gradients
    from lightning_megatron.parallel import ParallelConfig, ParallelState, TensorParallelRNG
    from lightning_megatron.parallel.initialize import initialize_parameters
    from lightning_megatron.strategy.options import StrategyOptions
    from lightning_megatron.strategy.preparation import apply_recompute, split_pipeline
    from lightning_megatron.tensor_parallel import parallelize

    config = ParallelConfig(tensor_parallel_size=layout.tensor_parallel_size,
                            pipeline_parallel_size=layout.pipeline_parallel_size,
                            data_parallel_size=layout.data_parallel_size, sequence_parallel=layout.sequence_parallel,
                            virtual_pipeline_size=layout.virtual_pipeline_size)
    state = ParallelState.create(config, "cpu")
    torch.manual_seed(SEED + 100 * state.pipeline_parallel_rank)  # the strategy's per-stage dropout seed
    module = GPT(model_config(layout))
    with torch.device("meta"):
        module.configure_model()
    rng = TensorParallelRNG(SEED, state.tensor_parallel_rank, torch.device("cpu"))
    parallelize(module, module.tensor_parallel_plan(), state, rng=rng, pad_vocab_to_multiple_of=PAD_VOCAB)
    apply_recompute(module, layout.activation_checkpointing, rng)
    split = split_pipeline(module, state)
    initialize_parameters(module, SEED, device="cpu", only_meta=True)
    module.train()
    optimizer = module.configure_optimizers()["optimizer"]  # AdamW; without a Trainer its cosine spans one step
    step = build_step_gradients(module, state, [optimizer], StrategyOptions(zero_stage=state.config.zero_stage,
                                bucket_size_mb=25.0), zero3=None, loss_scaler=None, nonfinite=None,
                                device=torch.device("cpu"))
    runner = stage = None
    if split is not None:
        runner = start_pipeline(split, state, step, layout.micro_batch_size, layout.pipeline_schedule)
        stage = split.stage_modules[0]
    return Built(state, module, optimizer, step, runner, stage)


def rank_batch(layout: Layout, state) -> tuple[Tensor, Tensor]:
    """This data-parallel rank's rows of the global batch: random tokens (fixed seed), labels the next token."""
    rows = layout.micro_batch_size * layout.micro_batches
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (rows * layout.data_parallel_size, layout.seq_length + 1), generator=generator)
    mine = tokens[state.data_parallel_rank * rows:(state.data_parallel_rank + 1) * rows]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


def forward_backward(layout: Layout, built: Built, input_ids: Tensor, labels: Tensor, saved=None) -> None:
    """One step's forward and backward as the strategy runs them (token-summed losses times the step's backward
    scale); ``saved`` (a ``SavedActivations``) watches the first micro-batch's forward."""
    nothing = contextlib.nullcontext()
    step = built.step
    if built.runner is not None:  # the schedule runs every micro-batch's forward and backward
        with saving_first_forward(built.stage, saved) if saved is not None else nothing:
            _, tokens = built.runner.loss(input_ids, labels)
        step.add_tokens(tokens)
        return
    pieces = list(zip(input_ids.chunk(layout.micro_batches), labels.chunk(layout.micro_batches)))
    for i, (ids, lbl) in enumerate(pieces):
        step.sync.start_micro_batch(sync=i == len(pieces) - 1)
        with saved if saved is not None and i == 0 else nothing:
            loss_sum, tokens = built.module.model.loss(ids, lbl)
        (loss_sum * step.backward_scale(tokens, accumulation=len(pieces), loss_scale=1.0)).backward()
        step.add_tokens(tokens)


def optimizer_step(layout: Layout, built: Built) -> None:
    accumulation = 1 if built.runner is not None else layout.micro_batches
    built.step.finish(accumulation=accumulation, loss_scale=1.0)
    built.optimizer.step()
    built.step.after_step()


def gradient_tensors(built: Built) -> list[Tensor]:
    """Model state the backward writes: the parameters' ``.grad`` and the step's gradient buffers (dp > 1)."""
    grads = [p.grad for p in built.module.parameters() if p.grad is not None]
    for bucket in getattr(built.step.sync, "buckets", ()):
        grads += [t for t in (bucket.buffer, bucket.shard) if t is not None]
    return grads


def measure_step(layout: Layout, built: Built, input_ids: Tensor, labels: Tensor) -> dict:
    """One step's forward and backward under ``LiveStorages`` and ``SavedActivations``: its peaks and saved bytes."""
    gc.collect()  # nothing an earlier step left in reference cycles dies inside this one
    saved = SavedActivations(built.module)
    with LiveStorages() as tracker:
        forward_backward(layout, built, input_ids, labels, saved)
        model_state = tracker.ids_of(gradient_tensors(built))
    if tracker.backward_start is None:
        raise RuntimeError(f"{layout.key}: the dispatch mode saw no backward op; the peak would be the forward's")
    peak, at_peak = tracker.peak(model_state)
    forward_peak, _ = tracker.peak(model_state, stop=tracker.backward_start)
    return {"forward_peak_bytes": forward_peak, "peak_bytes": peak, "saved_bytes": saved.bytes(), "at_peak": at_peak}


def measure_layout(layout: Layout) -> dict:
    """Build ``layout``, train one step, then measure ``REPEATS`` steps (an optimizer step after each) on this rank.

    The least peak of those steps is reported: gloo's worker thread drops its last reference to a collective's
    tensors when it is done with them, which races with the main thread's next allocations, so a peak is now and
    then a few hundred KiB higher (``peak_bytes_max``). The least is the order in which a collective's buffers die
    as its ``wait()`` returns."""
    import torch.distributed as dist

    built = build(layout)
    input_ids, labels = rank_batch(layout, built.state)
    forward_backward(layout, built, input_ids, labels)
    optimizer_step(layout, built)
    steps = []
    for _ in range(REPEATS):
        steps.append(measure_step(layout, built, input_ids, labels))
        optimizer_step(layout, built)
    built.step.remove()
    least = min(steps, key=lambda step: step["peak_bytes"])
    return {"layout": layout.key, "rank": dist.get_rank(), "pipeline_rank": built.state.pipeline_parallel_rank,
            **least, "forward_peak_bytes": min(step["forward_peak_bytes"] for step in steps),
            "peak_bytes_max": max(step["peak_bytes"] for step in steps), **layout.settings()}


def worker(result_dir: Path, keys: list[str]) -> None:
    """A process of the ``peak`` mode's launch: the default group joined, :func:`measure_layouts`, and out."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    measure_layouts(result_dir, keys)
    os._exit(0)  # skip gloo's C++ teardown: with several meshes alive it aborts at random (torch 2.13)


def measure_layouts(result_dir: Path, keys: list[str]) -> None:
    """Every layout in ``keys``, one after another over the default group's ranks (joined already: a launch's, or a
    test's rank pool's); ``rank{r}.json`` per rank."""
    import torch.distributed as dist

    rank = dist.get_rank()
    results = {}
    # What exists now (torch's, Lightning's, the process's objects) outlives every step: each step's gc.collect
    # then scans only what the layouts made, not ~500k objects (~0.25 s a collection, three a layout).
    gc.collect()
    gc.freeze()
    try:
        for number, key in enumerate(keys, 1):
            start = time.perf_counter()
            results[key] = measure_layout(LAYOUTS_BY_KEY[key])
            if rank == 0:
                print(f"{PROGRESS}  [{number}/{len(keys)}] {key}: {time.perf_counter() - start:.1f} s",
                      file=sys.stderr, flush=True)
    finally:
        gc.unfreeze()
    (result_dir / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()


# ---------------------------------------------------------------------------- the parent
def measure(layout_keys: Optional[list[str]] = None) -> list[dict]:
    """Run ``layout_keys`` (default: every layout) in one ``torch.distributed.run`` launch of two processes; one
    dict per (layout, rank), layouts in the order given: ``layout``, ``rank``, ``pipeline_rank``, ``peak_bytes``,
    ``peak_bytes_max``, ``forward_peak_bytes``, ``saved_bytes``, ``at_peak`` (bytes live at the peak by the op
    that allocated them and whether it ran in forward or backward, the five largest) and the layout's settings."""
    keys = list(layout_keys) if layout_keys else [layout.key for layout in LAYOUTS]
    unknown = [key for key in keys if key not in LAYOUTS_BY_KEY]
    if unknown:
        raise ValueError(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS_BY_KEY)}")
    with tempfile.TemporaryDirectory(prefix="activation-peak-") as tmp:
        cmd = torchrun(RANKS, ENTRY, "peak", "--worker", "--result-dir", tmp, "--layouts", ",".join(keys))
        print(f"{len(keys)} layouts on {RANKS} ranks ...", file=sys.stderr, flush=True)
        proc = subprocess.Popen(cmd, env=worker_env(), cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tail: deque[str] = deque(maxlen=200)
        for line in proc.stdout:
            if line.startswith(PROGRESS):
                print(line[len(PROGRESS):], end="", file=sys.stderr, flush=True)
            else:
                tail.append(line)
        if proc.wait() != 0:
            raise RuntimeError(f"the workers failed (exit code {proc.returncode}):\n{''.join(tail)}")
        return rows_of(read_ranks(Path(tmp), RANKS), keys)


def rows_of(ranks: list[dict], keys: list[str]) -> list[dict]:
    """One row per (layout, rank) from what each rank measured, layouts in the order of ``keys``."""
    return [results[key] for key in keys for results in ranks]


def format_table(rows: list[dict]) -> str:
    header = ["layout", "model", "tp", "sp", "pp", "dp", "recompute", "micro-batches", "rank", "pp rank",
              "forward peak MiB", "peak MiB", f"max of {REPEATS}", "saved MiB", "/ unchunked", "largest at peak (MiB)"]
    table = [header]
    peaks = {(row["layout"], row["rank"]): row["peak_bytes"] for row in rows}
    for row in rows:
        twin = peaks.get((row["layout"].removeprefix("chunk-"), row["rank"])) if row["loss_chunk_tokens"] else None
        name, nbytes = next(iter(row["at_peak"].items()), ("-", 0))
        table.append([row["layout"], row["model"], str(row["tensor_parallel_size"]),
                      "yes" if row["sequence_parallel"] else "no", str(row["pipeline_parallel_size"]),
                      str(row["data_parallel_size"]), row["activation_checkpointing"],
                      f"{row['micro_batches']} x {row['micro_batch_size']}", str(row["rank"]),
                      str(row["pipeline_rank"]), f"{row['forward_peak_bytes'] / MIB:.3f}",
                      f"{row['peak_bytes'] / MIB:.3f}", f"{row['peak_bytes_max'] / MIB:.3f}",
                      f"{row['saved_bytes'] / MIB:.3f}", f"{row['peak_bytes'] / twin:.3f}" if twin else "-",
                      f"{name} {nbytes / MIB:.3f}"])
    return format_rows(table, left=(0, 1, 6, 15))


def footer() -> str:
    notes = [
        f"GPT: h=64, 4 layers, 4 heads, vocab {VOCAB} (padded to a multiple of {PAD_VOCAB}), learned positions, "
        "GELU, LayerNorm, tied embeddings; llama: the llama-tiny preset at the same sizes (2 key/value groups, "
        "SwiGLU 176, RMSNorm, rotary, untied); qwen3: llama with per-head q/k RMSNorms and 32-channel heads. fp32, dropout 0, AdamW; micro-batches: per step and rank x samples "
        f"of 512 tokens; {RANKS} processes, data parallelism filling what tp x pp leave; torch {torch.__version__}.",
        "peak: the most bytes alive at once among the storages allocated during a step's forward and backward, "
        "leaving out the gradients and gradient buffers that hold model state at its end, the least over "
        f"{REPEATS} steps after a warm-up step (max: the most; gloo's thread frees a collective's buffers at a time "
        "that races with the main thread); forward peak: the same before the first backward op; saved: the storages "
        "autograd saves for backward in one micro-batch's forward (with its loss on the last stage), parameters "
        "left out. largest at peak: the op whose outputs (summed) hold the most of the peak. / unchunked: a chunk- "
        "layout's peak (the chunked loss, GPTConfig.loss_chunk_tokens) over its unchunked twin's, same rank. llama3: "
        f"the llama model with Llama-3's vocabulary ({LLAMA3_VOCAB}), 1 x 128 tokens, 32 tokens a chunk.",
    ]
    return "\n".join(f"* {note}" for note in notes)


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the results as a JSON list instead of the table")
    parser.add_argument("--layouts", help=f"a comma list of layouts (default: all): {', '.join(LAYOUTS_BY_KEY)}")
    add_worker_flags(parser)
    args = parser.parse_args(argv)
    keys = args.layouts.split(",") if args.layouts else [layout.key for layout in LAYOUTS]
    if args.worker:
        worker(args.result_dir, keys)
        return
    rows = measure(keys)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(format_table(rows))
    print(footer())

