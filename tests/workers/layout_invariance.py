"""Train the tiny GPT for a few steps under several layouts over the same processes, built and stepped by the strategy.

``main(out_dir, [LAYOUTS])`` (a rank-pool job, ``entry.py``; argv ``OUT_DIR LAYOUTS`` as a script), LAYOUTS a comma
list of layout names: ``-``-separated words, each either a ``StrategyOptions``
setting (:data:`SIZES`, :data:`SETTINGS`) or one of this worker's (:data:`MODELS`, ``doc``, ``mb{M}``, ``sgd``,
``fused``/``foreach``, ``s{N}``, ``lora``). The model is built as the strategy builds it: meta device (``lora``:
``gpt_setup.LORA``'s adapters on the frozen model, AdamW over them only), then ``strategy.preparation.prepare_model``
with the layout's options (the tensor-parallel plan, FP8, regional compilation, recomputation, pipeline split,
materialised), ``start_pipeline`` under pipelining, and ``optim.step.build_step_gradients`` with the same options
(gradient buckets, ZeRO, fp32 main parameters, offload tiers, ``overlap_param_gather``); each step runs as the
strategy's ``StepDriver`` runs it: finish, non-finite check (its norm reused by the clip), clip, optimizer step.

Worker words: a model of ``gpt_setup.CONFIGS`` (default GPT); ``doc``: packed samples with Megatron-LM's document
masks (position ids and attention confined to each document); ``mb{M}``: M micro-batches per step (without
pipelining, a loop of backward passes; with it, the schedule's micro-batches); ``sgd``: SGD with momentum instead of
AdamW; ``fused`` / ``foreach``: AdamW's fused or multi-tensor implementation (rebound to the fp32 pieces under
ZeRO); ``s{N}``: the first N steps only. ``ogather``: the last dp rank starts its gathers late, so the other ranks'
forwards and final weights must wait for theirs. ``offnvme``: files in tiles of 1000 elements, so that pieces span
tiles and tiles span pieces, ``{layout}-offload{rank}.json`` recording the bytes the files moved. ``compile`` /
``compile_aot``: ``{layout}-dynamo{rank}.json`` records what dynamo made of the layers. ``lora``:
``{layout}-frozen{rank}.json`` records what the frozen parameters hold. A model with multi-token prediction
(``mtp``): rank 0 writes each step's ``mtp_loss`` (per counted token, over the global batch) to ``{layout}-mtp.json``.
For each layout, rank 0 writes the losses
and the full (gathered) weights to ``{layout}.pt``; the pytest process compares them with a single-process
reference.
"""

import json
import re
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from entry import run_script
from layout_runs import layouts_job, start_worker_pipeline
from gpt_setup import CLIP, CONFIGS, GLOBAL_BATCH, LORA, SEED, batches, document_batches, optimizer, sgd_optimizer
from lightning_megatron.checkpoint import gather_full_state_dict, merge_pipeline_stages
from lightning_megatron.models import GPTModel
from lightning_megatron.optim.nonfinite import NonFiniteCheck
from lightning_megatron.optim.step import build_step_gradients
from lightning_megatron.parallel import ParallelConfig, ParallelState, TensorParallelRNG
from lightning_megatron.peft.lora import apply_lora
from lightning_megatron.strategy.options import StrategyOptions
from lightning_megatron.strategy.preparation import prepare_model

TILE_MB = 1000 * 4 / 2**20  # 1000 fp32 elements a tile
#: Words ``{name}{N}`` that set a size of the layout.
SIZES = {"pp": "pipeline_parallel_size", "vpp": "virtual_pipeline_size", "tp": "tensor_parallel_size",
         "dp": "data_parallel_size", "z": "zero_stage"}
#: Words that set other strategy options.
SETTINGS = {
    "sp": {"sequence_parallel": True},
    "gpipe": {"pipeline_schedule": "gpipe"},
    "zb": {"pipeline_schedule": "interleaved_zero_bubble"},
    "zbv": {"pipeline_schedule": "zbv"},
    "dualpipev": {"pipeline_schedule": "dualpipev"},
    "ogather": {"overlap_param_gather": True},
    "tpo": {"tp_comm_overlap": True},
    "compile": {"compile": True},  # inductor
    "compile_aot": {"compile": {"backend": "aot_eager"}},
    "rc": {"activation_checkpointing": "full"},
    "offcpu": {"offload_optimizer": "cpu"},
    "offnvme": {"offload_optimizer": "nvme", "offload_buffer_mb": TILE_MB},  # offload_path: under OUT_DIR
    "fp8t": {"fp8": "tensorwise"},
    "fp8r": {"fp8": "rowwise"},
}
MODELS = ("llama", "mqa", "deep", "chunk", "qwen3", "gemma", "gemmachunk", "gemma3", "mtp")
WORKER_WORDS = re.compile(r"doc|sgd|fused|foreach|lora|mb\d+|s\d+")


def parse(layout: str, out_dir: Path) -> tuple[StrategyOptions, dict]:
    """The layout's strategy options and this worker's own settings (model, data, micro-batches, optimizer, steps);
    an "nvme" tier's files go under ``out_dir``."""
    words = layout.split("-")
    model = words.pop(0) if words[0] in MODELS else "gpt"
    settings: dict = {"bucket_size_mb": 0.01}
    worker = {"model": model, "micro_batches": 1}
    for word in words:
        size = re.fullmatch(r"([a-z]+)(\d+)", word)
        if size and size[1] in SIZES:
            settings[SIZES[size[1]]] = int(size[2])
        elif word in SETTINGS:
            settings.update(SETTINGS[word])
        elif WORKER_WORDS.fullmatch(word):
            if word.startswith("mb"):
                worker["micro_batches"] = int(word[2:])
            elif re.fullmatch(r"s\d+", word):
                worker["steps"] = int(word[1:])
            else:
                worker[word] = True
        else:
            raise ValueError(f"{layout}: {word!r} is no layout word")
    if settings.get("offload_optimizer") == "nvme":
        settings["offload_path"] = str(out_dir / "offload")
    if settings.get("virtual_pipeline_size", 1) > 1 and "pipeline_schedule" not in settings:
        settings["pipeline_schedule"] = "interleaved_1f1b"
    if settings.get("pipeline_parallel_size", 1) > 1:
        settings["micro_batch_size"] = GLOBAL_BATCH // settings["data_parallel_size"] // worker["micro_batches"]
    return StrategyOptions(**settings), worker


def build(state: ParallelState, options: StrategyOptions, worker: dict, make_model=None):
    """The model as the strategy builds it, and its optimizer and step bookkeeping as the strategy makes them;
    ``make_model()``: the model on the meta device (default: the worker's ``GPTModel``)."""
    with torch.device("meta"):
        model = GPTModel(CONFIGS[worker["model"]]) if make_model is None else make_model()
        if worker.get("lora"):
            apply_lora(model, LORA)
    rng = TensorParallelRNG(SEED, state.tensor_parallel_rank, torch.device("cpu"))
    prepared = prepare_model(model, state, options, rng=rng, seed=SEED, device="cpu", precision="32-true")
    params = [p for p in model.parameters() if p.requires_grad]  # all but a LoRA model's frozen base
    implementation = {name: True for name in ("fused", "foreach") if worker.get(name)}
    opt = sgd_optimizer(params) if worker.get("sgd") else optimizer(params, **implementation)
    step = build_step_gradients(model, state, [opt], options, loss_scaler=None, nonfinite=NonFiniteCheck("error", 10),
                                device=torch.device("cpu"))
    runner = None
    if prepared.split is not None:
        runner = start_worker_pipeline(prepared.split, state, step, options.micro_batch_size, options.pipeline_schedule)
    return model, params, opt, step, runner


def train(out_dir: Path, layout: str, build_model=build) -> tuple[list[float], dict]:
    """One layout's losses and gathered weights; ``build_model(state, options, worker)``: the model and its step
    bookkeeping (:func:`build`'s; ``hf_causal_layouts`` builds transformers' modules instead)."""
    options, worker = parse(layout, out_dir)
    if options.compile_options is not None:
        torch._dynamo.reset()  # this layout's compilations alone in the counters
        counters.clear()
    requested = options.requested
    config = ParallelConfig(**{name: requested[name] for name in (*SIZES.values(), "sequence_parallel")})
    state = ParallelState.create(config, "cpu")
    model, params, opt, step, runner = build_model(state, options, worker)
    main, dp, micro_batches = step.main_params, config.data_parallel_size, worker["micro_batches"]
    late = options.overlap_param_gather and state.data_parallel_rank == dp - 1

    losses, mtp_losses = [], []
    steps = document_batches() if worker.get("doc") else [(ids, lbl, {}) for ids, lbl in batches()]
    steps = steps[:worker.get("steps", len(steps))]
    for input_ids, labels, side in steps:
        rows = slice(state.data_parallel_rank * GLOBAL_BATCH // dp, (state.data_parallel_rank + 1) * GLOBAL_BATCH // dp)
        side = {name: value[rows] for name, value in side.items()}
        if runner is not None:
            step_sum, step_tokens = runner.loss(input_ids[rows], labels[rows], **side)
            step.add_tokens(step_tokens)
            mtp_totals = mtp_statistics(model)
        else:
            step_sum, step_tokens = torch.zeros(()), torch.zeros((), dtype=torch.long)
            mtp_totals = torch.zeros(2)
            chunked = {name: value.chunk(micro_batches) for name, value in side.items()}
            chunks = list(zip(input_ids[rows].chunk(micro_batches), labels[rows].chunk(micro_batches)))
            for i, (ids, lbl) in enumerate(chunks):
                step.sync.start_micro_batch(sync=i == len(chunks) - 1)
                loss_sum, tokens = model.loss(ids, lbl, **{name: value[i] for name, value in chunked.items()})
                (loss_sum * step.backward_scale(tokens, accumulation=micro_batches, loss_scale=1.0)).backward()
                step.add_tokens(tokens)
                step_sum, step_tokens = step_sum + loss_sum.detach(), step_tokens + tokens
                mtp_totals = mtp_totals + mtp_statistics(model)
        totals = torch.cat([torch.stack([step_sum.detach().float(), step_tokens.float()]), mtp_totals])
        if state.data_parallel_group is not None:  # before the step: no dp collective between it and the forward
            dist.all_reduce(totals, group=state.data_parallel_group)
        losses.append((totals[0] / totals[1]).item())
        mtp_losses.append((totals[2] / totals[3]).item())
        step.finish(accumulation=1 if runner is not None else micro_batches, loss_scale=1.0)
        norm, _ = step.check_finite(opt.param_groups, step=len(losses), epoch=0)
        step.clip(opt.param_groups, CLIP, norm=norm)
        opt.step()
        if late:
            time.sleep(0.05)
        step.after_step()
        if main is not None:
            assert not options.overlap_param_gather or dp == 1 or main.gather.in_flight, \
                "overlap_param_gather must leave gathers running"

    if worker.get("lora"):  # the frozen base: no gradient, no optimizer state, no fp32 copy
        frozen = [p for p in model.parameters() if not p.requires_grad]
        stepped = [p for group in opt.param_groups for p in group["params"]]
        held = {"frozen": sum(p.numel() for p in frozen), "frozen_grads": sum(p.grad is not None for p in frozen),
                "frozen_dtypes": sorted({str(p.dtype) for p in frozen}),
                "trainable": sum(p.numel() for p in params), "stepped": sum(p.numel() for p in stepped),
                "state": sum(v.numel() for s in opt.state.values() for v in s.values() if v.dim() > 0),
                "frozen_in_optimizer": any(p is q for p in frozen for q in stepped),
                "sync": sum(p.numel() for p in step.sync.params)}
        (out_dir / f"{layout}-frozen{dist.get_rank()}.json").write_text(json.dumps(held))
    if main is not None:
        main.wait_for_params()  # as the strategy does before reading weights (full_state_dict)
        if main.nvme is not None:
            files = main.nvme.files
            moved = {"read": files.bytes_read, "written": files.bytes_written, "steps": len(losses),
                     "elements": sum(m.numel() for _, m in main.pieces), "tiles": len(main.nvme.engine.tiles),
                     "state_keys": sorted(main.nvme.state_keys), "on_cpu": all(m.device.type == "cpu" for _, m in main.pieces)}
    if CONFIGS[worker["model"]].mtp is not None and dist.get_rank() == 0:
        (out_dir / f"{layout}-mtp.json").write_text(json.dumps(mtp_losses))
    weights = merge_pipeline_stages(gather_full_state_dict(model, state.tensor_parallel_group),
                                    state.pipeline_parallel_group)
    step.remove()  # the main parameters' too: the "nvme" tier's files go
    if main is not None and main.nvme is not None:
        moved["folder_removed"] = not files.folder.exists()
        (out_dir / f"{layout}-offload{dist.get_rank()}.json").write_text(json.dumps(moved))
    if options.compile_options is not None:  # what dynamo made of the layers: graphs, breaks, recompilations
        dynamo = {"graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["ok"],
                  "graph_breaks": sum(counters["graph_break"].values()), "recompiles": sum(counters["recompiles"].values())}
        (out_dir / f"{layout}-dynamo{dist.get_rank()}.json").write_text(json.dumps(dynamo))
    return losses, weights


def mtp_statistics(model) -> torch.Tensor:
    """``[sum of the depths' token losses, their tokens]`` of the last loss (zeros without multi-token prediction,
    and for models that have none: transformers' own, ``tests/workers/hf_causal_layouts.py``)."""
    statistics = getattr(model, "mtp_statistics", None)
    if statistics is None:
        return torch.zeros(2)
    sums, tokens = statistics
    return torch.stack([sums.sum().float(), tokens.sum().float()])


def main(out_dir: Path, args: list[str]) -> None:
    layouts_job(out_dir, args[0].split(","), partial(train, out_dir))


if __name__ == "__main__":
    run_script(main)
