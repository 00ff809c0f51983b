"""The full state dict gathered onto rank 0 alone (``checkpoint.full.gather_full_state_dict_on_rank_zero``, what
``checkpoint_format="full"`` saves) against the every-rank gather it replaces, on 4 ranks.

argv: OUT_DIR LAYOUTS, a comma list of ``tp2-pp2`` (GPT, its embedding tied across the two stages), ``pp2-dp2``
(dp replicas), ``llama-tp2-dp2-zero3`` (query-group shards, FSDP2 row chunks). For each layout rank 0 saves both
dicts with ``torch.save`` (``{layout}-new.pt``, ``{layout}-old.pt``); every rank reports the bytes of tensor data
each gather allocated (``allocation_meter.AllocationMeter``), the bytes of its own shards, and what it got back.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from allocation_meter import AllocationMeter
from gpt_setup import CONFIGS
from layout_invariance import build
from zero3_training import build as build_zero3
from lightning_megatron.checkpoint.full import (gather_full_state_dict, gather_full_state_dict_on_rank_zero,
                                                merge_pipeline_stages)
from lightning_megatron.parallel import ParallelConfig, ParallelState
from lightning_megatron.strategy.options import StrategyOptions
from entry import run_script

LAYOUTS = {"tp2-pp2": ("gpt", dict(tensor_parallel_size=2, pipeline_parallel_size=2), False),
           "pp2-dp2": ("gpt", dict(pipeline_parallel_size=2, data_parallel_size=2), False),
           "llama-tp2-dp2-zero3": ("llama", dict(tensor_parallel_size=2, data_parallel_size=2), True)}


def measured(gather):
    with AllocationMeter() as meter:
        result = gather()
    return result, meter.bytes


def tensor_bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def main(out_dir: Path, args: list[str]) -> None:
    layouts = args[0].split(",")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    summary = {}
    for layout in layouts:
        model_name, sizes, zero3 = LAYOUTS[layout]
        state = ParallelState.create(ParallelConfig(**sizes), "cpu")
        if zero3:
            model = build_zero3(state, pre=False, config=CONFIGS[model_name])[0]
        else:
            model = build(state, StrategyOptions(**sizes), {"model": model_name})[0]
        own = {name: (v.to_local() if isinstance(v, DTensor) else v) for name, v in model.state_dict().items()}
        new, new_bytes = measured(lambda: gather_full_state_dict_on_rank_zero(model, "cpu"))
        old, old_bytes = measured(lambda: merge_pipeline_stages(
            gather_full_state_dict(model, state.tensor_parallel_group), state.pipeline_parallel_group))
        if rank == 0:
            torch.save(new, out_dir / f"{layout}-new.pt")
            torch.save(old, out_dir / f"{layout}-old.pt")
        summary[layout] = {"new_keys": len(new), "new_bytes": new_bytes, "old_bytes": old_bytes,
                           "own_bytes": tensor_bytes(own), "full_bytes": tensor_bytes(old)}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(summary))
    dist.barrier()


if __name__ == "__main__":
    run_script(main)
