"""Train the tiny GPT for a few steps under several layouts over the same processes.

argv: OUT_DIR LAYOUTS, where LAYOUTS is a comma list of
``[llama-|mqa-|deep-|chunk-][doc-][pp{P}-][vpp{V}-]tp{T}-dp{D}[-sp][-mb{M}][-SCHEDULE][-z{Z}][-ogather][-sgd][-tpo][-compile|-compile_aot][-rc][-fused|-foreach][-offcpu|-offnvme][-fp8t|-fp8r][-s{N}][-lora]``: ``doc``:
packed samples with Megatron-LM's document masks (position ids and attention confined to each document); M
micro-batches per step (without pipelining, a loop of backward passes; with it, the schedule's micro-batches),
SCHEDULE one of ``gpipe``, ``zb`` (interleaved zero bubble), ``zbv``, ``dualpipev`` (default: 1F1B, interleaved
with vpp), ZeRO stage Z, ``ogather``: its parameter all-gathers overlapped with the next forward
(``overlap_param_gather``; the last dp rank starts its gathers late, so the other ranks' forwards and final weights
must wait for theirs), SGD with momentum instead of AdamW, ``tpo``: tp_comm_overlap (the sequence-parallel
collectives overlapped with the GEMMs); ``-compile`` (inductor) or ``-compile_aot`` (aot_eager): regional compilation
of every layer, ``-rc``: full recomputation (of the compiled layer); ``-fused`` / ``-foreach``: AdamW's fused or
multi-tensor implementation (rebound to the fp32 pieces under ZeRO); ``-offcpu`` / ``-offnvme``: the fp32 main
parameters and optimizer state offloaded to host memory or to files (in tiles of 1000 elements, so that pieces span
tiles and tiles span pieces), ``{layout}-offload{rank}.json`` recording the bytes the files moved; ``chunk``: the
GPT model with the chunked loss (``loss_chunk_tokens``); ``-fp8t`` / ``-fp8r``: the plan's linears in FP8, tensorwise or
rowwise (``tensor_parallel.fp8``); ``-s{N}``: the first N steps only; ``-lora``: ``gpt_setup.LORA``'s adapters on
the frozen model, split by the plan as the strategy splits them (``preparation.tensor_parallel_plan_of``), AdamW
over the adapters only, and ``{layout}-frozen{rank}.json`` recording what the frozen parameters hold. For each
layout, rank 0 writes the losses and the full (gathered) weights to ``{layout}.pt``; the
pytest process compares them with a single-process reference.
"""

import json
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from layout_runs import run_layouts
from gpt_setup import (CLIP, CONFIG, CONFIGS, GLOBAL_BATCH, LORA, SEED, batches, document_batches, optimizer,
                       sgd_optimizer)
from lightning_megatron.checkpoint import gather_full_state_dict, merge_pipeline_stages
from lightning_megatron.models import GPTModel
from lightning_megatron.offload import OffloadSettings
from lightning_megatron.optim import GradientSynchronizer, clip_grads_by_global_norm
from lightning_megatron.optim.main_params import MainParamOptimizer, uses_main_params
from lightning_megatron.optim.partial_grads import partial_grad_groups
from lightning_megatron.parallel import ParallelConfig, ParallelState, TensorParallelRNG
from lightning_megatron.parallel.initialize import initialize_parameters
from lightning_megatron.pipeline import PipelineLayout
from lightning_megatron.pipeline.runner import PipelineRunner
from lightning_megatron.pipeline.stage import split_for_pipeline
from lightning_megatron.peft.lora import apply_lora
from lightning_megatron.strategy.preparation import apply_recompute, compile_blocks, tensor_parallel_plan_of
from lightning_megatron.tensor_parallel import parallelize
from lightning_megatron.tensor_parallel.fp8 import Fp8Recipe
from lightning_megatron.tensor_parallel.fp8_plan import convert_to_fp8
from lightning_megatron.tensor_parallel.overlap import overlapped_linear_for

LAYOUT = re.compile(r"(?:(llama|mqa|deep|chunk)-)?(doc-)?(?:pp(\d+)-)?(?:vpp(\d+)-)?tp(\d+)-dp(\d+)(-sp)?(?:-mb(\d+))?"
                    r"(?:-(gpipe|zb|zbv|dualpipev))?(?:-z(\d))?(-ogather)?(-sgd)?(-tpo)?(?:-(compile|compile_aot))?(-rc)?"
                    r"(?:-(fused|foreach))?(?:-off(cpu|nvme))?(?:-fp8(t|r))?(?:-s(\d+))?(-lora)?")
FP8_RECIPES = {"t": "tensorwise", "r": "rowwise"}
TILE_MB = 1000 * 4 / 2**20  # 1000 fp32 elements a tile
SCHEDULE_NAMES = {"zb": "interleaved_zero_bubble"}


def build(state: ParallelState, virtual: int, schedule: str, micro_batches: int, config=CONFIG, tp_overlap=False,
          compile=None, recompute="none", fp8=None, lora=None):
    """The model as the strategy builds it: meta, (LoRA,) tensor-parallel plan, (compile, recompute,) pipeline split,
    materialise."""
    with torch.device("meta"):
        model = GPTModel(config)
        if lora is not None:
            apply_lora(model, lora)
    rng = TensorParallelRNG(SEED, state.tensor_parallel_rank, torch.device("cpu"))
    parallelize(model, tensor_parallel_plan_of(model, state.config), state, rng=rng,
                sequence_linear=overlapped_linear_for(state.config, tp_overlap))
    convert_to_fp8(model, fp8 and Fp8Recipe.named(fp8), state)
    compile_blocks(model, compile, state.config, recompute)
    apply_recompute(model, recompute, rng)
    runner = None
    pp = state.config.pipeline_parallel_size
    if pp > 1:
        layout = PipelineLayout(num_layers=config.num_layers, pipeline_parallel_size=pp, virtual_pipeline_size=virtual,
                                schedule=schedule)
        local = layout.stages_of_rank(state.pipeline_parallel_rank)
        stages = split_for_pipeline(model, GPTModel.pipeline_blocks(), layout.stage_layers(), local)
    initialize_parameters(model, SEED, device="cpu", only_meta=True)
    if pp > 1:
        per_rank = GLOBAL_BATCH // state.config.data_parallel_size
        runner = PipelineRunner(stages, local, num_stages=layout.num_stages, group=state.pipeline_parallel_group,
                                device=torch.device("cpu"), schedule=schedule,
                                micro_batch_size=per_rank // micro_batches, root=model)
    return model, runner


def train(layout: str) -> tuple[list[float], dict]:
    match = LAYOUT.fullmatch(layout)
    model_config = CONFIGS[match[1] or "gpt"]
    documents = bool(match[2])
    pp, virtual, tp, dp = int(match[3] or 1), int(match[4] or 1), int(match[5]), int(match[6])
    sp, micro_batches = bool(match[7]), int(match[8] or 1)
    schedule = SCHEDULE_NAMES.get(match[9], match[9]) or ("interleaved_1f1b" if virtual > 1 else "1f1b")
    zero_stage, overlap, sgd, tp_overlap = int(match[10] or 0), bool(match[11]), bool(match[12]), bool(match[13])
    compile = {"compile": {}, "compile_aot": {"backend": "aot_eager"}}.get(match[14])
    if compile is not None:
        torch._dynamo.reset()  # this layout's compilations alone in the counters
        counters.clear()
    config = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                            sequence_parallel=sp, virtual_pipeline_size=virtual, zero_stage=zero_stage)
    state = ParallelState.create(config, "cpu")
    model, runner = build(state, virtual, schedule, micro_batches, model_config, tp_overlap, compile,
                          "full" if match[15] else "none", FP8_RECIPES.get(match[18]), LORA if match[20] else None)
    params = [p for p in model.parameters() if p.requires_grad]  # all but a LoRA model's frozen base
    implementation = {match[16]: True} if match[16] else {}
    opt = sgd_optimizer(params) if sgd else optimizer(params, **implementation)
    sync = GradientSynchronizer(params, data_parallel_group=state.data_parallel_group, bucket_size_mb=0.01,
                                zero_stage=zero_stage, partial_grad_groups=partial_grad_groups(params, state))
    tier = match[17] or "none"
    offload = OffloadSettings(tier, path=str(Path(sys.argv[1]) / "offload") if tier == "nvme" else None,
                              buffer_mb=TILE_MB)
    main = MainParamOptimizer(opt, sync, overlap_with=model if overlap else None, offload=offload) \
        if uses_main_params(params, zero_stage, offload) else None
    late = overlap and state.data_parallel_rank == dp - 1
    if runner is not None:
        runner.before_backward = lambda n, _tokens: sync.start_micro_batch(sync=True, backward_passes=n)

    losses = []
    steps = document_batches() if documents else [(ids, lbl, {}) for ids, lbl in batches()]
    steps = steps[:int(match[19] or len(steps))]
    for input_ids, labels, side in steps:
        rows = slice(state.data_parallel_rank * GLOBAL_BATCH // dp, (state.data_parallel_rank + 1) * GLOBAL_BATCH // dp)
        side = {name: value[rows] for name, value in side.items()}
        if runner is not None:
            step_sum, step_tokens = runner.loss(input_ids[rows], labels[rows], **side)
        else:
            step_sum, step_tokens = torch.zeros(()), torch.zeros((), dtype=torch.long)
            chunked = {name: value.chunk(micro_batches) for name, value in side.items()}
            chunks = list(zip(input_ids[rows].chunk(micro_batches), labels[rows].chunk(micro_batches)))
            for i, (ids, lbl) in enumerate(chunks):
                sync.start_micro_batch(sync=i == len(chunks) - 1)
                loss_sum, tokens = model.loss(ids, lbl, **{name: value[i] for name, value in chunked.items()})
                loss_sum.backward()
                step_sum, step_tokens = step_sum + loss_sum.detach(), step_tokens + tokens
        totals = torch.stack([step_sum.detach().float(), step_tokens.float()])
        if state.data_parallel_group is not None:  # before the step: no dp collective between it and the forward
            dist.all_reduce(totals, group=state.data_parallel_group)
        losses.append((totals[0] / totals[1]).item())
        sync.finish(step_tokens)
        if main is not None:
            main.prepare_step()
        clip_grads_by_global_norm([p for g in opt.param_groups for p in g["params"]], CLIP,
                                  model_parallel_group=state.model_parallel_group,
                                  is_first_tensor_rank=state.tensor_parallel_rank == 0,
                                  data_parallel_group=state.data_parallel_group if zero_stage else None)
        opt.step()
        if late:
            time.sleep(0.05)
        if main is not None:
            main.finish_step()
            assert not overlap or dp == 1 or main.gather.in_flight, "overlap_param_gather must leave gathers running"
        sync.zero()

    if match[20]:  # the frozen base: no gradient, no optimizer state, no fp32 copy
        frozen = [p for p in model.parameters() if not p.requires_grad]
        stepped = [p for group in opt.param_groups for p in group["params"]]
        held = {"frozen": sum(p.numel() for p in frozen), "frozen_grads": sum(p.grad is not None for p in frozen),
                "frozen_dtypes": sorted({str(p.dtype) for p in frozen}),
                "trainable": sum(p.numel() for p in params), "stepped": sum(p.numel() for p in stepped),
                "state": sum(v.numel() for s in opt.state.values() for v in s.values() if v.dim() > 0),
                "frozen_in_optimizer": any(p is q for p in frozen for q in stepped),
                "sync": sum(p.numel() for p in sync.params)}
        (Path(sys.argv[1]) / f"{layout}-frozen{dist.get_rank()}.json").write_text(json.dumps(held))
    if main is not None:
        main.wait_for_params()  # as the strategy does before reading weights (full_state_dict)
        if main.nvme is not None:
            files = main.nvme.files
            moved = {"read": files.bytes_read, "written": files.bytes_written, "steps": len(losses),
                     "elements": sum(m.numel() for _, m in main.pieces), "tiles": len(main.nvme.engine.tiles),
                     "state_keys": sorted(main.nvme.state_keys), "on_cpu": all(m.device.type == "cpu" for _, m in main.pieces)}
        main.remove()
        if main.nvme is not None:
            moved["folder_removed"] = not files.folder.exists()
            (Path(sys.argv[1]) / f"{layout}-offload{dist.get_rank()}.json").write_text(json.dumps(moved))
    weights = merge_pipeline_stages(gather_full_state_dict(model, state.tensor_parallel_group),
                                    state.pipeline_parallel_group)
    sync.remove()
    if compile is not None:  # what dynamo made of the layers: graphs, breaks, recompilations
        dynamo = {"graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["ok"],
                  "graph_breaks": sum(counters["graph_break"].values()), "recompiles": sum(counters["recompiles"].values())}
        (Path(sys.argv[1]) / f"{layout}-dynamo{dist.get_rank()}.json").write_text(json.dumps(dynamo))
    return losses, weights


if __name__ == "__main__":
    run_layouts(train)
