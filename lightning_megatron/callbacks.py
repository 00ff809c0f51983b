"""Callbacks that report what a Megatron user watches: tokens/s of the global batch, the pipeline timeline."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch


class TokenThroughput(L.Callback):
    """Logs ``tokens_per_sec`` (global batch, all data-parallel replicas) to the progress bar and loggers.

    The first step is skipped: it includes start-up work that is not training speed.
    """

    def __init__(self, *, key: str = "input_ids") -> None:
        self.key = key
        self._last: Optional[float] = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last is not None and isinstance(batch, dict) and self.key in batch:
            replicas = getattr(trainer.strategy, "distributed_sampler_kwargs", {}).get("num_replicas", 1)
            tokens = batch[self.key].numel() * replicas
            pl_module.log("tokens_per_sec", tokens / (now - self._last), prog_bar=True, on_step=True, on_epoch=False)
        self._last = now

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last = None


class PipelineTimeline(L.Callback):
    """Records one training step's pipeline schedule and renders it as a PNG (needs the ``[plot]`` extra).

    Rows are pipeline ranks, boxes are the forward (light) and backward (dark) of each
    micro-batch; the title compares the measured bubble with the theoretical one. The
    measured fraction is also logged as ``pipeline_bubble``.

    Example::

        Trainer(strategy=Megatron3DStrategy(pipeline_parallel_size=4), callbacks=[PipelineTimeline(step=5)])
    """

    def __init__(self, *, step: int = 3, path: str = "pipeline_timeline.png") -> None:
        self.step, self.path = step, path
        self.measured: Optional[float] = None
        self.theory: Optional[float] = None

    def _recorder(self, trainer: L.Trainer):
        recorder = getattr(trainer.strategy, "pipeline_recorder", None)
        if recorder is None:
            raise RuntimeError("PipelineTimeline needs Megatron3DStrategy with pipeline_parallel_size > 1.")
        return recorder

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and batch_idx % trainer.accumulate_grad_batches == 0:
            recorder = self._recorder(trainer)
            recorder.events.clear()
            recorder.active = True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        recorder = self._recorder(trainer)
        if not recorder.active:
            return
        recorder.active = False
        from lightning_megatron.pipeline.timeline import measured_bubble, render, theoretical_bubble

        strategy = trainer.strategy
        state = strategy.parallel_state
        # One pipeline is enough: the ranks with dp rank 0 and tp rank 0.
        mine = recorder.events if state.data_parallel_rank == 0 and state.tensor_parallel_rank == 0 else []
        gathered = [None] * trainer.world_size
        torch.distributed.all_gather_object(gathered, mine)
        events = [event for part in gathered for event in part]
        micro_batches = len({(e.stage, e.micro_batch) for e in events if e.kind == "forward"}) // max(
            1, len({e.stage for e in events}))
        config = state.config
        self.theory = theoretical_bubble(config.pipeline_parallel_size, micro_batches, config.virtual_pipeline_size)
        self.measured = measured_bubble(events)
        pl_module.log("pipeline_bubble", self.measured, rank_zero_only=True)
        if trainer.is_global_zero:
            title = f"{strategy.pipeline_schedule}, pp={config.pipeline_parallel_size}, vpp={config.virtual_pipeline_size}"
            render(events, Path(self.path), title=title, theory=self.theory)
            print(f"Pipeline timeline written to {self.path}: bubble measured {self.measured:.1%}, theory {self.theory:.1%}")
