"""Non-finite steps on 2 ranks: a NaN loss on rank 1 only (dp=2, ZeRO-3 dp=2, pp=2) must stop every
rank with the same error naming rank 1; an Inf gradient on rank 1 only (tp=2, bf16-true) under
on_nonfinite='skip' must skip that step on both ranks (also at dp=2 ZeRO-1 with overlap_param_gather);
and with clipping on, the norm the check measures (and the clip reuses) must give the losses of
on_nonfinite='ignore', where the clip measures it itself, at dp=2 ZeRO-0/1/3 and tp=2.

argv: OUT_DIR. Rank r writes rank{r}.json: per run the error raised (or None), the losses,
per-step checksums of its parameters and whether they stayed finite.
"""

import json
import os
from pathlib import Path

import lightning as L
import torch.distributed as dist

from nonfinite_setup import BAD_STEP, RecordSteps, faulty
from trainer_setup import datamodule, model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy
from entry import run_script


def run(layout: dict, *, precision="32-true", steps=4, clip=0.5, faults=None, **strategy_kwargs) -> dict:
    L.seed_everything(7)
    record = RecordSteps()
    strategy = Megatron3DStrategy(bucket_size_mb=0.01, **layout, **strategy_kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision=precision, callbacks=[record],
                        **{**trainer_kwargs({"steps": steps, "clip": clip}), "limit_val_batches": 0})
    error = None
    try:
        trainer.fit(faulty(model({}), **(faults or {})), datamodule=datamodule({}))
    except RuntimeError as exception:
        error = f"{type(exception).__name__}: {exception}"
    return {"error": error, "losses": record.losses, "checksums": record.checksums, "finite": record.finite,
            "skipped": strategy.driver.nonfinite.skipped_steps}


def main(out_dir: Path, args: list[str]) -> None:
    DP2, TP2 = {"data_parallel_size": 2}, {"tensor_parallel_size": 2}
    nan_on_rank1 = {"nan_steps": [BAD_STEP], "ranks": [1]}
    results = {
        "dp2-nan": run(DP2, faults=nan_on_rank1),
        "zero3-nan": run({**DP2, "zero_stage": 3}, faults=nan_on_rank1),
        # The schedule ran backward already: only the returned loss is NaN, so only the loss count can tell.
        "pp2-nan": run({"pipeline_parallel_size": 2, "micro_batch_size": 2}, faults=nan_on_rank1),
        "tp2-bf16-inf-grad-skip": run(TP2, precision="bf16-true", on_nonfinite="skip",
                                      faults={"inf_grad_steps": [BAD_STEP], "ranks": [1]}),
        # The skipped step still writes back and gathers its (unchanged) pieces, overlapped with the next forward.
        "dp2-zero1-overlap-inf-grad-skip": run({**DP2, "zero_stage": 1, "overlap_param_gather": True}, on_nonfinite="skip",
                                               faults={"inf_grad_steps": [BAD_STEP], "ranks": [1]}),
    }
    for name, layout in {"dp2": DP2, "dp2-zero1": {**DP2, "zero_stage": 1}, "dp2-zero3": {**DP2, "zero_stage": 3},
                         "tp2": TP2}.items():
        for mode in ("error", "ignore"):  # SGD: a wrongly counted norm would change every update
            results[f"clip-{name}-{mode}"] = run(layout, steps=3, clip=0.05, on_nonfinite=mode, faults={"sgd_lr": 1.0})
    for mode in ("error", "ignore"):  # no clipping: the check's own norm must leave the gradients alone
        results[f"noclip-dp2-{mode}"] = run(DP2, steps=3, clip=None, on_nonfinite=mode, faults={"sgd_lr": 1.0})
    (out_dir / f"rank{int(os.environ['RANK'])}.json").write_text(json.dumps(results))
    dist.barrier()


if __name__ == "__main__":
    run_script(main, join=False)
