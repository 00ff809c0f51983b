"""Two fits one after the other in one script, on one checkpoint folder, under torchrun: the second resumes the
first's ``last.ckpt``. Global rank zero lingers in the first fit's ``on_fit_end`` (as ``SaveAndRequeue`` does
while ``scontrol`` runs), so the other ranks reach the second fit's start first. argv: OUT_DIR CHECKPOINT_DIR.
Rank r writes rank{r}.json: each fit's first step and training losses."""

import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from trainer_setup import datamodule, model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy

out_dir, checkpoint_dir = Path(sys.argv[1]), sys.argv[2]
world = int(os.environ["WORLD_SIZE"])
fits = []


class Record(L.Callback):
    def on_train_start(self, trainer, pl_module):
        fits.append({"started_at": trainer.global_step, "losses": []})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        fits[-1]["losses"].append(float(outputs["loss"]))

    def on_fit_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            time.sleep(2.0)


for steps, ckpt_path in ((2, None), (4, "last")):
    L.seed_everything(7)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=Megatron3DStrategy(tensor_parallel_size=world),
                        callbacks=[Record(), ModelCheckpoint(dirpath=checkpoint_dir, save_top_k=0, save_last=True)],
                        **{**trainer_kwargs({"steps": steps}), "enable_checkpointing": True, "limit_val_batches": 0})
    trainer.fit(model({}), datamodule=datamodule({}), ckpt_path=ckpt_path)
(out_dir / f"rank{os.environ['RANK']}.json").write_text(json.dumps(fits))
dist.barrier()
os._exit(0)  # skip gloo's C++ teardown (see the other workers)
