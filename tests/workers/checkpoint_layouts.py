"""Train under one layout, saving sharded checkpoints, or resume one saved under another layout.

argv: OUT_DIR JSON_OPTIONS with tp, pp, zero_stage, steps, layers and optionally mtp (multi-token prediction depths:
its logged ``mtp_loss`` per step joins the losses in rank{r}.json), vpp, cp, async (save in the
background), offload ("cpu" or "nvme": the optimizer's tier; nvme's files under OUT_DIR/offload, in tiles of 1000
elements), save_every (steps between
checkpoints, into OUT_DIR/checkpoints), ckpt_path (resume from it) and snapshot_step (gather the full
weights after that step into weights_step{N}.pt). Rank r writes rank{r}.json (losses); after a resume
it also writes pieces{r}.pt: every tensor it holds after the restore, as (key, global offsets, tensor)
rows, for the test to compare with the checkpoint. Rank 0 writes the final full weights to weights.pt.
After a resume the final state is also saved to final.ckpt. A rank that fails to load writes
{"error": ...} instead.
"""

import json
import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from trainer_setup import datamodule, held_pieces, model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy
from entry import run_script


def main(out_dir: Path, args: list[str]) -> None:
    options = json.loads(args[0])
    rank = int(os.environ["RANK"])
    losses, mtp_losses = [], []

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module):
            if not options.get("ckpt_path"):
                return
            rows = held_pieces(trainer)
            torch.save(rows, out_dir / f"pieces{rank}.pt")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))  # the global batch's
            if "mtp" in options:
                mtp_losses.append(float(trainer.callback_metrics["mtp_loss"]))
            if trainer.global_step == options.get("snapshot_step"):
                weights = trainer.strategy.full_state_dict()
                if rank == 0:
                    torch.save(weights, out_dir / f"weights_step{trainer.global_step}.pt")

    L.seed_everything(7)
    vpp = options.get("vpp", 1)
    strategy = Megatron3DStrategy(tensor_parallel_size=options["tp"], pipeline_parallel_size=options["pp"],
                                  virtual_pipeline_size=vpp, pipeline_schedule="interleaved_1f1b" if vpp > 1 else "1f1b",
                                  zero_stage=options["zero_stage"], context_parallel_size=options.get("cp", 1),
                                  bucket_size_mb=0.01, async_checkpoint=options.get("async", False),
                                  offload_optimizer=options.get("offload", False),
                                  offload_path=str(out_dir / "offload") if options.get("offload") == "nvme" else None,
                                  offload_buffer_mb=1000 * 4 / 2**20)
    callbacks = [Record()]
    if options.get("save_every"):
        callbacks.append(ModelCheckpoint(dirpath=out_dir / "checkpoints", every_n_train_steps=options["save_every"],
                                         save_top_k=-1))
    kwargs = {**trainer_kwargs(options), "enable_checkpointing": bool(options.get("save_every")), "limit_val_batches": 0}
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, callbacks=callbacks,
                        **kwargs)
    try:
        trainer.fit(model(options), datamodule=datamodule(options), ckpt_path=options.get("ckpt_path"))
    except (OSError, RuntimeError, ValueError) as error:  # a damaged checkpoint: every rank must say so, none hang
        (out_dir / f"rank{rank}.json").write_text(json.dumps({"error": f"{type(error).__name__}: {error}"}))
        return
    weights = trainer.strategy.full_state_dict()
    if rank == 0:
        torch.save(weights, out_dir / "weights.pt")
    if options.get("ckpt_path"):  # saving works at this layout too
        trainer.save_checkpoint(out_dir / "final.ckpt")
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"losses": losses, "global_step": trainer.global_step,
                                                          "mtp_losses": mtp_losses}))
    dist.barrier()


if __name__ == "__main__":
    run_script(main, join=False)
