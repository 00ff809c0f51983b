"""``Trainer.fit`` with ``num_nodes=2``, one torchrun per "node" (``launch.launch_nodes``).

argv: OUT_DIR JSON_OPTIONS. Options: ``tp``, ``pp``, ``steps`` (the schedule's length), ``stop_at`` (a
step to stop after, as a preempted run does); ``dirpath`` (a ``ModelCheckpoint`` saving
``last.ckpt`` after every step; relative paths are per node: each node runs in its own directory);
``ckpt_path``; after fit, ``local_save`` (a path ``trainer.save_checkpoint`` is tried at) and
``local_load`` (a checkpoint ``strategy.load_checkpoint`` is tried on). Rank r writes rank{r}.json: where it
runs (the launch it belongs to, Lightning's node and local rank, its global rank), the ranks of its tp, dp
and pp groups, the step it resumed at, its losses, and the error of each step that raised; rank 0 saves the
gathered weights to weights.pt.
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from trainer_setup import datamodule, model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy

out_dir, options = Path(sys.argv[1]), json.loads(sys.argv[2])
rank = int(os.environ["RANK"])
record = {"launch": int(os.environ["MULTINODE_LAUNCH"]), "global_rank": rank, "losses": [], "errors": {}}


def write_record() -> None:
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))


class Record(L.Callback):
    def on_train_start(self, trainer, pl_module):
        state = trainer.strategy.parallel_state
        record.update(node_rank=trainer.node_rank, local_rank=trainer.local_rank, resumed_at=trainer.global_step,
                      pipeline_rank=state.pipeline_parallel_rank,
                      groups={name: dist.get_process_group_ranks(group) if group is not None else [rank]
                              for name, group in (("tp", state.tensor_parallel_group),
                                                  ("dp", state.data_parallel_group),
                                                  ("pp", state.pipeline_parallel_group))})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        record["losses"].append(float(outputs["loss"]))
        if trainer.global_step == options.get("stop_at"):  # as if preempted: the same schedule, resumed later
            trainer.should_stop = True


def attempt(name: str, action) -> None:
    """Run ``action``; a ValueError/RuntimeError it raises is recorded under ``name`` (every rank must raise)."""
    try:
        action()
    except (ValueError, RuntimeError) as error:
        record["errors"][name] = f"{type(error).__name__}: {error}"


L.seed_everything(7)
callbacks = [Record()]
if "dirpath" in options:
    callbacks.append(ModelCheckpoint(dirpath=options["dirpath"], every_n_train_steps=1, save_top_k=0, save_last=True))
trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), num_nodes=2, callbacks=callbacks,
                    strategy=Megatron3DStrategy(tensor_parallel_size=options["tp"],
                                                pipeline_parallel_size=options.get("pp", 1)),
                    **{**trainer_kwargs(options), "enable_checkpointing": "dirpath" in options, "limit_val_batches": 0})
attempt("fit", lambda: trainer.fit(model(options), datamodule=datamodule(options), ckpt_path=options.get("ckpt_path")))
if "fit" in record["errors"]:  # every rank refused before any collective: nothing left to run together
    write_record()
    os._exit(0)
if "local_save" in options:
    attempt("local_save", lambda: trainer.save_checkpoint(options["local_save"]))
if "local_load" in options:
    attempt("local_load", lambda: trainer.strategy.load_checkpoint(options["local_load"]))
weights = trainer.strategy.full_state_dict()
if rank == 0:
    torch.save(weights, out_dir / "weights.pt")
write_record()
dist.barrier()
os._exit(0)  # skip gloo's C++ teardown (see the other workers)
