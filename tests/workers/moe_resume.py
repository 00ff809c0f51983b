"""The tiny MoE GPT (``gpt_setup.MOE_CONFIGS[variant]``) under the real Trainer and ``Megatron3DStrategy``: several
fits one after another over the same 4 processes, each at its own (tp, ep) layout (dp = world / tp / pp), ZeRO-1
unless the run gives ``zero``; ``etp``: expert_tensor_parallel_size; ``pp``: pipeline stages (1 unless given).

argv: OUT_DIR JSON_OPTIONS: ``{"variant": "moe", "runs": [run, ...]}``, a run being ``{"name", "tp", "ep",
"steps"}`` (``steps``: the Trainer's max_steps) plus optionally ``variant`` (this run's, else the options'), ``stop_at`` (stop after that step, as an
interrupted run: its LR schedule and data index still span max_steps), ``save_every`` (sharded checkpoints into
OUT_DIR/{name}/) and ``ckpt_path`` (resume from it). After each run rank 0 writes ``{name}.pt``: its per-step
losses (of the global batch) and the full weights (gathered over tp and ep). A resumed run also writes, per rank,
``{name}_pieces{rank}.pt``: every tensor the rank holds right after the restore (weights, fp32 main pieces,
optimizer state) as (key, global offsets, tensor) rows, and saves its final state to ``{name}_final.ckpt`` (this
layout saves what it holds too). Rank r writes rank{r}.json: per run its losses and, per step, a checksum of the
global batch's samples; or the error it raised.
"""

import json
import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from gpt_setup import MOE_CONFIGS
from trainer_setup import held_pieces, trainer_kwargs
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.data import GPTDataModule
from lightning_megatron.models import GPT
from entry import run_script


def main(out_dir: Path, args: list[str]) -> None:
    options = json.loads(args[0])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    class Record(L.Callback):
        def __init__(self, name: str, resumed: bool, stop_at=None):
            self.name, self.resumed, self.stop_at, self.losses, self.samples = name, resumed, stop_at, [], []
            self.statistics = []  # the logged MoE statistics: load balancing, z-loss

        def on_train_start(self, trainer, pl_module):
            if not self.resumed:
                return
            rows = held_pieces(trainer)
            torch.save(rows, out_dir / f"{self.name}_pieces{rank}.pt")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))
            # Which samples the global batch held, in one number (every tp rank counts them: the same factor everywhere).
            self.samples.append(float(trainer.strategy.reduce(batch["input_ids"].double().pow(2).sum(), reduce_op="sum")))
            metrics = trainer.callback_metrics
            self.statistics.append([float(metrics[name]) for name in ("moe_load_balancing", "moe_z_loss", "moe_max_load")])
            if trainer.global_step == self.stop_at:  # an interrupted run: its schedule and data still span max_steps
                trainer.should_stop = True

    def fit(run: dict) -> tuple[list[float], list[float]]:
        L.seed_everything(7)
        strategy = Megatron3DStrategy(tensor_parallel_size=run["tp"], expert_parallel_size=run["ep"],
                                      zero_stage=run.get("zero", 1), expert_tensor_parallel_size=run.get("etp"),
                                      pipeline_parallel_size=run.get("pp", 1),
                                      bucket_size_mb=0.01)
        record = Record(run["name"], bool(run.get("ckpt_path")), run.get("stop_at"))
        callbacks = [record]
        if run.get("save_every"):
            callbacks.append(ModelCheckpoint(dirpath=out_dir / run["name"], every_n_train_steps=run["save_every"],
                                             save_top_k=-1))
        kwargs = {**trainer_kwargs({"steps": run["steps"]}), "enable_checkpointing": bool(run.get("save_every")),
                  "limit_val_batches": 0}
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, callbacks=callbacks, **kwargs)
        # adam_eps 1e-6 as trainer_setup's (AdamW turns rounding noise in near-zero gradients into updates otherwise).
        model = GPT(MOE_CONFIGS[run.get("variant", options.get("variant", "moe"))], learning_rate=3e-3, warmup_steps=2,
                    adam_eps=1e-6)
        data = GPTDataModule(seq_length=16, global_batch_size=8, max_files=24, seed=3, split="80,10,10")
        trainer.fit(model, datamodule=data, ckpt_path=run.get("ckpt_path"))
        weights = trainer.strategy.full_state_dict()
        if rank == 0:
            torch.save({"losses": record.losses, "weights": weights}, out_dir / f"{run['name']}.pt")
        if run.get("ckpt_path"):
            trainer.save_checkpoint(out_dir / f"{run['name']}_final.ckpt")
        return record.losses, record.samples, record.statistics

    result = {}
    for run in options["runs"]:
        try:
            result[run["name"]] = dict(zip(("losses", "samples", "statistics"), fit(run)))
        except (OSError, RuntimeError, ValueError) as error:  # every rank reports; the runs after it still run
            result[run["name"]] = {"error": f"{type(error).__name__}: {error}"}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    run_script(main, join=False)
