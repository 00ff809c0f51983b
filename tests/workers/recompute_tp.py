"""Recomputation under tensor parallelism (2 ranks): full and selective equal no recomputation.

Dropout is on, so the per-tp-rank stream of TensorParallelRNG is drawn from (attention
dropout always; every dropout of a layer under sequence parallelism). For sequence
parallelism off and on, each rank builds the model as the strategy does (meta, parallelize
with an rng, initialise) once per mode and writes to rank{r}.json the largest deviation of
its losses and local gradients from the no-recomputation run. A control run of "full"
without replaying the tracker shows that the comparison can see wrong masks.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist

from recompute_setup import CONFIG, LAYERS, SEED, max_deviation, two_steps, without_tracker_replay
from lightning_megatron.models import GPTModel
from lightning_megatron.parallel import ParallelConfig, ParallelState, TensorParallelRNG
from lightning_megatron.parallel.initialize import initialize_parameters
from lightning_megatron.tensor_parallel import parallelize
from lightning_megatron.transforms import recompute
from entry import run_script


def build(state: ParallelState, mode: str) -> GPTModel:
    with torch.device("meta"):
        model = GPTModel(CONFIG)
    rng = TensorParallelRNG(SEED, state.tensor_parallel_rank, torch.device("cpu"))
    parallelize(model, model.tensor_parallel_plan(), state, rng=rng)
    recompute.apply_activation_checkpointing(model, mode=mode, layer_pattern=LAYERS, rng=rng)
    initialize_parameters(model, SEED, device="cpu", only_meta=True)
    return model


def main(out_dir: Path, args: list[str]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for sequence_parallel in (False, True):
        state = ParallelState.create(ParallelConfig(tensor_parallel_size=world, sequence_parallel=sequence_parallel), "cpu")
        reference = two_steps(build(state, "none"))
        layout = "tp2-sp" if sequence_parallel else "tp2"
        results[layout] = {mode: max_deviation(two_steps(build(state, mode)), reference) for mode in ("full", "selective")}
        with without_tracker_replay():
            control = build(state, "full")
        results[layout]["full_without_tracker_replay"] = max_deviation(two_steps(control), reference)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()


if __name__ == "__main__":
    run_script(main)
