"""Throughput callbacks in real ``Trainer.fit`` runs, several layouts one after another, launched by torchrun.

argv: OUT_DIR JSON_OPTIONS with ``layouts`` (each: name, tp, pp, accumulate, micro_batch_size), ``steps``,
``peak_flops``, ``durations`` (the seconds step k takes on the step clock: ``durations[k - 1]``) and ``clock``
(``"steps"``: that clock, ``"real"``: ``time.perf_counter``). Each fit runs ``TokenThroughput`` and Lightning's
``ThroughputMonitor`` side by side on a layout's ``model``: ``"lightning_style"`` (the default), a GPT whose
``flops_per_batch`` is the model FLOPs of one rank's batch, as Lightning's docs compute it; ``"gpt"`` and
``"bert"``, the provided modules as they are. Rank r writes rank{r}.json: per layout, every metrics dict the
loggers received (Lightning's monitor logs from rank 0 only), the progress-bar keys and the sizes.
"""

import json
import os
import time
from pathlib import Path

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.loggers.logger import Logger

from bert_setup import fit_datamodule, fit_model
from trainer_setup import datamodule
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.callbacks import TokenThroughput
from lightning_megatron.models import GPT, GPTConfig
from lightning_megatron.models.flops import gpt_flops_per_batch
from entry import run_script


def main(out_dir: Path, args: list[str]) -> None:
    options = json.loads(args[0])
    rank = int(os.environ["RANK"])
    SEQ_LENGTH = 32  # trainer_setup.datamodule's

    class LightningStyleGPT(GPT):
        """``flops_per_batch`` as Lightning's ThroughputMonitor wants it: a number, the model FLOPs of this rank's batch."""

        @property
        def flops_per_batch(self) -> int:
            return gpt_flops_per_batch(self.config, self.trainer.datamodule.per_rank_batch_size, SEQ_LENGTH)

    class StepClock:
        """A deterministic clock: step k of the run takes ``durations[k - 1]`` seconds, everything else none."""

        def __init__(self, durations):
            self.durations, self.trainer = durations, None

        def __call__(self) -> float:
            return float(sum(self.durations[:self.trainer.global_step]))

    class RecordingLogger(Logger):
        """Keeps every metrics dict it is given, on every rank."""

        def __init__(self):
            super().__init__()
            self.records = []

        @property
        def name(self):
            return "recording"

        @property
        def version(self):
            return 0

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            self.records.append({key: float(value) for key, value in metrics.items()})

    results = {}
    for layout in options["layouts"]:
        L.seed_everything(7)
        clock = StepClock(options["durations"]) if options["clock"] == "steps" else time.perf_counter
        accumulate = layout.get("accumulate", 1)
        ours = TokenThroughput(clock=clock, peak_flops=options["peak_flops"])
        lightnings = ThroughputMonitor(batch_size_fn=lambda batch: batch["input_ids"].shape[0],
                                       length_fn=lambda batch: batch["input_ids"].numel(), window_size=accumulate + 1)
        logger = RecordingLogger()
        strategy = Megatron3DStrategy(tensor_parallel_size=layout["tp"], pipeline_parallel_size=layout.get("pp", 1),
                                      micro_batch_size=layout.get("micro_batch_size", 1))
        trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                            callbacks=[ours, lightnings], logger=logger, log_every_n_steps=1, max_steps=options["steps"],
                            accumulate_grad_batches=accumulate, limit_val_batches=0, num_sanity_val_steps=0,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        if isinstance(clock, StepClock):
            clock.trainer = trainer
        config = GPTConfig(vocab_size=257, max_seq_length=SEQ_LENGTH, hidden_size=32, num_layers=2, num_heads=4)
        kind = layout.get("model", "lightning_style")
        if kind == "bert":
            module, data = fit_model(), fit_datamodule()
        else:
            module_class = LightningStyleGPT if kind == "lightning_style" else GPT
            module, data = module_class(config, learning_rate=3e-3, warmup_steps=2), datamodule({})
        trainer.fit(module, datamodule=data)
        results[layout["name"]] = {
            "records": logger.records, "progress_bar": sorted(trainer.progress_bar_metrics),
            "per_rank_batch": data.per_rank_batch_size, "dp": trainer.strategy.parallel_config.data_parallel_size,
            "world_size": trainer.world_size, "accumulate": accumulate, "seq_length": data.seq_length,
        }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()


if __name__ == "__main__":
    run_script(main, join=False)
