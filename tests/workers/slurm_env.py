"""One task of a 2-node x 2-task SLURM job, started by hand with the variables ``srun`` sets (no SLURM needed).

argv: OUT_DIR JSON_OPTIONS (``layouts``: a list of strategy options, each fitted by its own Trainer in this
process, one after the other). Before any of them, a Trainer whose ``devices`` disagree with SLURM's tasks per
node must fail here, before any process group exists. For each layout, the task reports the cluster environment
Lightning chose, the ranks the strategy read, the members of its tp/dp/pp groups and its training losses.
Then the time limit's warning: ``requeue_steps`` steps at tp=2 under ``SaveAndRequeue``, where only task
``signalled_task`` gets SIGUSR1 (during step 2), then a new Trainer resumes with ``ckpt_path="last"``; the task
reports the losses and the steps each run ended at. It writes rank{SLURM_PROCID}.json.
"""

import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch.distributed as dist

from trainer_setup import datamodule, model, trainer_kwargs
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_megatron import Megatron3DStrategy
from lightning_megatron.callbacks import SaveAndRequeue

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


class SignalOneTask(L.Callback):
    """SLURM signals every task, but each notices it at its own point of the step: here only one task does."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if rank == options["signalled_task"] and trainer.global_step == 1:
            os.kill(os.getpid(), signal.SIGUSR1)


def trainer(strategy, devices: int, num_nodes: int, callbacks=(), **overrides) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy,
                     callbacks=list(callbacks), **{**trainer_kwargs(options), **overrides})


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
requeue = {"losses": [], "stopped_at": [], "saved": None}
for ckpt_path, callbacks in ((None, [SaveAndRequeue(), SignalOneTask()]), ("last", [])):
    L.seed_everything(7)
    record = RecordLosses()
    checkpoints = ModelCheckpoint(dirpath=out_dir / "checkpoints", save_top_k=0)
    run = trainer(Megatron3DStrategy(tensor_parallel_size=2, bucket_size_mb=0.01), devices=2, num_nodes=2,
                  callbacks=[record, checkpoints, *callbacks], enable_checkpointing=True,
                  **{k: v for k, v in trainer_kwargs({**options, "steps": options["requeue_steps"]}).items()
                     if k in ("max_steps", "val_check_interval")})
    run.fit(model(options), datamodule=datamodule(options), ckpt_path=ckpt_path)
    requeue["losses"] += record.losses
    requeue["stopped_at"].append(run.global_step)
    if callbacks:
        requeue["saved"] = str(callbacks[0].saved)
        requeue["handler_restored"] = signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
result["requeue"] = requeue
result["environment_after"] = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}
(out_dir / f"rank{rank}.json").write_text(json.dumps(result))
dist.barrier()
os._exit(0)  # skip gloo's C++ teardown (see the other workers)
