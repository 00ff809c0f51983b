"""One GPU, one table: the CUDA paths of every feature, their kernels, and their speed against plain PyTorch.

``benchmarks/gpu_check.sh`` runs this driver under a global ``timeout``; ``--cpu`` runs every row at tiny sizes on
the CPU (gloo instead of NCCL), the self-test ``tests/test_benchmarks.py`` runs so that the first GPU run cannot
crash in its own plumbing. Every row passes, fails, or says why it cannot run ("n/a", "skipped"); a row that fell
back to a slower path is failed, never passed: each counts what it expects to run (kernel names and calls from the
profiler, ``_scaled_mm`` calls from a dispatch mode, collectives seen by the device guard). One function per family:

* ``feature_row``: the default GPT (every feature) and the Llama-shaped model (a few) through
  ``Trainer(strategy=Megatron3DStrategy(...))`` for a few steps under each feature (tp=pp=dp=1: one-rank NCCL
  groups, but the strategy's own code paths), the last step's loss against the fp32 ZeRO-0 reference run of the
  same model, seed and batches; a sharded checkpoint saved mid-run and resumed; greedy generation with the KV cache
  against a full recompute; MoE (ep=1).
* ``kernel_profiled_row``: which scaled-dot-product-attention kernel the models' attention runs (one profiled
  forward): flash, cuDNN or efficient, not the math fallback.
* ``attention_row``: the attention back ends, forward and backward against a dense fp32 reference written here:
  unpacked causal and GQA (SDPA's kernels), packed documents and a sliding window with GQA (the document back end:
  compiled FlexAttention on CUDA). The profiler must show a fused kernel in the forward and in the backward and no
  fallback, and the peak memory must stay far below one fp32 [B, H, S, S] score tensor.
* ``offload_row``: one ~135 M-parameter GPT with ``offload_optimizer="cpu"`` against no offload: the step time
  ratio, and every step's loss compared.
* ``lora_sft_row``: ``GPT(lora=...)`` on ``SFTDataModule``'s built-in instruction set, packed: losses finite and
  falling, base weights frozen, and a packed batch's loss equal to its conversations' losses run one at a time.
* ``two_ranks_row``: two processes on the one device over gloo (NCCL refuses two ranks on one GPU), one torchrun
  launch for all: every collective once, then the real multi-rank training code at tp2, dp2 ZeRO-1 and cp2 (its
  all-gather and ring variants), each under ``parallel.guards.check_collective_devices`` and
  ``count_host_syncs``, against the single-process fp32 reference of the same model.
* ``speed_row``: ``gpt-1.3b`` and ``llama-3.2-1b`` at seq 2048, bf16-true, tp=1, warmup + measured steps:
  tokens/s, model TFLOP/s (``models/flops.py``) and MFU against the device's preset in ``plan/hardware.py``, and
  ``vs plain``: against the same model, seed and batches in a plain PyTorch loop (``throughput.run_plain``) in the
  same process. The batch is the largest the planner predicts to fit; the strategy run's ``max_memory_allocated``
  against the planner's model states + activations (its 2 GiB buffer allowance left out: the allocator does not
  see it).
* ``fp8_linear_row``, ``fp8_speed_row``: FP8 against bf16 under ``bf16-mixed``. One ``ColumnParallelLinear`` at
  4096 x 4096 (8192 tokens): forward + backward time in bf16 and with each FP8 recipe's GEMMs; then ``gpt-1.3b``
  (the preset whole: real widths, depth and vocabulary; seq 2048, batch 4) through
  ``Megatron3DStrategy(fp8=None | "tensorwise" | "rowwise")``: tokens/s, model TFLOP/s, MFU (the same bf16 peak for
  every row, so MFU compares like tokens/s) and the ratio to the bf16 row (``vs bf16``), the loss against it (``vs
  ref``). A row passes only if it ran FP8 where asked and nowhere else: its parallel linears' ``gemms.fp8`` are
  counted, and so are the ``torch._scaled_mm`` calls of one step (a dispatch mode), which must be 3 (forward, input
  and weight gradients) per FP8 linear: a silent fallback to bf16 fails the row.

Isolation: the single-process rows run in one worker process, one row at a time, each reporting as it ends; a row
that raises is a failed row and the next one starts; a row that hangs past its budget or kills the process (a CUDA
fault) is marked failed and the worker is started again for the rows after it. The speed rows get a process of
their own (clean memory peaks), the fp8 rows one together, the two-rank rows one ``torchrun`` launch.

Budget on one H200 (seconds; each row's timeout, the whole run capped at ``--budget``, 330 by default, so that the
table is printed before the shell wrapper's ``timeout`` of 350 s; rows that would start after it are "skipped").
The expected times are estimates: this table has not run on a GPU yet; its first run's per-row ``s`` replaces them.

==========================  ==========  =========================================================================
family                      budget      expected
==========================  ==========  =========================================================================
main worker start           -           ~15 s: imports, CUDA and NCCL start-up (paid by the first row)
features (19 rows)          25 s/row    ~2 s a row: a Trainer, a 4-layer GPT, 6 steps
sdpa (2 rows)               20 s/row    ~2 s
attention (4 rows)          30, 90 s    ~3 s for SDPA's 2; ~30 s for Flex's 2: Inductor compiles forward and backward
offload (1 row)             60 s        ~15 s: two runs of 2 warmup + 4 measured steps, the host's AdamW on 135 M
sft (1 row)                 60 s        ~30 s: tokenising the built-in set, Flex compiled for its shapes, 6 steps
2 ranks (5 rows)            120 s/row   ~60 s, all in the first row: torchrun start-up, 4 fits, cp2 compiles Flex
speed + memory (2 rows)     100 s/row   ~40 s: a process each, 1.3 G values drawn on the host twice (the strategy's
                                        model, the plain loop's), 2 warmup + 6 measured steps each
fp8 linear (3 rows)         30 s/row    ~2 s after the process start (~15 s): 5 warmup + 20 measured passes
fp8 gpt-1.3b (3 rows)       60 s/row    ~15 s: model build, 2 warmup + 5 measured steps (batch 4 x 2048)
==========================  ==========  =========================================================================

Expected total: ~5-5.5 minutes. Cut to fit six: the NCCL probe (it only proves that NCCL refuses two ranks on one
GPU, which is why the two-rank rows use gloo), ``sdpa_kernel(FLASH)`` rows (the attention rows check the kernels
our calls choose), the llama-3.2-1b fp8 rows (the gpt-1.3b ones measure the same GEMMs), most Llama feature rows,
and steps. The fp8 rows share one process and come last: should they overrun, the cap skips them and no earlier
row. Worst case (every row at its timeout) exceeds the cap; the cap wins.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L

from benchmarks.harness import training
from benchmarks.harness.launch import repo_env, torchrun
from benchmarks.harness.tables import GIB, format_rows
from benchmarks.harness.timing import Stopwatch, StopwatchCallback
from benchmarks.harness.training import SyntheticTokens

FP32_TOLERANCE = 1e-4  # loss vs the fp32 reference: the same math (the invariant is 1e-5 on CPU; GPU kernels vary)
SIXTEEN_BIT_TOLERANCE = 5e-2  # bf16 / fp16 runs of a few steps: the same model, rounded
COLUMNS = ("family", "row", "status", "loss", "vs ref", "tokens/s", "TFLOP/s", "MFU", "vs plain", "vs bf16",
           "peak GiB", "planned GiB", "mem ratio", "s", "detail")


# ---------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class Sizes:
    """What a mode runs: the feature rows' model and steps (the two-rank rows train it too), the speed rows' presets
    and steps (the fp8 rows run the first preset at the same sequence length), the fp8 linear row's GEMM, the offload
    row's model, the LoRA SFT row's data and the attention rows' shapes."""

    device: str
    hidden: int
    layers: int
    heads: int
    seq: int
    batch: int
    steps: int  # feature rows: optimizer steps (the checkpoint row saves after half of them)
    speed_models: tuple[tuple[str, str], ...]  # (label, preset)
    speed_seq: int
    speed_warmup: int
    speed_steps: int
    speed_batches: tuple[int, ...]  # tried largest first: the first the planner predicts to fit
    fp8_batch: int  # one batch for a model's three fp8 rows: their ratios compare the same work
    fp8_warmup: int
    fp8_steps: int
    fp8_linear: tuple[int, int, int]  # tokens, in and out features of the fp8 linear rows' layer
    fp8_linear_steps: tuple[int, int]  # warmup, measured forward + backward passes
    offload_model: tuple[int, int, int, int, int, int]  # hidden, layers, heads, seq, batch, vocab
    offload_steps: tuple[int, int]  # warmup, measured optimizer steps
    sft: tuple[int, int, int]  # seq_length, global batch, optimizer steps
    attention: tuple[int, int, int, int, int, int]  # batch, query heads, key/value heads, seq, head dim, window
    vocab: dict = field(default_factory=dict)  # per model; missing: throughput's default


# fp8 rows: batch 4 x 2048 fits gpt-1.3b whole in bf16-mixed with room to spare (the speed rows' planner puts
# batch 8 of llama-3.2-1b at 72 GiB in bf16-true); every GEMM dimension is then a multiple of 16. The offload row's
# model (~135 M parameters) makes the host's AdamW step the visible cost it is at scale.
GPU = Sizes("cuda", hidden=512, layers=4, heads=8, seq=512, batch=8, steps=6,
            speed_models=(("gpt-1.3b", "gpt-1.3b"), ("llama-3.2-1b", "llama-3.2-1b")), speed_seq=2048,
            speed_warmup=2, speed_steps=6, speed_batches=(16, 8, 4, 2, 1),
            fp8_batch=4, fp8_warmup=2, fp8_steps=5, fp8_linear=(8192, 4096, 4096), fp8_linear_steps=(5, 20),
            offload_model=(1024, 8, 16, 1024, 8, 32000), offload_steps=(2, 4), sft=(512, 8, 6),
            attention=(2, 16, 4, 4096, 128, 1024))
CPU = Sizes("cpu", hidden=32, layers=2, heads=4, seq=32, batch=4, steps=4,
            speed_models=(("gpt-1.3b", "gpt-tiny"), ("llama-3.2-1b", "llama-tiny")), speed_seq=64,
            speed_warmup=1, speed_steps=2, speed_batches=(2,),
            fp8_batch=2, fp8_warmup=1, fp8_steps=2, fp8_linear=(64, 64, 64), fp8_linear_steps=(1, 2),
            offload_model=(32, 2, 4, 32, 4, 257), offload_steps=(1, 2), sft=(128, 2, 3),
            attention=(1, 4, 2, 64, 16, 16),
            vocab={"gpt": 257, "llama": 512, "moe": 512})

MODELS = ("gpt", "llama")


def sizes_for(cpu: bool) -> Sizes:
    return CPU if cpu else GPU


# ---------------------------------------------------------------------------- rows
@dataclass(frozen=True)
class Row:
    """One line of the table: ``kind`` names the worker function, ``options`` its arguments."""

    family: str
    name: str
    kind: str
    budget_s: float
    options: dict = field(default_factory=dict)
    group: str = "main"  # rows of a group share a worker process, in order

    @property
    def key(self) -> str:
        return f"{self.family}/{self.name}"


# Row name -> how it differs from the reference: strategy arguments, precision, or a resumed run / generation after.
FEATURES: dict[str, dict] = {
    "reference fp32 z0": {},
    "zero1": {"strategy": {"zero_stage": 1}},
    "zero2": {"strategy": {"zero_stage": 2}},
    "zero3": {"strategy": {"zero_stage": 3}},
    "bf16-true": {"precision": "bf16-true"},
    "bf16-mixed": {"precision": "bf16-mixed"},
    "16-true": {"precision": "16-true"},
    "ac full": {"strategy": {"activation_checkpointing": "full"}},
    "ac selective": {"strategy": {"activation_checkpointing": "selective"}},
    "sequence_parallel": {"strategy": {"sequence_parallel": True}},
    # The 'nvme' tier (its files under the row's work folder; fp32 gradients copied to the host and through a file
    # under bf16) and ZeRO-3's parameters in host memory, each against the same fp32 reference.
    "offload_optimizer nvme": {"strategy": {"offload_optimizer": "nvme", "offload_path": "{work}/offload"}},
    "bf16-true offload nvme": {"precision": "bf16-true",
                               "strategy": {"offload_optimizer": "nvme", "offload_path": "{work}/offload"}},
    "zero3 offload_parameters cpu": {"strategy": {"zero_stage": 3, "offload_parameters": "cpu"}},
    "checkpoint save+resume": {"resume": True},
    "generation": {"generate": True},
}


# The Llama-shaped model's features: what its pieces (RMSNorm, rotary, SwiGLU, GQA) change; the GPT runs them all.
LLAMA_FEATURES = ("reference fp32 z0", "bf16-mixed", "generation")
# The two-rank rows: one torchrun launch of 2 processes on the one device (gloo: NCCL refuses two ranks on one GPU)
# runs the collectives, then each layout's Trainer.fit, in this order. Layout name -> Megatron3DStrategy arguments.
# Both context-parallel variants: torch's backend table lists no send/recv for gloo with CUDA tensors, which the
# ring needs; the all-gather variant needs only all_gather. The ring goes last: a hang there stops no other layout.
TWO_RANK_LAYOUTS: dict[str, dict] = {
    "tp2": {"tensor_parallel_size": 2},
    "dp2 zero1": {"data_parallel_size": 2, "zero_stage": 1},
    "cp2 all-gather": {"context_parallel_size": 2, "context_parallel_attention": "all_gather"},
    "cp2 ring": {"context_parallel_size": 2, "context_parallel_attention": "ring"},
}
TWO_RANK_COLLECTIVES = "gloo collectives"


def plan_rows(cpu: bool) -> list[Row]:
    sizes = sizes_for(cpu)
    rows = [Row("features", f"{model} {name}", "feature", 25, {"model": model, "feature": name})
            for model in MODELS for name in (FEATURES if model == "gpt" else LLAMA_FEATURES)]
    rows.append(Row("features", "moe (mixtral-tiny, ep=1)", "feature", 25, {"model": "moe", "feature": "reference fp32 z0"}))
    rows += [Row("sdpa", f"{model} kernel profiled", "kernel_profiled", 20, {"model": model}) for model in MODELS]
    # Flex compiles its forward and backward on the first call of each shape and mask kind: tens of seconds.
    rows += [Row("attention", case, "attention", 90 if documents or window else 30, {"case": case})
             for case, (_, documents, window) in ATTENTION_CASES.items()]
    rows.append(Row("offload", "gpt cpu vs none", "offload", 60))
    rows.append(Row("sft", "gpt lora packed", "lora_sft", 60))
    # The first of these rows to run launches the two processes for all of them; the others read what it wrote.
    rows += [Row("2 ranks", name, "two_ranks", 120, {"name": name})
             for name in [TWO_RANK_COLLECTIVES, *TWO_RANK_LAYOUTS]]
    # A process each: clean memory peaks, and the planner needs a process without a default process group.
    rows += [Row("speed", label, "speed", 100, {"label": label, "preset": preset}, group=f"speed {label}")
             for label, preset in sizes.speed_models]
    # Last, in one process: should they overrun, the global cap skips them and nothing before them. Per subject a
    # bf16 row, then one per recipe holding its key (``baseline``), for ``compare_to_baseline``.
    subjects = [("linear", "fp8_linear", 30, {})]
    subjects += [(label, "fp8_speed", 60, {"preset": preset}) for label, preset in sizes.speed_models[:1]]
    for subject, kind, budget, options in subjects:
        base = Row("fp8", f"{subject} {FP8_BASELINE}", kind, budget, {**options, "fp8": None}, group="fp8")
        rows += [base] + [Row("fp8", f"{subject} fp8 {recipe}", kind, budget,
                              {**options, "fp8": recipe, "baseline": base.key}, group="fp8") for recipe in FP8_RECIPES]
    return rows


# ---------------------------------------------------------------------------- shared pieces of the workers
def device_for(sizes: Sizes):
    import torch

    return torch.device("cuda", 0) if sizes.device == "cuda" else torch.device("cpu")


def model_args(sizes: Sizes, model: str) -> argparse.Namespace:
    """``throughput.py``'s arguments for this mode's small model (its ``run_plain`` is the tests' reference)."""
    return argparse.Namespace(model=model, hidden=sizes.hidden, layers=sizes.layers, heads=sizes.heads, seq=sizes.seq,
                              batch=sizes.batch, vocab=sizes.vocab.get(model), query_groups=None, ffn=None,
                              steps=sizes.steps, warmup=0, seed=1234, precision="32-true", clock="wall", pad_vocab=128,
                              clip_grad=None)


def gpt_config(args: argparse.Namespace):
    """The feature rows' model: throughput's GPT or Llama-shaped config, or ``mixtral-tiny`` resized alike."""
    from lightning_megatron.models import GPTConfig

    if args.model == "moe":
        return GPTConfig.from_name("mixtral-tiny", vocab_size=args.vocab or 512, max_seq_length=args.seq,
                                   hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                                   num_query_groups=max(1, args.heads // 2), ffn_hidden_size=args.hidden * 11 // 4)
    return training.gpt_config(args)


def loader(args: argparse.Namespace, ranks: int = 1, rank: int = 0):
    """The run's fixed batches (``harness.training.make_loader``'s data and order) in the project's ``ResumableDataLoader``:
    a run resumed from a mid-run checkpoint goes on at the next batch, as ``GPTDataModule``'s loaders do. ``rank``'s
    share of ``ranks`` data-parallel ranks: every global batch holds the same samples as with one rank."""
    from lightning_megatron.data.resumable import ResumableDataLoader, data_parallel_sampler

    dataset = SyntheticTokens(args.steps * args.batch, args.seq, gpt_config(args).vocab_size, args.seed)
    sampler = data_parallel_sampler(dataset, num_replicas=ranks, rank=rank, shuffle=False, seed=args.seed)
    return ResumableDataLoader(dataset, batch_size=args.batch // ranks, sampler=sampler, drop_last=True)


class Losses(L.Callback):
    """Every step's training loss."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(outputs["loss"]))


def fit(args: argparse.Namespace, sizes: Sizes, root: Path, *, strategy: Optional[dict] = None,
        precision: str = "32-true", max_steps: Optional[int] = None, ckpt_path: Optional[str] = None,
        seed: Optional[int] = None, checkpoint_dir: Optional[Path] = None, ranks: int = 1, dp_rank: int = 0):
    """``Trainer.fit`` of a fresh ``GPT`` under ``Megatron3DStrategy(**strategy)`` for ``max_steps`` (default: all the
    run's batches); the module, the trainer and the step losses. ``checkpoint_dir``: a ``ModelCheckpoint`` saves there
    at the last step, during the fit as a training run does (the loader's position is in it; ``trainer.save_checkpoint``
    after ``fit`` returns no longer has the loader to ask). ``ranks``: processes sharing this mode's one device (the
    caller runs under torchrun and has joined a gloo group: NCCL refuses two ranks on one GPU); ``dp_rank``: this
    process's data-parallel rank when the strategy splits the batch."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_megatron import Megatron3DStrategy
    from lightning_megatron.models import GPT

    L.seed_everything(args.seed if seed is None else seed, verbose=False)
    module = GPT(gpt_config(args), warmup_steps=args.steps)  # the learning rate rises over the whole run
    losses, steps = Losses(), max_steps or args.steps
    saver = [ModelCheckpoint(dirpath=checkpoint_dir, every_n_train_steps=steps, save_top_k=-1)] if checkpoint_dir else []
    shared = {"parallel_devices": [device_for(sizes)] * ranks, "process_group_backend": "gloo"} if ranks > 1 else {}
    data_parallel = (strategy or {}).get("data_parallel_size", 1)
    trainer = L.Trainer(strategy=Megatron3DStrategy(**(strategy or {}), **shared), accelerator=sizes.device, devices=1,
                        precision=precision, max_steps=steps, callbacks=[losses, *saver], logger=False,
                        enable_checkpointing=bool(saver), enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=str(root))
    trainer.fit(module, loader(args, data_parallel, dp_rank), ckpt_path=ckpt_path)
    return module, trainer, losses.values


# ---------------------------------------------------------------------------- family 1: features
def feature_row(row: Row, sizes: Sizes, work: Path, memo: dict) -> dict:
    """One feature through the strategy; its last loss against the same model's fp32 reference (run once, kept)."""
    model, feature = row.options["model"], row.options["feature"]
    spec, args = FEATURES[feature], model_args(sizes, model)
    precision = spec.get("precision", "32-true")
    if spec.get("resume"):
        half = args.steps // 2
        fit(args, sizes, work / "first", max_steps=half, checkpoint_dir=work / "checkpoints")
        path = next((work / "checkpoints").iterdir())
        # Other initial weights: what the resumed run trains must come from the checkpoint.
        _, _, losses = fit(args, sizes, work / "resumed", ckpt_path=str(path), seed=args.seed + 1)
        result = {"detail": f"saved after {half} steps ({_checkpoint_kind(path)}), resumed for {args.steps - half}"}
    else:
        try:
            strategy = {key: value.format(work=work) if key == "offload_path" else value
                        for key, value in spec.get("strategy", {}).items()}
            module, _, losses = fit(args, sizes, work, strategy=strategy, precision=precision)
        except ValueError as error:
            if spec.get("strategy", {}).get("sequence_parallel"):  # refused at tp=1 with the reason: not applicable
                return {"status": "n/a", "detail": last_line(error)}
            raise
        result = {"detail": ""}
        if spec.get("generate"):
            return {**result, **generation_check(module.model, args, device_for(sizes)), "loss": losses[-1]}
    result["loss"] = losses[-1]
    if feature == "reference fp32 z0":
        memo[model] = losses[-1]
        return {**result, "status": "passed", "detail": f"{len(losses)} steps"}
    reference = memo.get(model)
    if reference is None:
        return {**result, "status": "passed", "detail": (result["detail"] + "; no reference loss").lstrip("; ")}
    tolerance = SIXTEEN_BIT_TOLERANCE if precision != "32-true" else FP32_TOLERANCE
    diff = losses[-1] - reference
    passed = abs(diff) <= tolerance
    note = f"|diff| {'<=' if passed else '>'} {tolerance:g}"
    return {**result, "vs ref": diff, "status": "passed" if passed else "failed",
            "detail": "; ".join(filter(None, [result["detail"], note]))}


def _checkpoint_kind(path: Path) -> str:
    return "sharded directory" if path.is_dir() else "one file"


def generation_check(model, args: argparse.Namespace, device) -> dict:
    """Greedy tokens from ``generate`` (KV cache) against an argmax loop recomputing the whole sequence each time."""
    import torch

    from lightning_megatron.generation import generate

    model.eval()
    prompts = torch.randint(gpt_config(args).vocab_size, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    new = 8
    with torch.no_grad():
        cached = generate(model, prompts, max_new_tokens=new)
        tokens = prompts
        for _ in range(new):
            tokens = torch.cat([tokens, model(tokens)[:, -1, : gpt_config(args).vocab_size].argmax(-1, keepdim=True)], 1)
    same = torch.equal(cached, tokens)
    return {"status": "passed" if same else "failed",
            "detail": f"{new} greedy tokens x 2 prompts {'==' if same else '!='} full recompute"}


# ---------------------------------------------------------------------------- family 3: sdpa
def small_model(sizes: Sizes, model: str):
    """This mode's small model on the device, eval mode, in bf16 on CUDA (flash has no fp32 kernel)."""
    import torch

    from lightning_megatron.models.gpt import GPTModel

    device = device_for(sizes)
    args = model_args(sizes, model)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    net = GPTModel(gpt_config(args)).to(device=device, dtype=dtype)
    ids = torch.randint(gpt_config(args).vocab_size, (2, args.seq), device=device)
    return net, ids


FUSED_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward")
MATH_OP = "_scaled_dot_product_attention_math"
KERNEL_WORDS = ("flash", "fmha", "cudnn", "attention", "sdpa")  # in the CUDA kernels' names


def kernel_profiled_row(row: Row, sizes: Sizes, work: Path, memo: dict) -> dict:
    """What one forward of our attention runs, from the profiler: SDPA's backend op (flash, cuDNN or efficient,
    not the math fallback) and, on CUDA, the kernel it launched."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    net, ids = small_model(sizes, row.options["model"])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.is_cuda else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        net(ids)
        if ids.is_cuda:
            torch.cuda.synchronize()
    names = {event.key for event in prof.key_averages()}
    fused = sorted(n for n in names if any(op in n for op in FUSED_OPS))
    math = sorted(n for n in names if MATH_OP in n)
    kernels = sorted(n for n in names if not n.startswith("aten::") and any(w in n.lower() for w in KERNEL_WORDS))
    passed = bool(fused) and not math and (bool(kernels) or not ids.is_cuda)
    shown = [*fused[:1], *math[:1], *[_short(k, 50) for k in kernels[:1]]]
    return {"status": "passed" if passed else "failed", "detail": "; ".join(shown) or "no attention op in the profile"}


def _short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


# ---------------------------------------------------------------------------- family 3b: the attention back ends
# Case -> (key/value heads: all or the GQA share, document ids, sliding window). Unpacked causal attention is SDPA's
# (``CoreAttention``: flash, cuDNN or efficient kernels); packed documents and sliding windows go through the
# document back end (``context_parallel.kernels.backend_for``: compiled FlexAttention on CUDA, the fused CPU kernel
# tile by tile on CPU), as packed SFT and context parallelism do.
ATTENTION_CASES: dict[str, tuple[bool, bool, bool]] = {
    "causal": (False, False, False),
    "gqa causal": (True, False, False),
    "packed documents": (False, True, False),
    "sliding window gqa": (True, False, True),
}
# ||kernel - fp32 dense|| / ||fp32 dense|| of the output and of each input gradient: bf16 rounding (2^-8 a value)
# averages down to ~3e-3 over a tensor; a wrong mask moves whole rows and lands far above.
ATTENTION_TOLERANCE = {"cuda": 2e-2, "cpu": 1e-5}
# A back end that never builds an [S, S] tensor adds far less than one fp32 [B, H, S, S] score tensor to the peak.
SCORES_FRACTION = 0.25
SDPA_KERNEL_WORDS = ("flash", "fmha", "cudnn", "efficient")  # SDPA's fused CUDA kernels (not its math fallback)
FLEX_KERNEL_PREFIX = "triton_tem_fused"  # Inductor's template kernels: Flex's forward and backward
DENSE_OPS = ("aten::bmm", "aten::baddbmm", "aten::_softmax")  # eager Flex (or any dense attention) runs these
CPU_FUSED_OP = "_scaled_dot_product_flash_attention_for_cpu"  # the CPU kernel, forward and backward


def attention_inputs(sizes: Sizes, case: str, device):
    """``q`` [B, H, S, D], ``k``/``v`` [B, G, S, D] (G = H but for GQA) needing gradients (bf16 on CUDA: flash has no
    fp32 kernel), the document ids [B, S] of packed samples (5 documents of uneven lengths a sample, cut at other
    places in each) or None, and the window or None."""
    import torch

    batch, heads, kv_heads, seq, head_dim, window = sizes.attention
    gqa, documents, windowed = ATTENTION_CASES[case]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, h, seq, head_dim, generator=generator).to(device, dtype).requires_grad_()
               for h in (heads, kv_heads if gqa else heads, kv_heads if gqa else heads))
    ids = None
    if documents:
        cuts = torch.stack([torch.randperm(seq - 1, generator=generator)[:4].sort().values + 1 for _ in range(batch)])
        ids = (torch.arange(seq)[None, :, None] >= cuts[:, None, :]).sum(-1).to(device)
    return q, k, v, ids, window if windowed else None


def project_attention(q, k, v, ids, window):
    """What a model layer runs for these inputs: ``CoreAttention`` (SDPA) for unpacked causal attention, the document
    back end (``document_attention``) for packed samples and sliding windows (one document when unpacked)."""
    import torch

    from lightning_megatron.context_parallel import DocumentMask, document_attention
    from lightning_megatron.models.attention import CoreAttention

    if ids is None and window is None:
        return CoreAttention(attention_dropout=0.0, causal=True)(q, k, v)
    if ids is None:
        ids = torch.zeros(q.shape[0], q.shape[2], dtype=torch.long, device=q.device)
    return document_attention(q, k, v, DocumentMask(ids), causal=True, window=window)


def dense_keep(seq: int, ids, window, device):
    """The dense reference's booleans [B or 1, 1, S, S] (True = attend): causal, same document, inside the window.
    Written here, apart from the project's mask code (``context_parallel.masks``), so that it checks it."""
    import torch

    pos = torch.arange(seq, device=device)
    keep = (pos[:, None] >= pos[None, :])[None, None]
    if window is not None:
        keep = keep & (pos[:, None] - pos[None, :] < window)
    if ids is not None:
        keep = keep & (ids[:, None, :, None] == ids[:, None, None, :])
    return keep


def dense_attention(q, k, v, keep):
    """Softmax attention written out in fp32 over the explicit mask: the reference nobody optimised."""
    import torch

    groups = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(groups, dim=1) for t in (k, v))
    scores = (q.float() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v


def relative_error(value, reference) -> float:
    return float((value.float() - reference).norm() / reference.norm().clamp_min(1e-30))


def profiled(run: Callable[[], Any], device) -> tuple[Any, dict[str, int]]:
    """``run()`` under the profiler (CUDA kernels too on CUDA); its result and the calls of every op and kernel."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        result = run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    return result, {event.key: event.count for event in prof.key_averages()}


def attention_kernels(names: dict[str, int], device, flex: bool) -> tuple[list[str], list[str]]:
    """The fused attention kernels among a profile's ``names`` (CUDA: SDPA's flash/cuDNN/efficient kernels, or
    Inductor's Flex templates; CPU: the fused CPU op), and the ones that say it fell back (SDPA's math op; for
    Flex on CUDA also the dense matmuls and softmax of its eager path)."""
    if device.type != "cuda":
        fused = [n for n in names if CPU_FUSED_OP in n]
    elif flex:
        fused = [n for n in names if n.startswith(FLEX_KERNEL_PREFIX)]
    else:
        fused = [n for n in names if not n.startswith("aten::") and any(w in n.lower() for w in SDPA_KERNEL_WORDS)]
    fallback = [n for n in names if MATH_OP in n or (flex and device.type == "cuda" and n in DENSE_OPS)]
    return sorted(fused), sorted(fallback)


def calls(names: dict[str, int], chosen: list[str]) -> int:
    return sum(names[name] for name in chosen)


def attention_row(row: Row, sizes: Sizes, work: Path, memo: dict) -> dict:
    """One of ``ATTENTION_CASES`` through ``project_attention``, forward and backward, against ``dense_attention`` in
    fp32 on the same inputs (relative errors of the output and the three gradients). The forward and the backward
    are profiled apart, and each must have run a fused kernel (counted: at least one each) and no fallback (SDPA's
    math, or eager Flex's dense matmuls). On CUDA the call's peak memory must also stay below a quarter of one fp32
    [B, H, S, S] score tensor: what a fallback builds, whatever its kernels are named. The first call (which
    compiles Flex) is a warmup."""
    import torch

    from lightning_megatron.context_parallel.kernels import backend_for

    device = device_for(sizes)
    case = row.options["case"]
    q, k, v, ids, window = attention_inputs(sizes, case, device)
    flex = ids is not None or window is not None
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(device, q.dtype)
    project_attention(q, k, v, ids, window).backward(grad)
    for t in (q, k, v):
        t.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    out, forward = profiled(lambda: project_attention(q, k, v, ids, window), device)
    _, backward = profiled(lambda: out.backward(grad), device)
    grown = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
    got = (out.detach(), q.grad, k.grad, v.grad)
    q_ref, k_ref, v_ref = (t.detach().float().requires_grad_() for t in (q, k, v))
    reference = dense_attention(q_ref, k_ref, v_ref, dense_keep(q.shape[2], ids, window, device))
    reference.backward(grad.float())
    errors = [relative_error(a, b) for a, b in zip(got, (reference.detach(), q_ref.grad, k_ref.grad, v_ref.grad))]
    (fused_f, fallback_f), (fused_b, fallback_b) = (attention_kernels(n, device, flex) for n in (forward, backward))
    scores_bytes = 4 * q.shape[0] * q.shape[1] * q.shape[2] ** 2
    checks = {"matches dense": max(errors) <= ATTENTION_TOLERANCE[device.type],
              "fused forward": calls(forward, fused_f) >= 1, "fused backward": calls(backward, fused_b) >= 1,
              "no fallback": not fallback_f + fallback_b,
              "no [S, S] scores": grown is None or grown < SCORES_FRACTION * scores_bytes}
    failed = [name for name, ok in checks.items() if not ok]
    backend = type(backend_for(device)).__name__ if flex else "SDPA"
    memory = "" if grown is None else f"; peak +{grown / 2**20:.0f} MiB (fp32 scores: {scores_bytes / 2**20:.0f})"
    return {"status": "failed" if failed else "passed",
            "detail": f"{'failed: ' + ', '.join(failed) + '; ' if failed else ''}{backend}: fused kernel calls "
                      f"{calls(forward, fused_f)} forward, {calls(backward, fused_b)} backward "
                      f"({_short((fused_f + fused_b + [''])[0], 40)})"
                      f"{'; FALLBACK ' + ', '.join(fallback_f + fallback_b) if fallback_f + fallback_b else ''}; "
                      f"rel err out/dq/dk/dv {'/'.join(f'{e:.0e}' for e in errors)}{memory}; q "
                      f"{'x'.join(map(str, q.shape))}, {k.shape[1]} kv heads"
                      f"{f', window {window}' if window else ''}{', 5 documents a sample' if ids is not None else ''}"}


# ---------------------------------------------------------------------------- family 2 + 4: speed and memory
def hardware_of(device):
    """The ``plan/hardware.py`` preset of the device (``NVIDIA H200`` -> ``h200``: ``preset_for_device``), or None."""
    import torch

    from lightning_megatron.plan import GPUS
    from lightning_megatron.plan.hardware import preset_for_device

    if device.type != "cuda":
        return None
    key = preset_for_device(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory)
    return None if key is None else GPUS[key]


def speed_row(row: Row, sizes: Sizes, work: Path, memo: dict) -> dict:
    """``gpt-1.3b`` / ``llama-3.2-1b`` through the strategy at tp=1, bf16-true: tokens/s, TFLOP/s, MFU, and the peak
    allocated memory against the planner's model states + activations for the same layout and batch.

    The batch: the largest of ``sizes.speed_batches`` the planner predicts to fit in 80% of the device (its buffer
    allowance included); should that run out of memory after all, the next smaller one, and the detail says so."""
    import torch

    from lightning_megatron.models import GPT, GPTConfig
    from lightning_megatron.plan import GPUS, Planner, Workload
    from lightning_megatron.plan.model_state import gpu_bytes

    device = device_for(sizes)
    config = GPTConfig.from_name(row.options["preset"], max_seq_length=sizes.speed_seq)
    hardware = hardware_of(device)
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    predictions: dict[int, int] = {}  # before any fit: the planner needs a process without a default process group
    for batch in sizes.speed_batches:
        planner = Planner(lambda: GPT(config), Workload(batch, sizes.speed_seq, SPEED_PRECISION),
                          hardware or GPUS["h200"], world_size=1)
        layout = planner.with_layout(micro_batch_size=batch)
        rank = planner.rank_memory(layout)[0]
        if capacity is None or rank.total <= FIT_FRACTION * capacity:
            predictions[batch] = gpu_bytes(rank.model_state_bytes, layout) + rank.activation_bytes
    if not predictions:
        return {"status": "failed", "detail": f"the planner predicts no batch of {sizes.speed_batches} fits"}
    notes = []
    for batch, predicted in predictions.items():
        try:
            result, detail, module = timed_fit(config, batch, sizes.speed_seq, sizes, device, hardware, work,
                                               precision=SPEED_PRECISION, warmup=sizes.speed_warmup,
                                               steps=sizes.speed_steps)
        except torch.cuda.OutOfMemoryError:
            notes.append(f"batch {batch} ran out of memory (planned {predicted / GIB:.1f} GiB)")
        else:
            del module  # the plain run below needs the memory
            result["planned GiB"] = predicted / GIB
            if "peak GiB" in result:
                result["mem ratio"] = result["peak GiB"] / result["planned GiB"]
            else:
                detail.append("CPU: no allocator peak to compare (the planner's prediction shown)")
            _leave_process_group()
            _free_cuda()
            plain = plain_tokens_per_s(config, batch, sizes, device)
            result["vs plain"] = result["tokens/s"] / plain
            detail.insert(1, f"plain PyTorch loop {plain:,.0f} tokens/s")
            return {**result, "detail": "; ".join([*detail[:1], *notes, *detail[1:]])}
        _leave_process_group()  # here, once the exception (and the frames holding the tensors) is gone
        _free_cuda()
    return {"status": "failed", "detail": "; ".join(notes)}


def plain_tokens_per_s(config, batch: int, sizes: Sizes, device) -> float:
    """The same model, seed, batches, AdamW and schedule in the loop a PyTorch user writes (``throughput.run_plain``:
    weights in bf16 as ``bf16-true`` keeps them, no strategy, no Lightning): tokens/s, timed as the strategy's run
    (CUDA events, median of ``speed_steps`` after ``speed_warmup``)."""
    import statistics

    from lightning_megatron.models import GPT

    from benchmarks import throughput

    args = argparse.Namespace(model="gpt", hidden=config.hidden_size, layers=config.num_layers, heads=config.num_heads,
                              seq=sizes.speed_seq, batch=batch, vocab=config.vocab_size, warmup=sizes.speed_warmup,
                              steps=sizes.speed_steps, seed=1234, precision=SPEED_PRECISION, clock="wall",
                              clip_grad=None)
    L.seed_everything(args.seed, verbose=False)
    module = GPT(config, warmup_steps=sizes.speed_warmup + sizes.speed_steps)
    seconds, _, _ = throughput.run_plain(args, device, module)
    del module
    _free_cuda()
    return batch * sizes.speed_seq / statistics.median(seconds)


SPEED_PRECISION = "bf16-true"  # what configs/gpt-1.3b.yaml and configs/llama-3.2-1b.yaml train in
FIT_FRACTION = 0.8  # of the device's memory a speed run's predicted total may take: room for the planner's error


def _free_cuda() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed_fit(config, batch: int, seq: int, sizes: Sizes, device, hardware, work: Path, *, precision: str,
              warmup: int, steps: int, strategy: Optional[dict] = None,
              callbacks: tuple = ()) -> tuple[dict, list[str], Any]:
    """One timed run: ``warmup`` + ``steps`` steps of ``Trainer.fit`` under ``Megatron3DStrategy(**strategy)`` at
    ``batch`` x ``seq``, timed by CUDA events at the batch hooks. Returns the row's measured columns, the first parts
    of its detail, and the trained ``GPT``."""
    import statistics

    import torch
    from torch.utils.data import DataLoader

    from lightning_megatron import Megatron3DStrategy
    from lightning_megatron.models import GPT
    from lightning_megatron.models.flops import gpt_flops_per_batch

    data = SyntheticTokens((warmup + steps) * batch, seq, config.vocab_size, seed=1234)
    _free_cuda()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    L.seed_everything(1234, verbose=False)
    stopwatch = StopwatchCallback(Stopwatch(warmup, steps, device))
    trainer = L.Trainer(strategy=Megatron3DStrategy(**(strategy or {})), accelerator=sizes.device, devices=1,
                        precision=precision, max_steps=warmup + steps, callbacks=[stopwatch, *callbacks], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(work))
    module = GPT(config, warmup_steps=warmup + steps)
    trainer.fit(module, DataLoader(data, batch_size=batch, shuffle=False))
    seconds = statistics.median(stopwatch.stopwatch.step_seconds())
    tflops = gpt_flops_per_batch(config, batch, seq) / seconds / 1e12
    detail = [f"batch {batch} x seq {seq}, {precision}, median of {steps} steps after {warmup}"]
    result = {"status": "passed", "loss": stopwatch.last_loss.item(), "tokens/s": batch * seq / seconds,
              "TFLOP/s": tflops, **mfu(tflops, hardware, device, detail)}
    if device.type == "cuda":
        result["peak GiB"] = (torch.cuda.max_memory_allocated(device) - baseline) / GIB
    return result, detail, module


def mfu(tflops: float, hardware, device, detail: list[str]) -> dict:
    """``{"MFU": ...}`` against the device's dense bf16 peak (its preset's), and a note in ``detail`` saying which."""
    import torch

    if hardware is not None:
        detail.append(f"MFU of {hardware.peak(True) / 1e12:.0f} TFLOP/s ({hardware.name})")
        return {"MFU": tflops * 1e12 / hardware.peak(True)}
    if device.type == "cuda":
        detail.append(f"no preset for {torch.cuda.get_device_name(device)!r}: no MFU")
    return {}


# ---------------------------------------------------------------------------- family 5: fp8 against bf16
FP8_BASELINE = "bf16-mixed"  # the fp8 rows' precision too: fp32 master weights, GEMMs in bf16 or in fp8
FP8_RECIPES = ("tensorwise", "rowwise")  # Megatron3DStrategy(fp8=...)
FP8_LOSS_TOLERANCE = 0.1  # |fp8 - bf16| last loss, a few steps from the same init: a wrong scale moves it further


def scaled_mm_counter():
    """A dispatch mode counting ``aten._scaled_mm`` calls (``.calls``): what FP8 GEMMs actually ran, backward
    included (autograd carries the mode into its threads)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class ScaledMmCounter(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._scaled_mm.default:
                self.calls += 1
            return func(*args, **(kwargs or {}))

    return ScaledMmCounter()


class CountFirstStep(L.Callback):
    """Counts the ``_scaled_mm`` calls of the first training step (a warmup step: the timed ones run without the mode)."""

    def __init__(self) -> None:
        self.counter = scaled_mm_counter()
        self.active = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx == 0:
            self.counter.__enter__()
            self.active = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._leave()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._leave()  # the next row of this process must not run under the mode

    def _leave(self) -> None:
        if self.active:
            self.active = False
            self.counter.__exit__(None, None, None)


def fp8_evidence(fp8: Optional[str], linears: list, calls: int, per_pass: str) -> tuple[bool, str]:
    """Whether FP8 ran exactly where asked: ``linears`` (the parallel linears) with ``gemms.fp8`` set, none without
    ``fp8``, and 3 ``_scaled_mm`` calls (forward, input and weight gradients) per FP8 linear in ``calls``."""
    converted = sum(layer.gemms.fp8 for layer in linears)
    expected = 3 * converted
    ok = calls == expected and (converted > 0) == (fp8 is not None)
    return ok, (f"fp8 {fp8 or 'off'}: {converted} of {len(linears)} linears converted, {calls} _scaled_mm calls "
                f"{per_pass} (expected {expected})")


def fp8_speed_row(row: Row, sizes: Sizes, work: Path, memo: dict) -> dict:
    """A preset whole through ``Megatron3DStrategy(fp8=row.options["fp8"])`` in bf16-mixed at batch
    ``sizes.fp8_batch``: tokens/s, model TFLOP/s (the same model FLOPs whatever the GEMMs' precision), MFU against
    the bf16 peak; the parent adds the ratio to the model's bf16 row. Fails unless FP8 ran where asked only."""
    from lightning_megatron.models import GPTConfig
    from lightning_megatron.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    device, fp8 = device_for(sizes), row.options["fp8"]
    config = GPTConfig.from_name(row.options["preset"], max_seq_length=sizes.speed_seq)
    first = CountFirstStep()
    result, detail, module = timed_fit(config, sizes.fp8_batch, sizes.speed_seq, sizes, device, hardware_of(device),
                                       work, precision=FP8_BASELINE, warmup=sizes.fp8_warmup, steps=sizes.fp8_steps,
                                       strategy={"fp8": fp8}, callbacks=(first,))
    linears = [m for m in module.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    ok, evidence = fp8_evidence(fp8, linears, first.counter.calls, "in step 0")
    return {**result, "status": "passed" if ok else "failed", "detail": "; ".join([evidence, *detail])}


def fp8_linear_row(row: Row, sizes: Sizes, work: Path, memo: dict) -> dict:
    """One ``ColumnParallelLinear`` (no group: whole) of ``sizes.fp8_linear`` under bf16 autocast, its GEMMs in bf16
    or FP8 (``Fp8Gemms`` of the recipe): the median time of a forward + backward pass (CUDA events), read as
    tokens/s and TFLOP/s of its three GEMMs (``6 T K N``); what the models' rows are made of, without the rest."""
    import statistics

    import torch

    from lightning_megatron.tensor_parallel.fp8 import Fp8Gemms, Fp8Recipe
    from lightning_megatron.tensor_parallel.layers import ColumnParallelLinear

    device, fp8 = device_for(sizes), row.options["fp8"]
    tokens, features_in, features_out = sizes.fp8_linear
    warmup, steps = sizes.fp8_linear_steps
    torch.manual_seed(0)
    layer = ColumnParallelLinear(features_in, features_out, bias=False, device=device)
    torch.nn.init.normal_(layer.weight, std=features_in ** -0.5)
    if fp8 is not None:
        layer.gemms = Fp8Gemms(Fp8Recipe.named(fp8), None, "output")
    x = torch.randn(tokens, features_in, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, features_out, device=device, dtype=torch.bfloat16)

    def step() -> None:
        x.grad = layer.weight.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = layer(x)
        y.backward(grad)

    counter = scaled_mm_counter()
    with counter:
        step()
    stopwatch = Stopwatch(warmup, steps, device)
    for index in range(warmup + steps):
        stopwatch.step_started(index)
        step()
        stopwatch.step_ended(index)
    seconds = statistics.median(stopwatch.step_seconds())
    tflops = 6 * tokens * features_in * features_out / seconds / 1e12
    detail = [f"{tokens} tokens x {features_in} -> {features_out}, bf16 autocast, forward + backward, median of "
              f"{steps} after {warmup}"]
    result = {"tokens/s": tokens / seconds, "TFLOP/s": tflops, **mfu(tflops, hardware_of(device), device, detail)}
    ok, evidence = fp8_evidence(fp8, [layer], counter.calls, "in one pass")
    return {**result, "status": "passed" if ok else "failed", "detail": "; ".join([evidence, *detail])}


def compare_to_baseline(records: dict[str, dict], rows: list[Row]) -> None:
    """Each fp8 row against its bf16 row of the same run: ``vs bf16`` (tokens/s ratio) and, for the models, ``vs ref``
    (last loss difference; beyond ``FP8_LOSS_TOLERANCE`` the row fails)."""
    for row in rows:
        record, base = records[row.key], records.get(row.options.get("baseline"), {})
        if "tokens/s" not in record or "tokens/s" not in base:
            continue
        record["vs bf16"] = record["tokens/s"] / base["tokens/s"]
        if "loss" in record and "loss" in base:
            record["vs ref"] = diff = record["loss"] - base["loss"]
            if not abs(diff) <= FP8_LOSS_TOLERANCE:
                record["status"] = "failed"
                record["detail"] = f"|loss - bf16 loss| > {FP8_LOSS_TOLERANCE:g}; {record['detail']}"


# ---------------------------------------------------------------------------- family 1b: two ranks on one device
def run_collective_checks(dist, rank: int, world: int, device, save: Callable[[dict], None]) -> dict[str, str]:
    """Each of ``collective_checks`` once: collective name -> "ok", "wrong values" or the error's last line.
    ``save(report)`` runs before each collective: a hang or an abort still leaves what came before."""
    import torch

    report: dict[str, str] = {}
    for name, check in collective_checks(dist, rank, world, device).items():
        report[name] = "hung (the row timed out in it)"
        save(report)
        try:
            report[name] = "ok" if check() else "wrong values"
            if device.type == "cuda":
                torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 - a refused collective is a finding, the next one still runs
            report[name] = last_line(error)
    return report


def collective_checks(dist, rank: int, world: int, device) -> dict[str, Callable[[], bool]]:
    """Each collective the strategy uses, on rank ``r``'s tensor of ``r + 1``s, returning whether the result is right."""
    import torch

    x = torch.full((world * 2,), float(rank + 1), device=device)
    total = float(sum(range(1, world + 1)))

    def all_reduce():
        out = x.clone()
        dist.all_reduce(out)
        return bool((out == total).all())

    def broadcast():
        out = x.clone()
        dist.broadcast(out, 0)
        return bool((out == 1).all())

    def all_gather():
        out = torch.empty(world * x.numel(), device=device)
        dist.all_gather_into_tensor(out, x)
        return bool((out.view(world, -1) == torch.arange(1, world + 1, device=device)[:, None]).all())

    def reduce_scatter():
        out = torch.empty(x.numel() // world, device=device)
        dist.reduce_scatter_tensor(out, x)
        return bool((out == total).all())

    def all_to_all():
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return bool((out.view(world, -1) == torch.arange(1, world + 1, device=device)[:, None]).all())

    def send_recv():
        if rank == 0:
            for peer in range(1, world):
                dist.send(x, peer)
            return True
        out = torch.empty_like(x)
        dist.recv(out, 0)
        return bool((out == 1).all())

    return {"all_reduce": all_reduce, "broadcast": broadcast, "all_gather_into_tensor": all_gather,
            "reduce_scatter_tensor": reduce_scatter, "all_to_all_single": all_to_all, "send/recv": send_recv}


def collectives_status(report: dict[str, str], backend: str, sizes: Sizes) -> dict:
    """A collectives report as a row: passed (all ok), refused (the backend raised: its limit, not our bug) or
    failed (a wrong result or a hang)."""
    ok = [name for name, value in report.items() if value == "ok"]
    refused = {name: value for name, value in report.items() if value != "ok"}
    where = "CUDA tensors" if sizes.device == "cuda" else "CPU tensors (smoke mode)"
    detail = f"{backend}, {where}; ok: {', '.join(ok) or 'none'}"
    if refused:
        first = next(iter(refused))
        detail += f"; refused: {', '.join(refused)} ({first}: {refused[first]})"
    broken = [name for name, value in refused.items() if value == "wrong values" or value.startswith("hung")]
    return {"status": "failed" if broken else "refused" if refused else "passed", "detail": detail}


# ---------------------------------------------------------------------------- family 6: optimizer offload
OFFLOAD_PRECISION = "bf16-mixed"  # fp32 main params and Adam state: on the device, or in host memory
# |loss with offload - loss without| at any step: the same AdamW math, but the host's (CPUAdamW) and the device's
# kernels round differently in fp32, and a flipped bf16 rounding of a weight moves the next loss by ~1e-4.
OFFLOAD_TOLERANCE = 1e-3


def offload_row(row: Row, sizes: Sizes, work: Path, memo: dict) -> dict:
    """One GPT (``sizes.offload_model``) trained twice from the same seed and batches: ``offload_optimizer="cpu"``
    (main params and AdamW state in host memory, the step on the host) against everything on the device. The step
    time ratio, and the losses of every step compared (``vs ref``: the largest difference)."""
    from lightning_megatron.models import GPTConfig

    hidden, layers, heads, seq, batch, vocab = sizes.offload_model
    warmup, steps = sizes.offload_steps
    config = GPTConfig(vocab_size=vocab, max_seq_length=seq, hidden_size=hidden, num_layers=layers, num_heads=heads)
    device = device_for(sizes)
    runs = {}
    for tier in ("none", "cpu"):
        losses = Losses()
        result, _, module = timed_fit(config, batch, seq, sizes, device, None, work / tier, precision=OFFLOAD_PRECISION,
                                      warmup=warmup, steps=steps, strategy={"offload_optimizer": tier},
                                      callbacks=(losses,))
        del module
        _leave_process_group()
        _free_cuda()
        runs[tier] = (result["tokens/s"], losses.values)
    (fast, reference), (slow, offloaded) = runs["none"], runs["cpu"]
    worst = max(abs(a - b) for a, b in zip(offloaded, reference))
    passed = worst <= OFFLOAD_TOLERANCE and len(offloaded) == len(reference) == warmup + steps
    step = batch * seq
    return {"status": "passed" if passed else "failed", "loss": offloaded[-1], "vs ref": worst, "tokens/s": slow,
            "detail": f"{config.num_parameters() / 1e6:.3g} M params, {OFFLOAD_PRECISION}, batch {batch} x seq {seq}: "
                      f"step {step / slow * 1e3:.1f} ms offloaded vs {step / fast * 1e3:.1f} ms on the device "
                      f"({fast / slow:.2f}x the time); {len(offloaded)} step losses, max |diff| "
                      f"{'<=' if passed else '>'} {OFFLOAD_TOLERANCE:g}"}


# ---------------------------------------------------------------------------- family 7: LoRA SFT, packed
SFT_LEARNING_RATE = 1e-2  # the adapters only, from B = 0: a few steps must move the loss
PACKED_TOLERANCE = {"cpu": 1e-5, "cuda": 2e-2}  # relative, packed vs one document at a time (fp32 / bf16 autocast)


def lora_sft_row(row: Row, sizes: Sizes, work: Path, memo: dict) -> dict:
    """Fine-tuning as users run it: ``GPT(lora=...)`` (only the adapters train) on ``SFTDataModule``'s built-in
    instruction set, packed (several conversations per sample, each attending only to itself), through the
    strategy for a few steps. Passes when every loss is finite, the last below the first, the base weights
    unchanged, and a packed batch's loss (document masks: the packed-attention kernel) equals the sum of its
    conversations' losses run one at a time (plain causal attention), the exact check packing allows."""
    import math

    import torch

    from lightning_megatron import Megatron3DStrategy
    from lightning_megatron.data import SFTDataModule
    from lightning_megatron.models import GPT

    seq, batch, steps = sizes.sft
    device = device_for(sizes)
    args = argparse.Namespace(**{**vars(model_args(sizes, "gpt")), "seq": seq})
    L.seed_everything(args.seed, verbose=False)
    module = GPT(gpt_config(args), lora={"rank": 8, "alpha": 16}, learning_rate=SFT_LEARNING_RATE, warmup_steps=1)
    data = SFTDataModule(seq_length=seq, global_batch_size=batch, packing=True, index_cache_dir=str(work / "cache"))
    losses, base = Losses(), BaseWeights()
    precision = "bf16-mixed" if device.type == "cuda" else "32-true"
    trainer = training.quiet_trainer(strategy=Megatron3DStrategy(), accelerator=sizes.device, devices=1,
                                     precision=precision, max_steps=steps, callbacks=[losses, base],
                                     limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=str(work))
    trainer.fit(module, datamodule=data)
    model = module.model
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    after = dict(model.named_parameters())
    base_moved = [name for name, value in base.values.items() if not torch.equal(after[name].detach(), value)]
    samples = [data.train_dataset[i] for i in range(batch)]  # the training batch's shape: no new kernel to compile
    packed, alone, documents = packed_against_alone(model, {key: torch.stack([s[key] for s in samples])
                                                             for key in samples[0]}, device)
    error = abs(packed - alone) / max(abs(alone), 1e-12)
    checks = {"finite": all(math.isfinite(v) for v in losses.values),
              "decreasing": losses.values[-1] < losses.values[0],
              "base frozen": bool(base.values) and not base_moved,
              "packed == alone": error <= PACKED_TOLERANCE[device.type]}
    failed = [name for name, ok in checks.items() if not ok]
    return {"status": "failed" if failed else "passed", "loss": losses.values[-1],
            "detail": f"{'failed: ' + ', '.join(failed) + '; ' if failed else ''}{steps} steps {precision}, losses "
                      f"{losses.values[0]:.3f} -> {losses.values[-1]:.3f}; {trained:,} trained params (LoRA r 8); "
                      f"packed batch of {documents} conversations: loss sum {packed:.4f} vs one at a time "
                      f"{alone:.4f} (rel {error:.1e})"}


class BaseWeights(L.Callback):
    """A copy of every base (non-adapter) parameter as training starts: the model exists only from ``setup`` on."""

    def __init__(self) -> None:
        self.values: dict = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.values = {name: p.detach().clone() for name, p in pl_module.model.named_parameters()
                       if "lora_" not in name}


def packed_against_alone(model, batch: dict, device) -> tuple[float, float, int]:
    """A packed batch's loss sum with its document masks, the sum of its documents' loss sums run alone (positions
    from 0, no masks), and how many documents had tokens to learn (bf16 autocast on CUDA: the kernels training ran)."""
    import torch

    model.eval()
    ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
    side = {key: batch[key].to(device) for key in ("position_ids", "document_ids")}
    spans = []
    for row, documents in enumerate(batch["document_ids"].tolist()):
        starts = [0] + [i for i in range(1, len(documents)) if documents[i] != documents[i - 1]]
        spans += [(row, a, b) for a, b in zip(starts, starts[1:] + [len(documents)])
                  if bool((batch["labels"][row, a:b] != -100).any())]
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        packed = float(model.loss(ids, labels, **side)[0])
        alone = sum(float(model.loss(ids[row, None, a:b], labels[row, None, a:b])[0]) for row, a, b in spans)
    return packed, alone, len(spans)


# ---------------------------------------------------------------------------- family 8: two ranks on one device
def two_ranks_row(row: Row, sizes: Sizes, work: Path, memo: dict) -> dict:
    """The real multi-rank training code on this mode's device: 2 processes (torchrun) share it over gloo, which
    takes CUDA tensors where NCCL refuses two ranks on one GPU. The first of these rows launches them for all;
    each process checks every collective, then trains the feature rows' GPT at each layout of
    ``TWO_RANK_LAYOUTS`` under ``check_collective_devices`` (a tensor off the device in any collective fails the
    layout) and ``count_host_syncs``. A layout passes when its last loss (the ranks' mean: dp and cp ranks each
    hold an equal share of the tokens) equals the single-process fp32 reference's (the features' reference row, or
    run here) to the fp32 tolerance."""
    if "two_ranks" not in memo:
        memo["two_ranks"] = launch_two_ranks(sizes, work, row.budget_s - 5)
    ranks = memo["two_ranks"]
    name = row.options["name"]
    if isinstance(ranks, str):  # the launch failed before writing anything
        return {"status": "failed", "detail": ranks}
    if name == TWO_RANK_COLLECTIVES:
        report = ranks[0].get("collectives")
        if report is None:
            return {"status": "failed", "detail": "the processes wrote no collectives report"}
        return collectives_status(report, "gloo", sizes)
    entries = [rank.get(name) for rank in ranks]
    if any(entry is None for entry in entries):
        return {"status": "failed", "detail": f"{name}: not reached (the processes died or timed out before it)"}
    errors = [entry["error"] for entry in entries if "error" in entry]
    if errors:
        return {"status": "failed", "detail": errors[0]}
    if "gpt" not in memo:
        memo["gpt"] = fit(model_args(sizes, "gpt"), sizes, work / "reference")[2][-1]
    losses = [sum(step) / len(step) for step in zip(*(entry["losses"] for entry in entries))]
    diff = losses[-1] - memo["gpt"]
    asked = layout_name(TWO_RANK_LAYOUTS[name])
    ran = entries[0]["layout"]
    passed = abs(diff) <= FP32_TOLERANCE and ran == asked
    syncs = entries[0]["syncs"]
    return {"status": "passed" if passed else "failed", "loss": losses[-1], "vs ref": diff,
            "detail": f"{'ran ' + ran + ', not ' + asked + '; ' if ran != asked else ''}"
                      f"{ran} on 2 ranks, {sizes.device} (gloo), {len(losses)} steps, every collective's tensors on "
                      f"{entries[0]['device']}; |diff| {'<=' if passed else '>'} {FP32_TOLERANCE:g}; "
                      f"rank 0's host syncs in the fit: {syncs['total']} ({syncs['top']})"}


LAYOUT_SIZES = {"tp": "tensor_parallel_size", "dp": "data_parallel_size", "cp": "context_parallel_size",
                "pp": "pipeline_parallel_size"}


def layout_name(sizes: dict) -> str:
    """``tp2 dp1 cp1 pp1``: the sizes a layout asks for (missing: 1), or a strategy's ``ParallelConfig`` ran with."""
    return " ".join(f"{short}{sizes.get(key, 1)}" for short, key in LAYOUT_SIZES.items())


def launch_two_ranks(sizes: Sizes, work: Path, timeout: float):
    """``torchrun --nproc-per-node=2`` of ``two_ranks_worker``; each rank's report, or why there is none."""
    out = work / "two_ranks"
    out.mkdir(parents=True, exist_ok=True)
    cmd = torchrun(2, __spec__.name, "--two-ranks-worker", "--out", str(out)) + ["--cpu"] * (sizes.device == "cpu")
    proc, timed_out = run_with_timeout(cmd, timeout, work)
    # The worker runs in its group's folder, whose logs the parent keeps: the ranks' whole output lands there.
    Path("two_ranks.log").write_text(f"{proc.stdout}\n{proc.stderr}")
    reports = [out / f"rank{rank}.json" for rank in range(2)]
    if not all(report.exists() for report in reports):
        return f"timed out after {timeout:.0f} s" if timed_out else tail_line(proc)
    return [json.loads(report.read_text()) for report in reports]


def stage_object_collectives_on(device) -> None:
    """Stage object collectives (``broadcast_object_list``, ``all_gather_object``: Lightning's and ours) in
    ``device``'s memory, as torch does under NCCL. Under gloo torch stages them in host memory, which
    ``check_collective_devices`` would flag although a NCCL run never hands those collectives a host tensor; gloo
    moves CUDA tensors itself."""
    import torch.distributed.distributed_c10d as c10d

    c10d._get_object_coll_device = lambda group=None: device.type


def two_ranks_worker(sizes: Sizes, out: Path) -> None:
    """Under torchrun, both ranks on this mode's device over gloo: the collectives, then each layout's fit; each rank
    rewrites ``rank{r}.json`` after every step of that, so a hang or a crash still leaves what came before."""
    import torch
    import torch.distributed as dist

    from lightning_megatron.parallel.guards import check_collective_devices, count_host_syncs

    rank = int(os.environ["RANK"])
    device = device_for(sizes)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # CUDA initialised on device 0: DeviceMesh would otherwise pick LOCAL_RANK's
    stage_object_collectives_on(device)  # on the CPU: where gloo stages them anyway
    dist.init_process_group("gloo")  # the strategy's fits find it and build their meshes over it
    report: dict[str, Any] = {}
    path = out / f"rank{rank}.json"

    def save() -> None:
        path.write_text(json.dumps(report))

    def progress(collectives: dict[str, str]) -> None:
        report["collectives"] = collectives
        save()

    report["collectives"] = run_collective_checks(dist, rank, dist.get_world_size(), device, progress)
    save()
    args = model_args(sizes, "gpt")
    for name, strategy in TWO_RANK_LAYOUTS.items():
        report[name] = {"error": "hung (the row timed out in it)"}
        save()
        try:
            with check_collective_devices(device), count_host_syncs(device if device.type == "cuda" else None) as syncs:
                _, trainer, losses = fit(args, sizes, out / name.replace(" ", "_"), strategy=strategy, ranks=2,
                                         dp_rank=rank if strategy.get("data_parallel_size", 1) > 1 else 0)
        except Exception as error:  # noqa: BLE001 - a failing layout is a finding; the next one still runs
            traceback.print_exc()
            report[name] = {"error": last_line(error)}
        else:
            top = ", ".join(f"{kind} {count}" for kind, count in syncs.by_kind.most_common(3))
            report[name] = {"losses": losses, "device": str(device), "syncs": {"total": syncs.total, "top": top},
                            "layout": layout_name(vars(trainer.strategy.parallel_config))}
        save()
    os._exit(0)  # skip gloo's C++ teardown: with several meshes alive it aborts at random (torch 2.13)


# ---------------------------------------------------------------------------- the worker process
WORKERS: dict[str, Callable[[Row, Sizes, Path, dict], dict]] = {
    "feature": feature_row,
    "kernel_profiled": kernel_profiled_row,
    "speed": speed_row,
    "fp8_speed": fp8_speed_row,
    "fp8_linear": fp8_linear_row,
    "offload": offload_row,
    "lora_sft": lora_sft_row,
    "two_ranks": two_ranks_row,
    "attention": attention_row,
}


def worker_main(rows: list[Row], sizes: Sizes, results: Path, memo: dict) -> None:
    """Run ``rows`` in order, appending ``{"start": key}`` before each and its result after it to ``results``.
    ``memo``: what rows leave for later ones (the reference losses), carried over from an earlier worker."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for index, row in enumerate(rows):
            print(f"{ROW_MARK}{row.key}", flush=True)  # the parent reads a dead worker's log from here
            _append(results, {"start": row.key})
            started = time.monotonic()
            try:
                result = WORKERS[row.kind](row, sizes, Path(tmp, str(index)), memo)
            except Exception as error:  # noqa: BLE001 - a failing row does not stop the others
                traceback.print_exc()
                result = {"status": "failed", "detail": last_line(error)}
            _append(results, {"row": row.key, "s": time.monotonic() - started, **result})
            _leave_process_group()
            if result["status"] == "failed" and sizes.device == "cuda" and not _cuda_usable():
                sys.exit(3)  # a sticky CUDA error: the parent starts a fresh worker for the rest


ROW_MARK = "=== gpu_check row: "


def _leave_process_group() -> None:
    """The strategy's one-rank default group does not outlive its row: the next row's strategy starts its own."""
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _cuda_usable() -> bool:
    import torch

    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001
        return False


def _append(path: Path, record: dict) -> None:
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")


def last_line(error: BaseException) -> str:
    """The error's type and last line (NCCL's: "Duplicate GPU detected ..."), before any C++ stack torch appends."""
    lines = [line.strip() for line in str(error).split("Exception raised from")[0].splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:200]


def tail_line(proc: subprocess.CompletedProcess) -> str:
    """A dead process's last error line from its output (after the last row mark, in a worker's log), or its exit."""
    text = (proc.stderr or "").rpartition(ROW_MARK)[2]
    errors = [line.strip() for line in text.splitlines() if "Error" in line or "error:" in line]
    died = f"exit code {proc.returncode}" if proc.returncode >= 0 else f"killed by signal {-proc.returncode}"
    return (f"{died}: {errors[-1]}" if errors else died)[:200]


# ---------------------------------------------------------------------------- the parent
def kill_tree(proc: subprocess.Popen) -> None:
    """The process and everything it started (its own session): torchrun's ranks must not outlive a timeout."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_with_timeout(cmd: list[str], timeout: float, cwd: Path) -> tuple[subprocess.CompletedProcess, bool]:
    proc = subprocess.Popen(cmd, cwd=cwd, env=repo_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=max(timeout, 1))
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), False
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        return subprocess.CompletedProcess(cmd, -9, "", ""), True


def run_group(rows: list[Row], args: argparse.Namespace, work: Path, deadline: float) -> dict[str, dict]:
    """The rows of one worker group: a worker process runs them in order; when it dies or a row outlives its budget,
    that row is failed and a new worker starts at the next one."""
    done: dict[str, dict] = {}
    pending = list(rows)
    attempt = 0
    while pending:
        if time.monotonic() >= deadline:
            done.update({row.key: {"status": "skipped", "detail": f"global budget of {args.budget:.0f} s spent"}
                         for row in pending})
            break
        attempt += 1
        results = work / f"{pending[0].group}-{attempt}.jsonl"
        spec = work / f"{pending[0].group}-{attempt}.json"
        memo = {row.options["model"]: done[row.key]["loss"] for row in rows  # the reference losses so far
                if row.options.get("feature") == "reference fp32 z0" and "loss" in done.get(row.key, {})}
        spec.write_text(json.dumps({"rows": [asdict(row) for row in pending], "memo": memo}))
        stderr = open(work / f"{pending[0].group}-{attempt}.log", "w")
        cmd = [sys.executable, "-m", __spec__.name, "--worker", str(spec), "--results", str(results)] + ["--cpu"] * args.cpu
        proc = subprocess.Popen(cmd, cwd=work, env=repo_env(), stdout=stderr, stderr=subprocess.STDOUT,
                                start_new_session=True)
        current, since = None, time.monotonic()
        budget = {row.key: row.budget_s for row in pending}
        while True:
            code = proc.poll()
            records = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
            for record in records:
                if "row" in record:
                    done[record.pop("row")] = record
                elif record["start"] != current:
                    current, since = record["start"], time.monotonic()
            if code is not None:
                break
            over = current is not None and current not in done and time.monotonic() - since > budget[current]
            if over or time.monotonic() >= deadline:
                kill_tree(proc)
                if current is not None and current not in done:
                    done[current] = {"status": "failed", "s": time.monotonic() - since,
                                     "detail": f"timed out after {time.monotonic() - since:.0f} s"}
                break
            time.sleep(0.2)
        stderr.close()
        if code not in (None, 0) and current is not None and current not in done:
            log = (work / f"{pending[0].group}-{attempt}.log").read_text()
            done[current] = {"status": "failed", "s": time.monotonic() - since,
                             "detail": tail_line(subprocess.CompletedProcess(cmd, code, "", log))}
        if current is None and code not in (None, 0):  # died before its first row: nothing more would start
            log = (work / f"{pending[0].group}-{attempt}.log").read_text()
            done.update({row.key: {"status": "failed", "detail": tail_line(subprocess.CompletedProcess(cmd, code, "", log))}
                         for row in pending})
        pending = [row for row in pending if row.key not in done]
    return done


def selected(rows: list[Row], only: Optional[list[str]]) -> list[Row]:
    """``--only``: families or row names (``features``, ``gpt zero3``, ``speed``)."""
    if not only:
        return rows
    chosen = [row for row in rows if row.family in only or row.name in only or row.key in only]
    unknown = set(only) - {row.family for row in rows} - {row.name for row in rows} - {row.key for row in rows}
    if unknown:
        raise SystemExit(f"--only: unknown {sorted(unknown)}; families: {sorted({r.family for r in rows})}; rows: "
                         f"{[r.name for r in rows]}")
    return chosen


def format_cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "loss":
        return f"{value:.4f}"
    if key == "vs ref":
        return f"{value:+.2e}"
    if key == "tokens/s":
        return f"{value:,.0f}"
    if key in ("TFLOP/s", "peak GiB", "planned GiB", "s"):
        return f"{value:.1f}" if key != "planned GiB" or value >= 0.1 else f"{value:.3f}"
    if key == "MFU":
        return f"{value:.1%}"
    if key in ("vs bf16", "vs plain"):
        return f"{value:.2f}x"
    if key == "mem ratio":
        return f"{value:.2f}"
    return str(value)


def table(records: list[dict], detail_width: int = 110) -> str:
    """The text table (details cut to ``detail_width``; the JSON keeps them whole)."""
    rows = [list(COLUMNS)] + [[_short(format_cell(c, record.get(c)), detail_width) if c == "detail" else
                               format_cell(c, record.get(c)) for c in COLUMNS] for record in records]
    return format_rows(rows, left=(0, 1, 2, len(COLUMNS) - 1))


def describe(cpu: bool) -> str:
    import torch

    if cpu:
        where = "CPU smoke mode: tiny sizes, gloo; speed and fp8 rows run gpt-tiny / llama-tiny at seq 64"
    else:
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        where = f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}, NCCL {nccl}"
    return f"gpu_check: {where}; torch {torch.__version__}, lightning {L.__version__}"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", default=os.environ.get("GPU_CHECK_CPU") == "1",
                        help="smoke mode: every row at tiny sizes on the CPU (also GPU_CHECK_CPU=1)")
    parser.add_argument("--only", nargs="+", help="families (features, sdpa, attention, offload, sft, '2 ranks', "
                                                  "speed, fp8) or row names")
    parser.add_argument("--json", type=Path, default=Path("gpu_check.json"), help="where the table goes as JSON")
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for all rows; later rows are skipped")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--two-ranks-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.two_ranks_worker:
        two_ranks_worker(sizes_for(args.cpu), args.out)
        return
    sizes = sizes_for(args.cpu)
    if not args.cpu and not args.worker:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(f"gpu_check: torch {torch.__version__} sees no CUDA device; run with --cpu for the smoke mode.")
    if args.worker:
        spec = json.loads(args.worker.read_text())
        worker_main([Row(**row) for row in spec["rows"]], sizes, args.results, spec["memo"])
        return
    deadline = time.monotonic() + args.budget
    rows = selected(plan_rows(args.cpu), args.only)
    print(describe(args.cpu), flush=True)
    done: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for group in dict.fromkeys(row.group for row in rows):
            members = [row for row in rows if row.group == group]
            work = Path(tmp, group)
            work.mkdir()
            print(f"  {group}: {len(members)} row(s) ...", file=sys.stderr, flush=True)
            done.update(run_group(members, args, work, deadline))
        logs = args.json.parent / f"{args.json.stem}_logs"  # every process's output, for the rows' whole errors
        logs.mkdir(parents=True, exist_ok=True)
        for log in Path(tmp).glob("*/*.log"):
            shutil.copy(log, logs / f"{log.parent.name}-{log.name}".replace(" ", "_"))
    compare_to_baseline(done, rows)
    records = [{"family": row.family, "row": row.name, **done[row.key]} for row in rows]
    print(table(records))
    args.json.write_text(json.dumps({"header": describe(args.cpu), "rows": records}, indent=1))
    print(f"(JSON: {args.json}; the processes' logs: {logs})")


if __name__ == "__main__":
    main()
