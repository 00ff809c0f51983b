"""``fit(ckpt_path="last")`` under torchrun, saving last.ckpt after every step. argv: OUT_DIR CHECKPOINT_DIR STEPS.
Rank r writes rank{r}.json: the step it resumed at and its training losses."""

import json
import os
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from trainer_setup import datamodule, model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy
from entry import run_script


def main(out_dir: Path, args: list[str]) -> None:
    checkpoint_dir, steps = args[0], int(args[1])
    record = {"losses": []}

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module):
            record["resumed_at"] = trainer.global_step

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            record["losses"].append(float(outputs["loss"]))

    L.seed_everything(7)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=Megatron3DStrategy(tensor_parallel_size=int(os.environ["WORLD_SIZE"])),
                        callbacks=[Record(), ModelCheckpoint(dirpath=checkpoint_dir, every_n_train_steps=1, save_top_k=0,
                                                             save_last=True)],
                        **{**trainer_kwargs({"steps": steps}), "enable_checkpointing": True, "limit_val_batches": 0})
    trainer.fit(model({}), datamodule=datamodule({}), ckpt_path="last")
    (out_dir / f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    run_script(main, join=False)
