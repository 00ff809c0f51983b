"""Train the tiny GPT for a few steps under several layouts over the same processes.

argv: OUT_DIR LAYOUTS, where LAYOUTS is a comma list of ``tp{T}-dp{D}[-sp][-mb{M}]``
(M micro-batches per step). For each layout, rank 0 writes the losses and the full
(gathered) weights to ``{layout}.pt``; the pytest process compares them with a
single-process reference.
"""

import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from gpt_setup import CLIP, CONFIG, SEED, batches, optimizer
from lightning_megatron.checkpoint import gather_full_state_dict
from lightning_megatron.models import GPTModel
from lightning_megatron.optim import GradientSynchronizer, clip_grads_by_global_norm
from lightning_megatron.parallel import ParallelConfig, ParallelState, TensorParallelRNG
from lightning_megatron.parallel.initialize import initialize_parameters
from lightning_megatron.tensor_parallel import parallelize

out_dir, layouts = Path(sys.argv[1]), sys.argv[2].split(",")
dist.init_process_group("gloo")
rank = dist.get_rank()
summary = {}

for layout in layouts:
    match = re.fullmatch(r"tp(\d+)-dp(\d+)(-sp)?(?:-mb(\d+))?", layout)
    tp, dp, sp, micro_batches = int(match[1]), int(match[2]), bool(match[3]), int(match[4] or 1)
    state = ParallelState.create(ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, sequence_parallel=sp), "cpu")
    tp_group, dp_group = state.tensor_parallel_group, state.data_parallel_group

    with torch.device("meta"):
        model = GPTModel(CONFIG)
    rng = TensorParallelRNG(SEED, state.tensor_parallel_rank, torch.device("cpu"))
    parallelize(model, GPTModel.tensor_parallel_plan(), state, rng=rng)
    initialize_parameters(model, SEED, device="cpu", only_meta=True)
    params = list(model.parameters())
    opt = optimizer(params)
    sync = GradientSynchronizer(params, data_parallel_group=dp_group, tensor_parallel_group=tp_group, bucket_size_mb=0.01)

    losses = []
    for input_ids, labels in batches():
        local = slice(state.data_parallel_rank * len(input_ids) // dp, (state.data_parallel_rank + 1) * len(input_ids) // dp)
        step_sum, step_tokens = torch.zeros(()), torch.zeros((), dtype=torch.long)
        for i, (ids, lbl) in enumerate(zip(input_ids[local].chunk(micro_batches), labels[local].chunk(micro_batches))):
            sync.start_micro_batch(sync=i == micro_batches - 1)
            loss_sum, tokens = model.loss(ids, lbl)
            loss_sum.backward()
            step_sum, step_tokens = step_sum + loss_sum.detach(), step_tokens + tokens
        sync.finish(step_tokens)
        clip_grads_by_global_norm(params, CLIP, model_parallel_group=tp_group, is_first_tensor_rank=state.tensor_parallel_rank == 0)
        opt.step()
        sync.zero()
        totals = torch.stack([step_sum, step_tokens.float()])
        if dp_group is not None:
            dist.all_reduce(totals, group=dp_group)
        losses.append((totals[0] / totals[1]).item())

    weights = gather_full_state_dict(model, tp_group)
    sync.remove()
    if rank == 0:
        torch.save({"losses": losses, "weights": weights}, out_dir / f"{layout}.pt")
    summary[layout] = losses

(out_dir / f"rank{rank}.json").write_text(json.dumps(summary))
dist.barrier()
os._exit(0)  # skip gloo's C++ teardown: with several meshes alive it aborts at random (torch 2.13)
