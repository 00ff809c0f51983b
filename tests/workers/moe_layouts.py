"""Train the tiny MoE GPT for a few steps at several expert-parallel layouts over the same processes, and count
the collectives of one step.

argv: OUT_DIR LAYOUTS, a comma list of ``<variant>-ep{E}[-pp{P}]-tp{T}-dp{D}[-sp][-mb{M}][-z{Z}][-og][-rc][-zb][-etp1]``
(``etp1``: expert_tensor_parallel_size=1, whole experts on each tp rank; ``og``:
overlap_param_gather; ``rc``: full recomputation; ``zb``: the interleaved zero-bubble schedule, its backward
split in two passes; variants:
``gpt_setup.VARIANTS``), or ``count-ep{E}-tp{T}-dp{D}[-sp]`` for a counting run, or ``gen-...`` for generation. The model is built by the
strategy's own steps (``parallelize``, ``prepare_experts``, ``split_pipeline``, ``start_pipeline``,
``build_step_gradients``), and stepped as the strategy steps it: token-summed losses times the backward scale,
``StepGradients.finish``, the non-finite check's global norm reused by the clip, AdamW, the expert-bias update over dp. Rank 0 writes each
layout's losses and full weights (gathered over tp, pp and ep) to ``{layout}.pt``; a counting run writes, per
rank, the collectives of one training step's forward and backward, by kind and group size, and the host syncs the
MoE layers' code made in each.
"""

import re
from pathlib import Path

import torch
import torch.distributed as dist

from entry import run_script
from layout_runs import layouts_job, start_worker_pipeline
from collective_counter import CollectiveCounter
from gpt_setup import CLIP, GLOBAL_BATCH, MOE_CONFIGS as CONFIGS, SEED, batches, optimizer

from lightning_megatron.checkpoint import gather_full_state_dict, merge_pipeline_stages
from lightning_megatron.models import GPTModel
from lightning_megatron.models.moe import update_expert_biases
from lightning_megatron.optim.nonfinite import NonFiniteCheck
from lightning_megatron.parallel.guards import count_host_syncs
from lightning_megatron.optim.step import build_step_gradients
from lightning_megatron.strategy.options import StrategyOptions
from lightning_megatron.parallel import ParallelConfig, ParallelState, TensorParallelRNG
from lightning_megatron.parallel.initialize import initialize_parameters
from lightning_megatron.expert_parallel.apply import prepare_experts
from lightning_megatron.strategy.preparation import apply_recompute, shard_zero3, split_pipeline
from lightning_megatron.tensor_parallel import parallelize

LAYOUT = re.compile(r"(\w+)-ep(\d+)(?:-pp(\d+))?-tp(\d+)-dp(\d+)(-sp)?(?:-mb(\d+))?(?:-z(\d))?(-og)?(-rc)?(-zb)?(-etp1)?")


def build(name: str, config: ParallelConfig, micro_batches: int, recompute: str = "none", overlap: bool = False,
          schedule: str = "1f1b"):
    state = ParallelState.create(config, "cpu")
    with torch.device("meta"):
        model = GPTModel(CONFIGS[name if name in CONFIGS else "moe"])
    rng = TensorParallelRNG(SEED, state.tensor_parallel_rank, "cpu")
    parallelize(model, model.tensor_parallel_plan(), state, rng=rng)
    apply_recompute(model, recompute, rng)
    prepare_experts(model, state)
    split = split_pipeline(model, state, schedule)
    zero3 = None
    if config.zero_stage == 3:  # the experts over their expert-data-parallel group, the rest over dp
        zero3 = shard_zero3(model, state, precision="32-true", seed=SEED, device="cpu")
    else:
        initialize_parameters(model, SEED, device="cpu", only_meta=True)
    opt = optimizer(model.parameters())
    options = StrategyOptions(zero_stage=state.config.zero_stage, bucket_size_mb=0.01, overlap_param_gather=overlap)
    step = build_step_gradients(model, state, [opt], options, zero3=zero3, loss_scaler=None,
                                nonfinite=NonFiniteCheck("error", 10), device=torch.device("cpu"))
    runner = None
    if split is not None:
        runner = start_worker_pipeline(split, state, step, GLOBAL_BATCH // config.data_parallel_size // micro_batches,
                                       schedule)
    return state, model, opt, step, runner


def parse(layout: str):
    match = LAYOUT.fullmatch(layout)
    ep, pp, tp, dp = int(match[2]), int(match[3] or 1), int(match[4]), int(match[5])
    config = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                            sequence_parallel=bool(match[6]), zero_stage=int(match[8] or 0), expert_parallel_size=ep,
                            expert_tensor_parallel_size=1 if match[12] else None)
    return (match[1], config, int(match[7] or 1), "full" if match[10] else "none", bool(match[9]),
            "interleaved_zero_bubble" if match[11] else "1f1b")


def train_step(state, model, step, runner, input_ids, labels, micro_batches):
    """One step's forward and backward as the strategy runs them; returns (loss sum, tokens) of this rank."""
    dp = state.config.data_parallel_size
    rows = slice(state.data_parallel_rank * GLOBAL_BATCH // dp, (state.data_parallel_rank + 1) * GLOBAL_BATCH // dp)
    if runner is not None:
        loss_sum, tokens = runner.loss(input_ids[rows], labels[rows])
        step.add_tokens(tokens)
        return loss_sum, tokens
    total, count = torch.zeros(()), torch.zeros((), dtype=torch.long)
    chunks = list(zip(input_ids[rows].chunk(micro_batches), labels[rows].chunk(micro_batches)))
    for i, (ids, lbl) in enumerate(chunks):
        step.sync.start_micro_batch(sync=i == len(chunks) - 1)
        loss_sum, tokens = model.loss(ids, lbl)
        (loss_sum * step.backward_scale(tokens, accumulation=micro_batches, loss_scale=1.0)).backward()
        step.add_tokens(tokens)
        total, count = total + loss_sum.detach(), count + tokens
    return total, count


def train(layout: str):
    name, config, micro_batches, recompute, overlap, schedule = parse(layout)
    state, model, opt, step, runner = build(name, config, micro_batches, recompute, overlap, schedule)
    moe = CONFIGS[name].moe
    losses = []
    for input_ids, labels in batches():
        loss_sum, tokens = train_step(state, model, step, runner, input_ids, labels, micro_batches)
        step.finish(accumulation=1 if runner is not None else micro_batches, loss_scale=1.0)
        # As the strategy: the non-finite check measures the global norm, the clip reuses it.
        norm, _ = step.check_finite(opt.param_groups, step=len(losses), epoch=0)
        if config.zero_stage == 3:  # as strategy.step: ZeRO-3 clips its own shards
            step.sync.clip_grad_norm_(CLIP, norm=norm)
        else:
            step.clip(opt.param_groups, CLIP, norm=norm)
        opt.step()
        step.after_step()
        if moe.expert_bias:
            update_expert_biases(model, moe.expert_bias_update_rate, reduce=lambda t: _sum(t, state.data_parallel_group))
        totals = _sum(torch.stack([loss_sum.detach().float(), tokens.float()]), state.data_parallel_group)
        losses.append((totals[0] / totals[1]).item())
    if step.main_params is not None:
        step.main_params.wait_for_params()  # as the strategy does before reading weights (full_state_dict)
    weights = merge_pipeline_stages(gather_full_state_dict(model, state.tensor_parallel_group),
                                    state.pipeline_parallel_group)
    weights = merge_pipeline_stages(weights, state.expert_parallel_group if config.expert_parallel_size > 1 else None)
    step.remove()
    return losses, weights


def _sum(tensor, group):
    if group is not None:
        dist.all_reduce(tensor, group=group)
    return tensor


def generate_at(layout: str) -> dict:
    """Greedy generation with different prompts on every dp rank (different counts and lengths), with an eos that
    ends dp rank 0's whole batch (one prompt) at its first token: its expert-parallel peers go on, so it must keep
    stepping with them (their all-to-alls pair up); every rank gives the tokens of one process."""
    from lightning_megatron.generation import generate

    _, config, *_ = parse(layout.removeprefix("gen-").join(("moe-", "")))
    state, model, opt, step, runner = build("moe", config, 1)
    step.remove()
    torch.manual_seed(SEED)
    reference = GPTModel(CONFIGS["moe"]).eval()
    generator = torch.Generator().manual_seed(state.data_parallel_rank)
    lengths = (3,) if state.data_parallel_rank == 0 else (3 + state.data_parallel_rank, 5)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]
    first = generate(reference, prompts, max_new_tokens=1)
    eos = first[0][-1] if state.data_parallel_rank == 0 else 256
    expected = generate(reference, prompts, max_new_tokens=6, eos_id=eos)
    got = generate(model, prompts, max_new_tokens=6, eos_id=eos)
    return {"expected": expected, "got": got}


def count(layout: str) -> dict:
    """The collectives of one step's forward and of its backward, as ``"<kind>/<group>": calls`` (the group named
    as the layout names it: tp, ep, dp, pp, expert-dp; the first match, so ep == dp is named ep)."""
    _, config, *_ = parse(layout.removeprefix("count-").join(("moe-", "")))
    state, model, opt, step, runner = build("moe", config, 1)
    input_ids, labels = batches()[0]
    rows = slice(state.data_parallel_rank * GLOBAL_BATCH // config.data_parallel_size,
                 (state.data_parallel_rank + 1) * GLOBAL_BATCH // config.data_parallel_size)
    names = (("dp", state.data_parallel_group), ("expert-dp", state.expert_data_parallel_group),
             ("ep", state.expert_parallel_group), ("tp", state.tensor_parallel_group), ("pp", state.pipeline_parallel_group))
    step.sync.start_micro_batch(sync=False)  # no gradient reduction: only the layers' own communication
    collectives, syncs = {}, {}
    with CollectiveCounter(names) as calls:
        with count_host_syncs() as host:
            loss_sum, tokens = model.loss(input_ids[rows], labels[rows])
        collectives["forward"], syncs["forward"] = calls.take(), _moe_sites(host)
        with count_host_syncs() as host:
            loss_sum.backward()
        collectives["backward"], syncs["backward"] = calls.take(), _moe_sites(host)
    step.remove()
    return {"collectives": collectives, "host_syncs": syncs}


def _moe_sites(syncs) -> dict:
    """``"<kind> <file:line>": calls`` of the host syncs made in the MoE layers' code (router, experts, dispatcher)."""
    files = ("models/moe.py", "models/router.py", "models/experts.py", "expert_parallel/")
    return {f"{kind} {site}": n for kind, sites in syncs.sites.items() for site, n in sites.items()
            if any(name in site for name in files)}


def main(out_dir: Path, args: list[str]) -> None:
    layouts_job(out_dir, args[0].split(","), train, {"count-": count, "gen-": generate_at})


if __name__ == "__main__":
    run_script(main)
