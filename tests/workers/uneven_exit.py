"""A user's torchrun script whose ranks finish at different times (argv: OUT_DIR LAG): a tp=2 fit, then rank 1
works on for LAG seconds while rank 0 has nothing left to do. Each rank ends as a script does (no os._exit); an exit
handler registered before the fit (so it runs after the strategy's) writes rank<r>.json: whether the process groups
were still there and how long after the fit the rank left."""

import atexit
import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch.distributed as dist

from trainer_setup import datamodule, model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy

out_dir, lag, rank = Path(sys.argv[1]), float(sys.argv[2]), int(os.environ["RANK"])
ended: dict = {}


@atexit.register
def record() -> None:
    ended["left_after"] = time.monotonic() - ended["fit_end"]
    ended["groups_at_exit"] = dist.is_initialized()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(ended))


trainer = L.Trainer(accelerator="cpu", devices=2, strategy=Megatron3DStrategy(tensor_parallel_size=2),
                    **trainer_kwargs({"steps": 2}))
trainer.fit(model({}), datamodule=datamodule({}))
ended["fit_end"] = time.monotonic()
if rank == 1:
    time.sleep(lag)
