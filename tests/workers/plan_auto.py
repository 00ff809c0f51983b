"""``Megatron3DStrategy(tensor_parallel_size="auto", pipeline_parallel_size="auto")`` on 2 ranks.

argv: OUT_DIR. Rank r writes rank{r}.json with:

* ``too_big`` (first, before any process group exists): the error every rank raised for a 70B-parameter GPT whose
  "auto" sizes fit no layout of 2 CPU processes, and whether torch.distributed was initialised by then;
* ``chosen``: the sizes the planner chose for the Trainer worker's tiny GPT, the strategy's layout after setup, the
  message it logged, and the losses of the 2 steps it then trained.
"""

import json
import os
from pathlib import Path

import lightning as L
import torch.distributed as dist

from trainer_setup import datamodule, model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.models import GPT, GPTConfig
from entry import run_script


def main(out_dir: Path, args: list[str]) -> None:
    rank = int(os.environ["RANK"])
    result = {}

    class Losses(L.Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

    def fit(module, **strategy_args):
        strategy = Megatron3DStrategy(**strategy_args, bucket_size_mb=0.01)
        losses = Losses()
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, callbacks=[losses],
                            **trainer_kwargs({"steps": 2}))
        trainer.fit(module, datamodule=datamodule({}))
        return strategy, losses.losses

    huge = GPT(GPTConfig(vocab_size=128256, max_seq_length=32, hidden_size=8192, num_layers=80, num_heads=64,
                         num_query_groups=8, ffn_hidden_size=28672))
    try:
        fit(huge, tensor_parallel_size="auto", pipeline_parallel_size="auto")
    except ValueError as error:
        result["too_big"] = {"error": str(error), "distributed_initialized": dist.is_initialized()}
    else:
        result["too_big"] = {"error": None}

    strategy, losses = fit(model({"layers": 4}), tensor_parallel_size="auto", pipeline_parallel_size="auto")
    config = strategy.parallel_config
    result["chosen"] = {"sizes": strategy.auto_choice.sizes, "message": strategy.auto_choice.message, "losses": losses,
                        "layout": [config.tensor_parallel_size, config.pipeline_parallel_size, config.data_parallel_size]}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    run_script(main, join=False)
