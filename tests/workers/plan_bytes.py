"""What ``strategy.model_state_bytes`` reports after the first step, for many layouts over the same 4 ranks.

argv: OUT_DIR LAYOUTS (a comma list of ``tests/test_plan.py``'s ``BYTE_LAYOUTS`` keys). Each layout is one
``Trainer.fit`` of one step; rank r writes rank{r}.json: per layout, its (pp, dp, cp, tp) coordinates, the
strategy's ``model_state_bytes`` and its parameters' elements, frozen and trainable.
"""

import json
import os
from pathlib import Path

import lightning as L

from plan_layouts import BYTE_LAYOUTS, byte_model
from trainer_setup import datamodule, trainer_kwargs
from lightning_megatron import Megatron3DStrategy
from entry import run_script


def main(out_dir: Path, args: list[str]) -> None:
    keys = args[0].split(",")
    rank = int(os.environ["RANK"])
    results = {}
    for key in keys:
        case = BYTE_LAYOUTS[key]
        L.seed_everything(7)
        strategy = Megatron3DStrategy(**case["strategy"], bucket_size_mb=case.get("bucket_size_mb", 0.01))
        trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, precision=case["precision"],
                            **trainer_kwargs({"steps": 1}))
        trainer.fit(byte_model(case), datamodule=datamodule({}))
        state = strategy.parallel_state
        params = list(dict.fromkeys(trainer.lightning_module.parameters()))
        results[key] = {"coordinates": [state.pipeline_parallel_rank, state.data_parallel_rank,
                                        state.context_parallel_rank, state.tensor_parallel_rank],
                        "bytes": strategy.model_state_bytes,
                        "elements": {"frozen": sum(p.numel() for p in params if not p.requires_grad),
                                     "trainable": sum(p.numel() for p in params if p.requires_grad)}}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    run_script(main, join=False)
