"""ZeRO-3 (dp2, FSDP2) of a model whose own buffers were set in ``__init__`` (``buffer_setup.BufferedGPT``, built
on the meta device as the strategy's ``configure_model`` does: meta parameters, buffers with values), with
uninitialised memory filled with NaN
(``torch.use_deterministic_algorithms`` + ``fill_uninitialized_memory``): ``ZeRO3.initialize`` empties the module
(``to_empty``) and must put the buffers' values back. Rank 0 writes the losses to ``rank0.json``.

argv: OUT_DIR
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist

from buffer_setup import BufferedGPT
from gpt_setup import CLIP, CONFIG, GLOBAL_BATCH, SEED, batches, optimizer
from lightning_megatron.optim.zero3 import apply_zero3
from lightning_megatron.parallel import ParallelConfig, ParallelState
from entry import run_script


def main(out_dir: Path, args: list[str]) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # torch.empty and to_empty give NaN
    state = ParallelState.create(ParallelConfig(data_parallel_size=2), "cpu")
    with torch.device("meta"):
        model = BufferedGPT(CONFIG)
    zero3 = apply_zero3(model, state, layers_pattern="blocks.*")
    zero3.initialize(SEED, device="cpu")
    opt = optimizer(list(model.parameters()))
    rows = slice(state.data_parallel_rank * GLOBAL_BATCH // 2, (state.data_parallel_rank + 1) * GLOBAL_BATCH // 2)
    losses = []
    for input_ids, labels in batches()[:3]:
        zero3.start_micro_batch(sync=True)
        loss_sum, tokens = model.loss(input_ids[rows], labels[rows])
        loss_sum.backward()
        zero3.finish(tokens)
        zero3.clip_grad_norm_(CLIP)
        opt.step()
        zero3.zero()
        totals = torch.stack([loss_sum.detach(), tokens.float()])
        dist.all_reduce(totals, group=state.data_parallel_group)
        losses.append((totals[0] / totals[1]).item())
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps({"losses": losses}))
    dist.barrier()


if __name__ == "__main__":
    run_script(main)
