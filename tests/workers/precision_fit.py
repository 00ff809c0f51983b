"""Trainer.fit under fp32, bf16-true, 16-true, 16-mixed and bf16-mixed on the same ranks (tp=2), an
fp16 run in which rank 1 alone produces an overflow at one step, bf16-true with the optimizer
offloaded to the CPU, and fp16 under ZeRO-3 (dp=2) with and without that overflow. FP8 (bf16-mixed with
``fp8="tensorwise"`` / ``"rowwise"``), and a chain of checkpoints: bf16 for 2 steps, resumed in fp8 for 2, resumed in
bf16 for 1 (``fp8-chain``: its losses, and the dtypes of the tensors each checkpoint holds).

argv: OUT_DIR. Rank r writes rank{r}.json: per run the training losses, the final loss scale and
skipped-step count, and a checksum of the weights after every optimizer step.
"""

import json
import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer_setup import datamodule, model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.models import GPT
from entry import run_script


def main(out_dir: Path, args: list[str]) -> None:
    OVERFLOW_STEP = 2  # tests/test_precision.py checks this step

    class OverflowOnOneRank(GPT):
        """Rank 1 multiplies its loss by inf at one step: every rank must skip that step."""

        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            if self.global_step == OVERFLOW_STEP and self.trainer.global_rank == 1:
                out["loss"] = out["loss"] * float("inf")
            return out

    class Record(L.Callback):
        def __init__(self):
            self.losses, self.checksums = [], []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))  # global batch
            local = (p.to_local() if isinstance(p, DTensor) else p for p in pl_module.parameters())  # ZeRO-3: this shard
            self.checksums.append(float(sum(p.detach().double().sum() for p in local)))

    def run(precision: str, overflow: bool = False, offload=False, zero3: bool = False, fp8=None, steps: int = 5,
            resume=None, save=None) -> dict:
        L.seed_everything(7)
        options = {"tp": 1 if zero3 else 2, "steps": steps, "clip": 1.0}
        record = Record()
        strategy = Megatron3DStrategy(tensor_parallel_size=options["tp"], zero_stage=3 if zero3 else 0,
                                      loss_scaler={"initial_scale": 2.0**12, "hysteresis": 1}, offload_optimizer=offload,
                                      offload_path=str(out_dir / "offload") if offload == "nvme" else None,
                                      offload_buffer_mb=1000 * 4 / 2**20, fp8=fp8)
        kwargs = trainer_kwargs(options)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision=precision, callbacks=[record], **kwargs)
        gpt = model(options)
        if overflow:
            gpt = OverflowOnOneRank(**gpt.hparams)
        trainer.fit(gpt, datamodule=datamodule(options), ckpt_path=resume)
        if save is not None:
            trainer.save_checkpoint(save)
        scaler = trainer.strategy.driver.loss_scaler
        optimizer = trainer.optimizers[0]
        state_devices = {str(v.device) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)}
        return {"losses": record.losses, "checksums": record.checksums,
                "loss_scale": scaler.scale if scaler else None, "skipped": scaler.skipped_steps if scaler else None,
                "optimizer_devices": sorted(state_devices | {str(p.device) for g in optimizer.param_groups for p in g["params"]})}

    results = {name: run(precision, overflow, offload, zero3) for name, precision, overflow, offload, zero3 in (
        ("fp32", "32-true", False, False, False), ("bf16-true", "bf16-true", False, False, False),
        ("fp16-true", "16-true", False, False, False), ("fp16-mixed", "16-mixed", False, False, False),
        ("bf16-mixed", "bf16-mixed", False, False, False), ("fp16-overflow", "16-true", True, False, False),
        ("bf16-true-offload", "bf16-true", False, True, False), ("bf16-true-nvme", "bf16-true", False, "nvme", False),
        ("fp16-overflow-nvme", "16-true", True, "nvme", False),
        ("fp16-true-zero3", "16-true", False, False, True), ("fp16-overflow-zero3", "16-true", True, False, True),
    )}
    for recipe in ("tensorwise", "rowwise"):
        results[f"bf16-mixed-fp8-{recipe}"] = run("bf16-mixed", fp8=recipe)

    def saved_dtypes(path: Path) -> list[str]:
        """The dtypes of every tensor a sharded checkpoint holds (its DCP metadata)."""
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        entries = FileSystemReader(str(path)).read_metadata().state_dict_metadata.values()
        return sorted({str(entry.properties.dtype) for entry in entries if isinstance(entry, TensorStorageMetadata)})

    # bf16 -> fp8 -> bf16 through checkpoints: steps 1-2 in bf16, 3-4 in fp8, 5 in bf16 (against the straight bf16 run).
    chain = [out_dir / f"chain-{i}.ckpt" for i in range(2)]
    parts = [run("bf16-mixed", steps=2, save=chain[0]), run("bf16-mixed", fp8="tensorwise", steps=4, resume=chain[0],
                                                            save=chain[1]), run("bf16-mixed", steps=5, resume=chain[1])]
    results["fp8-chain"] = {"losses": [loss for part in parts for loss in part["losses"]],
                            "saved_dtypes": [saved_dtypes(path) for path in chain]}
    (out_dir / f"rank{int(os.environ['RANK'])}.json").write_text(json.dumps(results))
    dist.barrier()


if __name__ == "__main__":
    run_script(main, join=False)
