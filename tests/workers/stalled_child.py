"""Started as ``python stalled_child.py OUT_DIR`` with devices=2: Lightning's launcher (this process, rank 0)
starts a copy of the script as rank 1. Each rank writes rank<r>.pid at its first step; rank 1 then sleeps
far outside any collective, as a rank busy loading data or stuck would."""

import os
import sys
import time
from pathlib import Path

import lightning as L

from trainer_setup import datamodule, model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy

out_dir = Path(sys.argv[1])


class WritePidThenStall(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        (out_dir / f"rank{trainer.global_rank}.pid").write_text(str(os.getpid()))
        if trainer.global_rank == 1:
            time.sleep(300)


trainer = L.Trainer(accelerator="cpu", devices=2, strategy=Megatron3DStrategy(), callbacks=[WritePidThenStall()],
                    **trainer_kwargs({"steps": 3}))
trainer.fit(model({}), datamodule=datamodule({}))
