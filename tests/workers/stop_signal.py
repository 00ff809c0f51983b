"""Started as ``python stop_signal.py OUT_DIR SIGNAL`` with devices=2: Lightning's launcher (this process, rank 0)
starts a copy of the script as rank 1 (or under torchrun, which started both). At the start of step 3 the signal
comes: SIGTERM to rank 0 alone (``kill <pid>``; under torchrun: to torchrun, which passes it on), SIGINT to the
whole process group (Ctrl-C in a terminal).
Each rank writes rank<r>.json: the step it stopped at, the losses, and the exit code its fit ended with."""

import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from trainer_setup import datamodule, model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy

out_dir, signum = Path(sys.argv[1]), signal.Signals[sys.argv[2]]
SIGNAL_AT_STEP = 2


class SignalAtStep(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == SIGNAL_AT_STEP and trainer.global_rank == 0:
            if signum == signal.SIGINT:
                os.killpg(os.getpgid(0), signum)
            else:
                os.kill(os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid(), signum)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


record = SignalAtStep()
devices = int(os.environ.get("LOCAL_WORLD_SIZE", 2))
trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=Megatron3DStrategy(tensor_parallel_size=2),
                    callbacks=[record, ModelCheckpoint(dirpath=out_dir / "checkpoints", save_top_k=0)],
                    **{**trainer_kwargs({"steps": 6}), "enable_checkpointing": True})
result = {"exit_code": 0}
try:
    trainer.fit(model({}), datamodule=datamodule({}))
except SystemExit as stop:
    result["exit_code"] = stop.code
    raise
finally:
    result.update(stopped_at=trainer.global_step, losses=record.losses)
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
