"""Callbacks that report what a Megatron user watches: tokens per second over the global batch."""

from __future__ import annotations

import time
from typing import Any, Optional

import lightning as L


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
