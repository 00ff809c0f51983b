"""Train 3 steps saving last.ckpt after every step; the process is killed (SIGKILL) during the third save,
between its two renames: the previous last.ckpt is already .last.ckpt.replaced, the new one still
.last.ckpt.partial (complete). argv: OUT_DIR."""

import os
import signal
import sys

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from trainer_setup import datamodule, model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy

out_dir = sys.argv[1]
rename = os.rename


class CrashDuringTheThirdSave(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 3:
            def rename_then_die(source, destination):
                rename(source, destination)
                if str(destination).endswith(".replaced"):
                    os.kill(os.getpid(), signal.SIGKILL)

            os.rename = rename_then_die


L.seed_everything(7)
checkpoints = ModelCheckpoint(dirpath=out_dir, every_n_train_steps=1, save_top_k=0, save_last=True)
trainer = L.Trainer(accelerator="cpu", devices=1, strategy=Megatron3DStrategy(),
                    callbacks=[CrashDuringTheThirdSave(), checkpoints],
                    **{**trainer_kwargs({"steps": 5}), "enable_checkpointing": True, "limit_val_batches": 0})
trainer.fit(model({}), datamodule=datamodule({}))
