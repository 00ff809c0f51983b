"""One task of a 2-node x 2-task SLURM job, started by hand with the variables ``srun`` sets (no SLURM needed).

argv: OUT_DIR JSON_OPTIONS (``layouts``: a list of strategy options, each fitted by its own Trainer in this
process, one after the other). Before any of them, a Trainer whose ``devices`` disagree with SLURM's tasks per
node must fail here, before any process group exists. For each layout, the task reports the cluster environment
Lightning chose, the ranks the strategy read, the members of its tp/dp/pp groups and its training losses. It
writes rank{SLURM_PROCID}.json.
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch.distributed as dist

from trainer_setup import datamodule, model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy

out_dir, options = Path(sys.argv[1]), json.loads(sys.argv[2])
rank = int(os.environ["SLURM_PROCID"])
result: dict = {"environment": {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}}


class RecordLosses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def members(group) -> list[int]:
    return [dist.get_rank()] if group is None else dist.get_process_group_ranks(group)


def trainer(strategy, devices: int, num_nodes: int, callbacks=()) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy,
                     callbacks=list(callbacks), **trainer_kwargs(options))


# The mistaken job: SLURM runs 2 tasks per node, the Trainer is told 1 device per node.
mistaken = trainer(Megatron3DStrategy(tensor_parallel_size=2), devices=1, num_nodes=2)
try:
    mistaken.fit(model(options), datamodule=datamodule(options))
    result["mismatch"] = None
except ValueError as error:
    result["mismatch"] = str(error)
result["initialized_after_mismatch"] = dist.is_initialized()

result["layouts"] = []
for layout in options["layouts"]:
    L.seed_everything(7)
    strategy = Megatron3DStrategy(**layout, bucket_size_mb=0.01)
    record = RecordLosses()
    run = trainer(strategy, devices=2, num_nodes=2, callbacks=[record])
    run.fit(model(options), datamodule=datamodule(options))
    state = strategy.parallel_state
    result["layouts"].append({
        "cluster_environment": type(strategy.cluster_environment).__name__,
        "launcher": type(strategy.launcher).__name__,
        "global_rank": run.global_rank, "local_rank": run.local_rank, "node_rank": run.node_rank,
        "world_size": run.world_size, "dist_rank": dist.get_rank(), "dist_world_size": dist.get_world_size(),
        "tp": members(state.tensor_parallel_group), "dp": members(state.data_parallel_group),
        "pp": members(state.pipeline_parallel_group), "losses": record.losses,
    })
result["environment_after"] = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}
(out_dir / f"rank{rank}.json").write_text(json.dumps(result))
dist.barrier()
os._exit(0)  # skip gloo's C++ teardown (see the other workers)
