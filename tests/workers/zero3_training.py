"""ZeRO stage 3 (FSDP2 over dp) with tensor parallelism: train the tiny GPT under several layouts.

argv: OUT_DIR LAYOUTS, where LAYOUTS is a comma list of ``bytes`` (``zero3_bytes.measure_bytes``,
in the same processes to save a launch) and
``[llama-|mqa-|moe-|chunk-][pp{P}-]tp{T}-dp{D}[-sp][-mb{M}][-nosync][-pre][-sgd][-tpo][-cpu][-ckpt][-fp8t|-fp8r][-s{N}][-lora]``: P pipeline stages (1F1B, the
embedding and head in groups of their own), M micro-batches per step (``-nosync``:
accumulate unsharded gradients and reduce-scatter only on the last; otherwise reduce-scatter
every micro-batch; with micro-batches the backward is mean-sized, its factor divided out by
``finish(backward_scale=...)``), ``-pre``: materialise the tp shards before sharding over dp (otherwise
``ZeRO3.initialize`` materialises only the dp chunks from the meta device), SGD with
momentum instead of AdamW, ``-tpo``: tp_comm_overlap, ``-cpu``: ``offload_parameters="cpu"`` (FSDP's CPU offload;
each rank reports the FSDP groups' policies and where its shards, gradients and optimizer state lived), ``-ckpt``:
after training save a sharded checkpoint (``checkpoint.training_state``) to ``{layout}.ckpt`` and load it at the
same tp / sp under dp ZeRO-1 without offload; each rank writes the pieces it then holds to
``{layout}-resumed{rank}.pt``; ``-fp8t`` / ``-fp8r``: the plan's linears in FP8 (tensorwise, rowwise); ``-s{N}``: the
first N steps only; ``-lora``: ``gpt_setup.LORA``'s adapters on the frozen model (FSDP2 groups mixing frozen and
trained parameters), the optimizer over the adapters, ``{layout}-frozen{rank}.json`` recording what the frozen
parameters hold (as ``layout_invariance.py``'s). fp32 throughout. For each layout rank 0 writes the losses and the
full (gathered) weights to ``{layout}.pt``; the pytest process compares them with the
single-process reference. The first training layout also checks that ``load_full_state_dict`` round-trips.
"""

import json
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from gpt_setup import CLIP, CONFIG, CONFIGS, GLOBAL_BATCH, LORA, SEED, batches, optimizer, sgd_optimizer
from zero3_bytes import measure_bytes
from lightning_megatron.checkpoint import entries, merge_pipeline_stages
from lightning_megatron.checkpoint.training_state import (
    RankTraining,
    load_model_state,
    load_optimizer_state,
    save_training_state,
)
from lightning_megatron.models import GPTModel
from lightning_megatron.checkpoint import gather_full_state_dict
from lightning_megatron.optim.grad_sync import GradientSynchronizer
from lightning_megatron.optim.main_params import MainParamOptimizer
from lightning_megatron.optim.partial_grads import partial_grad_groups
from lightning_megatron.offload.settings import OffloadSettings
from lightning_megatron.optim.zero3 import apply_zero3, load_full_state_dict, local_tensor
from lightning_megatron.parallel import ParallelConfig, ParallelState, TensorParallelRNG
from lightning_megatron.parallel.initialize import initialize_parameters
from lightning_megatron.pipeline import PipelineLayout
from lightning_megatron.pipeline.runner import PipelineRunner
from lightning_megatron.pipeline.stage import split_for_pipeline
from lightning_megatron.peft.lora import apply_lora
from lightning_megatron.peft.plan import tensor_parallel_plan_of
from lightning_megatron.tensor_parallel import parallelize
from lightning_megatron.tensor_parallel.fp8 import Fp8Recipe
from lightning_megatron.tensor_parallel.fp8_plan import convert_to_fp8
from lightning_megatron.tensor_parallel.overlap import overlapped_linear_for
from entry import run_script

LAYOUT = re.compile(r"(?:(llama|mqa|moe|chunk|gemma)-)?(?:pp(\d+)-)?tp(\d+)-dp(\d+)(-sp)?(?:-mb(\d+))?(-nosync)?(-pre)?(-sgd)?"
                    r"(-tpo)?(-cpu)?(-ckpt)?(?:-fp8(t|r))?(?:-s(\d+))?(-lora)?")
FP8_RECIPES = {"t": "tensorwise", "r": "rowwise"}


def build(state: ParallelState, pre: bool, micro_batches: int = 1, config=CONFIG, overlap: bool = False,
          offload: str = "none", fp8: str = None, lora=None):
    """As the strategy would: meta, (LoRA,) tp plan, pipeline split, ZeRO-3 on the meta device, materialise."""
    with torch.device("meta"):
        model = GPTModel(config)
        if lora is not None:
            apply_lora(model, lora)
    rng = TensorParallelRNG(SEED, state.tensor_parallel_rank, torch.device("cpu"))
    parallelize(model, tensor_parallel_plan_of(model, state.config), state, rng=rng,
                sequence_linear=overlapped_linear_for(state.config, overlap))
    convert_to_fp8(model, fp8 and Fp8Recipe.named(fp8), state)  # FSDP then gathers fp32 weights, the layers cast them
    pp, blocks, other_groups = state.config.pipeline_parallel_size, GPTModel.pipeline_blocks(), None
    if pp > 1:
        layout = PipelineLayout(num_layers=config.num_layers, pipeline_parallel_size=pp)
        local = layout.stages_of_rank(state.pipeline_parallel_rank)
        stages = split_for_pipeline(model, blocks, layout.stage_layers(), local)
        other_groups = [name for name in (*blocks.first, *blocks.last) if getattr(model, name) is not None]
    if pre:
        initialize_parameters(model, SEED, device="cpu", only_meta=True)
    zero3 = apply_zero3(model, state, layers_pattern=f"{blocks.layers}.*", other_groups=other_groups,
                        offload=OffloadSettings(parameters=offload))
    zero3.initialize(SEED, device="cpu")
    runner = None
    if pp > 1:
        per_rank = GLOBAL_BATCH // state.config.data_parallel_size
        runner = PipelineRunner(stages, local, num_stages=layout.num_stages, group=state.pipeline_parallel_group,
                                device=torch.device("cpu"), schedule="1f1b",
                                micro_batch_size=per_rank // micro_batches, root=model)
    return model, zero3, runner


def devices(tensors) -> list[str]:
    return sorted({str(local_tensor(t).device) + (" pinned" if local_tensor(t).is_pinned() else "") for t in tensors})


def train(layout: str, check_load: bool, out_dir: Path):
    match = LAYOUT.fullmatch(layout)
    model_config = CONFIGS[match[1] or "gpt"]
    pp, tp, dp, sp = int(match[2] or 1), int(match[3]), int(match[4]), bool(match[5])
    micro_batches, nosync, pre, sgd = int(match[6] or 1), bool(match[7]), bool(match[8]), bool(match[9])
    offload = "cpu" if match[11] else "none"
    config = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                            sequence_parallel=sp)
    state = ParallelState.create(config, "cpu")
    model, zero3, runner = build(state, pre, micro_batches, model_config, overlap=bool(match[10]), offload=offload,
                                 fp8=FP8_RECIPES.get(match[13]), lora=LORA if match[15] else None)
    assert all(isinstance(p, DTensor) for p in model.parameters()), "fully_shard should make every parameter a DTensor"
    params = [p for p in model.parameters() if p.requires_grad]  # all but a LoRA model's frozen base
    opt = sgd_optimizer(params) if sgd else optimizer(params)
    policies = {type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__ for m in zero3.fsdp_modules}
    report = {"policies": sorted(policies), "params": devices(params)}
    losses = []
    for input_ids, labels in batches()[:int(match[14] or len(batches()))]:
        rows = slice(state.data_parallel_rank * GLOBAL_BATCH // dp, (state.data_parallel_rank + 1) * GLOBAL_BATCH // dp)
        backward_scale = 1.0
        if runner is not None:  # the schedule runs every micro-batch's forward and backward
            zero3.start_micro_batch(sync=True)
            step_sum, step_tokens = runner.loss(input_ids[rows], labels[rows])
        else:
            step_sum, step_tokens = torch.zeros(()), torch.zeros((), dtype=torch.long)
            chunks = list(zip(input_ids[rows].chunk(micro_batches), labels[rows].chunk(micro_batches)))
            for i, (ids, lbl) in enumerate(chunks):
                zero3.start_micro_batch(sync=not nosync or i == len(chunks) - 1)
                loss_sum, tokens = model.loss(ids, lbl)
                if micro_batches > 1:  # a mean-sized backward; the factor must be the same on every dp rank
                    backward_scale = 1.0 / (ids.numel() * micro_batches * dp)
                (loss_sum * backward_scale).backward()
                step_sum, step_tokens = step_sum + loss_sum.detach(), step_tokens + tokens
        zero3.finish(step_tokens, backward_scale=backward_scale)
        zero3.clip_grad_norm_(CLIP)
        report["grads"] = devices(p.grad for p in params)
        opt.step()
        zero3.zero()
        totals = torch.stack([step_sum.detach().float(), step_tokens.float()])
        if state.data_parallel_group is not None:
            dist.all_reduce(totals, group=state.data_parallel_group)
        losses.append((totals[0] / totals[1]).item())

    if match[15]:  # the frozen base: no gradient shard, no optimizer state (local shards counted)
        frozen = [p for p in model.parameters() if not p.requires_grad]
        stepped = [p for group in opt.param_groups for p in group["params"]]
        numel = lambda tensors: sum(local_tensor(t).numel() for t in tensors)  # noqa: E731
        held = {"frozen": numel(frozen), "frozen_grads": sum(p.grad is not None for p in frozen),
                "frozen_dtypes": sorted({str(p.dtype) for p in frozen}), "trainable": numel(params),
                "stepped": numel(stepped),
                "state": numel(v for s in opt.state.values() for v in s.values() if v.dim() > 0),
                "frozen_in_optimizer": any(p is q for p in frozen for q in stepped),
                "sync": numel(params)}
        (out_dir / f"{layout}-frozen{dist.get_rank()}.json").write_text(json.dumps(held))
    weights = merge_pipeline_stages(gather_full_state_dict(model, state.tensor_parallel_group),
                                    state.pipeline_parallel_group)
    report["optimizer_state"] = devices(v for s in opt.state.values() for v in s.values() if v.dim() > 0)
    if match[12]:
        path = out_dir / f"{layout}.ckpt"
        training = RankTraining(model, [opt], state)
        hyper = entries.optimizer_hyperparameters(opt, training.placements())
        save_training_state(path, {"optimizer_states": [hyper]}, training, {})
        resume_at_zero1(path, tp, dp, sp, out_dir / f"{layout}-resumed{dist.get_rank()}.pt")
    load_ok = None
    if check_load:  # a fresh ZeRO-3 model at this layout takes the full weights back exactly
        fresh, _, _ = build(state, pre=False)
        load_full_state_dict(fresh, weights)
        again = merge_pipeline_stages(gather_full_state_dict(fresh, state.tensor_parallel_group),
                                      state.pipeline_parallel_group)
        load_ok = all(torch.equal(again[k], weights[k]) for k in weights)
    return losses, weights, load_ok, report


def resume_at_zero1(path: Path, tp: int, dp: int, sp: bool, pieces_file: Path) -> None:
    """Load the checkpoint at ``path`` into a fresh model at tp / dp ZeRO-1 (fp32 main pieces, no offload), as the
    strategy restores one, and write every piece this rank then holds as ``(key, offsets, tensor)`` rows."""
    config = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, sequence_parallel=sp, zero_stage=1)
    state = ParallelState.create(config, "cpu")
    with torch.device("meta"):
        model = GPTModel(CONFIG)
    parallelize(model, model.tensor_parallel_plan(), state)
    initialize_parameters(model, SEED + 1, device="cpu", only_meta=True)  # other values: the load must replace them
    params = list(model.parameters())
    opt = optimizer(params)
    sync = GradientSynchronizer(params, data_parallel_group=state.data_parallel_group, bucket_size_mb=0.01,
                                zero_stage=1, partial_grad_groups=partial_grad_groups(params, state))
    main = MainParamOptimizer(opt, sync)
    training = RankTraining(model, [opt], state, main_params=main)
    saved, trainer_state = load_model_state(path, training)
    load_optimizer_state(saved, trainer_state, training)
    placements = training.placements()
    held = {**training.model_entries(), **entries.optimizer_entries(opt, 0, placements)}
    torch.save([(key, list(offsets), piece.clone()) for key, entry in held.items()
                for offsets, piece in entry.pieces.items()], pieces_file)


def main(out_dir: Path, args: list[str]) -> None:
    layouts = args[0].split(",")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    summary = {}
    first = next((layout for layout in layouts if layout != "bytes"), None)
    for layout in layouts:
        if layout == "bytes":
            summary["bytes"] = measure_bytes()
            continue
        losses, weights, load_ok, report = train(layout, check_load=layout == first, out_dir=out_dir)
        if rank == 0:
            torch.save({"losses": losses, "weights": weights}, out_dir / f"{layout}.pt")
        summary[layout] = {"losses": losses, "load_ok": load_ok, "offload": report}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(summary))
    dist.barrier()


if __name__ == "__main__":
    run_script(main)
