"""Trainer.fit on every rank over memory-mapped corpora of two sizes, one after the other, launched by torchrun.

argv: OUT_DIR JSON_OPTIONS with ``corpora`` (data_prefix values, each trained on in turn), ``tp`` and ``steps``.
Rank r writes rank{r}.json: per corpus, its resident memory (anonymous and file-backed, from /proc) after the
run, which splits' indices this rank built, the samples of each step (row hashes, this rank's share), and the
consumed tokens per blended dataset that were logged.
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch.distributed as dist

from benchmarks.data import resident_kib  # the benchmark's reading of /proc: the test and it measure alike
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.data import GPTDataModule
from lightning_megatron.models import GPT, GPTConfig
from entry import run_script


def main(out_dir: Path, args: list[str]) -> None:
    options = json.loads(args[0])
    rank = int(os.environ["RANK"])

    class Record(L.Callback):
        def __init__(self):
            self.samples, self.logged = [], []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.samples.append([hash(tuple(row.tolist())) for row in batch["input_ids"]])

        # what the module logged at the end of a step (callbacks see a step's end before the module does)
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx:
                self._read(trainer)

        def on_train_end(self, trainer, pl_module):
            self._read(trainer)

        def _read(self, trainer):
            self.logged.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("consumed")})

    runs = []
    for data_prefix in options["corpora"]:
        L.seed_everything(3)
        record = Record()
        trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                            strategy=Megatron3DStrategy(tensor_parallel_size=options["tp"]), max_steps=options["steps"],
                            limit_val_batches=2, val_check_interval=options["steps"], num_sanity_val_steps=0, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[record])
        data = GPTDataModule(data_prefix=data_prefix, seq_length=32, global_batch_size=8, seed=5,
                             index_cache_dir=str(out_dir / "index_cache"))
        model = GPT(GPTConfig(vocab_size=257, max_seq_length=32, hidden_size=32, num_layers=2, num_heads=4),
                    learning_rate=3e-3, warmup_steps=2)
        trainer.fit(model, datamodule=data)
        built = {split: getattr(data, f"{split}_dataset") for split in ("train", "val")}
        built = {split: [part.cache.built_here for part in getattr(dataset, "datasets", [dataset])]
                 for split, dataset in built.items()}
        runs.append({"resident_kib": resident_kib(), "built": built, "samples": record.samples,
                     "logged": record.logged, "val_loss": float(trainer.callback_metrics["val_loss"])})
        dist.barrier()

    (out_dir / f"rank{rank}.json").write_text(json.dumps({"runs": runs}))
    dist.barrier()


if __name__ == "__main__":
    run_script(main, join=False)
