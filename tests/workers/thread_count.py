"""One of two processes on a node, in a one-step Trainer fit: reports torch's intra-op threads during the fit.

argv: OUT_DIR CORES [unset]. ``CORES``: the cores the launcher is told this node has (more than the test
machine's, so that each process's share differs from torch's and torchrun's defaults); ``unset``: start as
``srun`` starts a task, with no ``OMP_NUM_THREADS`` (removed before torch loads its OpenMP runtime).
Writes rank{global rank}.json: the threads and the ``OMP_NUM_THREADS`` the process saw.
"""

import os
import sys

if sys.argv[3:] == ["unset"]:
    os.environ.pop("OMP_NUM_THREADS", None)

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import lightning as L  # noqa: E402
import torch  # noqa: E402

import lightning_megatron.strategy.launcher as launcher  # noqa: E402
from lightning_megatron import Megatron3DStrategy  # noqa: E402
from trainer_setup import datamodule, model, trainer_kwargs  # noqa: E402

out_dir, cores = Path(sys.argv[1]), int(sys.argv[2])
omp = os.environ.get("OMP_NUM_THREADS")
launcher.available_cores = lambda: cores


class RecordThreads(L.Callback):
    def on_fit_start(self, trainer, pl_module):
        self.threads = torch.get_num_threads()


record = RecordThreads()
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=Megatron3DStrategy(), callbacks=[record],
                    **{**trainer_kwargs({"steps": 1}), "limit_val_batches": 0})
trainer.fit(model({}), datamodule=datamodule({}))
(out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps({"threads": record.threads, "omp": omp}))
