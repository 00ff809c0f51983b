"""Train 4 steps with a checkpoint every 2; the process is killed (SIGKILL) in the middle of the second save,
after its tensors are written and before the checkpoint is complete. argv: OUT_DIR."""

import os
import signal
import sys

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from trainer_setup import datamodule, model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.checkpoint import sharded

out_dir = sys.argv[1]
write_tensors = sharded.write_tensors


class CrashDuringTheSecondSave(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 3:
            def write_then_die(*args, **kwargs):
                write_tensors(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)

            sharded.write_tensors = write_then_die


L.seed_everything(7)
checkpoints = ModelCheckpoint(dirpath=out_dir, every_n_train_steps=2, save_top_k=1, monitor="step", mode="max",
                              save_last=True)
trainer = L.Trainer(accelerator="cpu", devices=1, strategy=Megatron3DStrategy(),
                    callbacks=[checkpoints, CrashDuringTheSecondSave()],
                    **{**trainer_kwargs({"steps": 4}), "enable_checkpointing": True, "limit_val_batches": 0})
trainer.fit(model({}), datamodule=datamodule({}))
