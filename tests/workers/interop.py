"""Lightning features under ``Megatron3DStrategy``, on 4 ranks, one scenario after another.

argv: OUT_DIR. Rank r writes rank{r}.json with, per scenario:

* ``swa`` / ``anomaly`` (first, before any process group exists): the error each rank raised for
  StochasticWeightAveraging and Trainer(detect_anomaly=True) at tp2 x pp2, and whether torch.distributed
  was initialised by then.
* ``bf16`` (tp2 x dp2, bf16-true): the logged val_loss / val_perplexity, the dtype of the metric's state, and
  every (per-batch loss, tokens) pair this rank fed the metric.
* ``pp2`` (pp2 x dp2), ``one_fit`` (tp2 x pp2, 4 steps): what the ModelSummary callback computes, and the
  summary of every module.
* ``refit``: ``one_fit``'s module (split, trained for 4 steps) fitted again by a new Trainer (and strategy)
  from ``one_fit``'s step-2 checkpoint: ``one_fit``'s first 2 losses and this fit's, to compare with ``one_fit``'s.
* per trained fit, in order: this rank's ``strategy.model_state_bytes``.
"""

import json
import os
from pathlib import Path

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, StochasticWeightAveraging

from trainer_setup import datamodule, model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.strategy.summary import GlobalModelSummary
from entry import run_script


def main(out_dir: Path, args: list[str]) -> None:
    rank = int(os.environ["RANK"])
    result: dict = {"model_state_bytes": []}

    class Record(L.Callback):
        """Training losses, and what the ModelSummary callback computes (a collective: every rank builds it)."""

        def __init__(self):
            self.losses, self.summary = [], None

        def on_fit_start(self, trainer, pl_module):
            summaries = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]
            if summaries:
                summary = summaries[0]._summary(trainer, pl_module)
                every_module = GlobalModelSummary(pl_module, max_depth=-1,
                                                  pipeline_group=trainer.strategy.parallel_state.pipeline_parallel_group)
                self.summary = {"total": summary.total_parameters, "trainable": summary.trainable_parameters,
                                "rows": dict(zip(summary.layer_names, summary.param_nums)),
                                "every_module": list(zip(every_module.layer_names, every_module.param_nums))}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

    def fit(options, *, precision="32-true", callbacks=(), gpt=None, ckpt_path=None, **overrides):
        L.seed_everything(7)
        strategy = Megatron3DStrategy(tensor_parallel_size=options.get("tp", 1),
                                      pipeline_parallel_size=options.get("pp", 1), bucket_size_mb=0.01)
        record = Record()
        trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, precision=precision,
                            callbacks=[record, *callbacks], **{**trainer_kwargs(options), **overrides})
        gpt = gpt if gpt is not None else model(options)
        trainer.fit(gpt, datamodule=datamodule(options), ckpt_path=ckpt_path)
        result["model_state_bytes"].append(strategy.model_state_bytes)
        return trainer, gpt, record

    def refused(name, options, **trainer_options):
        try:
            fit(options, **trainer_options)
        except (ValueError, RuntimeError) as error:
            result[name] = {"error": str(error), "distributed_initialized": dist.is_initialized()}
        else:
            result[name] = {"error": None}

    # Refused before any collective: these run first, so no process group exists yet when they raise.
    PIPELINE = {"tp": 2, "pp": 2, "layers": 4}
    refused("swa", PIPELINE, callbacks=[StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)], max_epochs=3,
            max_steps=-1, limit_train_batches=2, val_check_interval=None)
    refused("anomaly", PIPELINE, detect_anomaly=True)

    # bf16-true: the validation metric accumulates in fp32.
    fed = []
    options = {"tp": 2}
    gpt = model(options)
    metric_update = gpt.val_loss.update

    def recording_update(value, weight):
        fed.append((float(value.double()), float(weight)))
        return metric_update(value, weight=weight)

    gpt.val_loss.update = recording_update
    trainer, gpt, record = fit(options, precision="bf16-true", gpt=gpt, enable_model_summary=True)
    result["bf16"] = {"val_loss": float(trainer.callback_metrics["val_loss"]),
                      "val_perplexity": float(trainer.callback_metrics["val_perplexity"]),
                      "state_dtype": str(gpt.val_loss.mean_value.dtype), "metric_dtype": str(gpt.val_loss.dtype),
                      "fed": fed, "summary": record.summary, "options": options,
                      "dp_rank": trainer.strategy.parallel_state.data_parallel_rank,
                      "tp_rank": trainer.strategy.parallel_state.tensor_parallel_rank}

    options = {"pp": 2, "layers": 4, "steps": 1}
    _, _, record = fit(options, enable_model_summary=True, limit_val_batches=0)
    result["pp2"] = {"summary": record.summary, "options": options}

    # A second fit of the (already split) module by a new Trainer and strategy, from the first fit's step-2
    # checkpoint, continues as the first fit did.
    options = {**PIPELINE, "steps": 4}
    saves = ModelCheckpoint(dirpath=out_dir, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    _, gpt, record = fit(options, callbacks=[saves], enable_model_summary=True, enable_checkpointing=True)
    result["one_fit"] = {"summary": record.summary, "options": options, "losses": record.losses}
    _, _, second = fit(options, gpt=gpt, ckpt_path=str(out_dir / "step=2.ckpt"))
    result["refit"] = {"losses": record.losses[:2] + second.losses}

    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    run_script(main, join=False)
