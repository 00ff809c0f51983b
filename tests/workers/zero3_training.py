"""ZeRO stage 3 (FSDP2 over dp) with tensor parallelism: train the tiny GPT under several layouts.

argv: OUT_DIR LAYOUTS, where LAYOUTS is a comma list of
``tp{T}-dp{D}[-sp][-mb{M}][-nosync][-pre][-sgd]``: M micro-batches per step (``-nosync``:
accumulate unsharded gradients and reduce-scatter only on the last; otherwise reduce-scatter
every micro-batch), ``-pre``: materialise the tp shards before sharding over dp (otherwise
``ZeRO3.initialize`` materialises only the dp chunks from the meta device), SGD with
momentum instead of AdamW. fp32 throughout. For each layout rank 0 writes the losses and the
full (gathered) weights to ``{layout}.pt``; the pytest process compares them with the
single-process reference. The first layout also checks that ``load_full_state_dict`` round-trips.
"""

import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from gpt_setup import CLIP, CONFIG, GLOBAL_BATCH, SEED, batches, optimizer, sgd_optimizer
from lightning_megatron.models import GPTModel
from lightning_megatron.optim.zero3 import apply_zero3, gather_full_state_dict, load_full_state_dict
from lightning_megatron.parallel import ParallelConfig, ParallelState, TensorParallelRNG
from lightning_megatron.parallel.initialize import initialize_parameters
from lightning_megatron.tensor_parallel import parallelize

LAYOUT = re.compile(r"tp(\d+)-dp(\d+)(-sp)?(?:-mb(\d+))?(-nosync)?(-pre)?(-sgd)?")


def build(state: ParallelState, pre: bool):
    with torch.device("meta"):
        model = GPTModel(CONFIG)
    rng = TensorParallelRNG(SEED, state.tensor_parallel_rank, torch.device("cpu"))
    parallelize(model, GPTModel.tensor_parallel_plan(), state, rng=rng)
    if pre:
        initialize_parameters(model, SEED, device="cpu", only_meta=True)
    zero3 = apply_zero3(model, state, layers_pattern="blocks.*")
    zero3.initialize(SEED, device="cpu")
    return model, zero3


def train(layout: str, check_load: bool):
    match = LAYOUT.fullmatch(layout)
    tp, dp, sp = int(match[1]), int(match[2]), bool(match[3])
    micro_batches, nosync, pre, sgd = int(match[4] or 1), bool(match[5]), bool(match[6]), bool(match[7])
    state = ParallelState.create(ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, sequence_parallel=sp), "cpu")
    model, zero3 = build(state, pre)
    params = list(model.parameters())
    assert all(type(p).__name__ == "DTensor" or "DTensor" in type(p.data).__name__ for p in params)
    opt = sgd_optimizer(params) if sgd else optimizer(params)
    losses = []
    for input_ids, labels in batches():
        rows = slice(state.data_parallel_rank * GLOBAL_BATCH // dp, (state.data_parallel_rank + 1) * GLOBAL_BATCH // dp)
        step_sum, step_tokens = torch.zeros(()), torch.zeros((), dtype=torch.long)
        chunks = list(zip(input_ids[rows].chunk(micro_batches), labels[rows].chunk(micro_batches)))
        for i, (ids, lbl) in enumerate(chunks):
            zero3.start_micro_batch(sync=not nosync or i == len(chunks) - 1)
            loss_sum, tokens = model.loss(ids, lbl)
            loss_sum.backward()
            step_sum, step_tokens = step_sum + loss_sum.detach(), step_tokens + tokens
        zero3.finish(step_tokens)
        zero3.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        totals = torch.stack([step_sum.float(), step_tokens.float()])
        if state.data_parallel_group is not None:
            dist.all_reduce(totals, group=state.data_parallel_group)
        losses.append((totals[0] / totals[1]).item())

    weights = gather_full_state_dict(model, state.tensor_parallel_group)
    load_ok = None
    if check_load:  # a fresh ZeRO-3 model at this layout takes the full weights back exactly
        fresh, fresh_zero3 = build(state, pre=False)
        load_full_state_dict(fresh, weights, state)
        again = gather_full_state_dict(fresh, state.tensor_parallel_group)
        load_ok = all(torch.equal(again[k], weights[k]) for k in weights)
    return losses, weights, load_ok


if __name__ == "__main__":
    out_dir, layouts = Path(sys.argv[1]), sys.argv[2].split(",")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    summary = {}
    for index, layout in enumerate(layouts):
        losses, weights, load_ok = train(layout, check_load=index == 0)
        if rank == 0:
            torch.save({"losses": losses, "weights": weights}, out_dir / f"{layout}.pt")
        summary[layout] = {"losses": losses, "load_ok": load_ok}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(summary))
    dist.barrier()
    os._exit(0)  # skip gloo's C++ teardown: with several meshes alive it aborts at random (torch 2.13)
