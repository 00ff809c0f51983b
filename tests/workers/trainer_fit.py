"""A full ``Trainer.fit`` under ``Megatron3DStrategy``, launched by torchrun.

argv: OUT_DIR JSON_OPTIONS [JSON_OPTIONS...] (several: one fit after another, fit i's files in OUT_DIR/fit{i}). Rank r writes rank{r}.json with its per-step training losses,
the validation losses and the error it raised (if any); rank 0 also saves the gathered
weights to weights.pt and a Lightning checkpoint to last.ckpt. ``save_at_step``: also a checkpoint
``step{k}.ckpt`` right after optimizer step k; ``late_rank``: that rank reaches every optimizer step
0.2 s late, so that the other ranks' parameter gathers (``overlap_param_gather``) are still in flight
when they go on to save, validate or run the next forward.
"""

import json
import os
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from trainer_setup import PREDICT_GENERATION, PREDICT_PROMPTS, datamodule, model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.callbacks import PipelineTimeline
from entry import run_script


def main(out_dir: Path, args: list[str]) -> None:
    if len(args) > 1:  # several fits, one after another in this process: fit i's files in OUT_DIR/fit{i}
        for number, arg in enumerate(args):
            (out_dir / f"fit{number}").mkdir(exist_ok=True)
            main(out_dir / f"fit{number}", [arg])
        return
    options = json.loads(args[0])
    rank = int(os.environ["RANK"])
    losses, val_losses = [], []

    class RecordLosses(L.Callback):
        saved = False

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))
            if trainer.global_step == options.get("save_at_step") and not self.saved:
                self.saved = True
                trainer.save_checkpoint(out_dir / f"step{trainer.global_step}.ckpt")

        def on_validation_end(self, trainer, pl_module):  # after the module logged its epoch's loss
            val_losses.append(float(trainer.callback_metrics["val_loss"]))

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if rank == options.get("late_rank"):
                time.sleep(0.2)

    L.seed_everything(options.get("seed", 7))
    strategy = Megatron3DStrategy(
        tensor_parallel_size=options["tp"], sequence_parallel=options.get("sp", False), bucket_size_mb=0.01,
        pipeline_parallel_size=options.get("pp", 1), micro_batch_size=options.get("micro_batch_size", 1),
        virtual_pipeline_size=options.get("vpp", 1), pipeline_schedule=options.get("schedule", "1f1b"),
        zero_stage=options.get("zero_stage", 0), activation_checkpointing=options.get("recompute", "none"),
        checkpoint_checksums=options.get("checksums", False), overlap_param_gather=options.get("overlap", False),
        checkpoint_format=options.get("checkpoint_format", "sharded"), tp_comm_overlap=options.get("tp_comm_overlap", False), compile=options.get("compile", False),
    )
    class GenerateAtValidation(L.Callback):
        """Generation from a callback inside fit, as a user samples text during training: every rank calls it, under the
        inference mode Lightning validates in, between training steps."""

        tokens = None

        def on_validation_epoch_end(self, trainer, pl_module):
            self.tokens = pl_module.generate(PREDICT_PROMPTS[:2], max_new_tokens=5)

    generate_at_validation = GenerateAtValidation()
    callbacks = [RecordLosses(), generate_at_validation] if options.get("predict") else [RecordLosses()]
    if options.get("timeline"):
        timeline = PipelineTimeline(step=1, path=str(out_dir / "timeline.png"))
        callbacks.append(timeline)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                        callbacks=callbacks, **trainer_kwargs(options))
    try:
        trainer.fit(model(options), datamodule=datamodule(options), ckpt_path=options.get("ckpt_path"))
    except (ValueError, RuntimeError) as error:
        result = {"error": str(error), "distributed_initialized": dist.is_initialized()}
        (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
        return

    val_loss = float(trainer.callback_metrics["val_loss"])
    test_loss = None
    if options.get("test"):  # forward-only schedules again, after fit, with the same trainer
        test_loss = float(trainer.test(trainer.lightning_module, datamodule=datamodule(options), verbose=False)[0]["test_loss"])
    predicted = None
    if options.get("predict"):  # after fit, the split model predicts: prompts (generation) and samples (full logits)
        from torch.utils.data import DataLoader

        from lightning_megatron.data.prompts import PromptDataset

        prompts = PromptDataset(PREDICT_PROMPTS, generation=PREDICT_GENERATION)
        out = trainer.predict(trainer.lightning_module, DataLoader(prompts, batch_size=2, collate_fn=prompts.collate))
        samples = [{"input_ids": torch.arange(i, i + 12) % 257} for i in range(0, 40, 10)]
        logits = trainer.predict(trainer.lightning_module, DataLoader(samples, batch_size=2))
        predicted = {"tokens": [batch["tokens"] for batch in out], "during_fit": generate_at_validation.tokens}
        torch.save({"logits": [batch["logits"] for batch in logits]}, out_dir / f"logits{rank}.pt")
    weights = trainer.strategy.full_state_dict()
    trainer.save_checkpoint(out_dir / "last.ckpt")
    if rank == 0:
        torch.save(weights, out_dir / "weights.pt")
    result = {"losses": losses, "val_loss": val_loss, "val_losses": val_losses, "test_loss": test_loss, "predicted": predicted,
              "sampler_replicas": trainer.strategy.distributed_sampler_kwargs["num_replicas"],
              "model_state_bytes": trainer.strategy.model_state_bytes,
              "sequence_linears": sorted({type(m.sequence_linear).__name__ for m in trainer.lightning_module.modules()
                                          if hasattr(m, "sequence_linear")})}
    if options.get("timeline"):
        result["bubble"] = {"measured": timeline.measured, "theory": timeline.theory}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    run_script(main, join=False)
