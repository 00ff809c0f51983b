"""``flops_per_batch`` as Lightning's ``ThroughputMonitor`` reads it: a number, the FLOPs this device did for the
batch it just ran.

Lightning's monitor reads ``pl_module.flops_per_batch`` (an attribute, no arguments) after every batch and treats it
as the FLOPs of *one device*: it multiplies it by the world size for the total and divides it by the step time for
``device/flops_per_sec`` and MFU. Under ``Megatron3DStrategy`` the ``tp x cp x pp`` ranks of a data-parallel replica
share the work of one batch, so one device's FLOPs are the model FLOPs of the rank's batch (``models/flops.py``)
``x dp / world_size``; with that number Lightning's FLOP/s, per-device FLOP/s and MFU are right at every layout
(its samples/s still counts every rank's batch: see ``callbacks.TokenThroughput``). Training batches count forward
and backward, evaluation and prediction batches the forward only.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_megatron.models.flops import FORWARD_AND_BACKWARD

__all__ = ["BatchFlops", "data_parallel_size"]


def data_parallel_size(trainer: Any) -> int:
    """The number of replicas training on different samples: the strategy's ``distributed_sampler_kwargs``
    ``num_replicas`` (``Megatron3DStrategy``: dp; DDP: the world size), 1 without one."""
    replicas = getattr(getattr(trainer, "strategy", None), "distributed_sampler_kwargs", None) or {}
    return replicas.get("num_replicas", 1)


class BatchFlops:
    """Mixed into a LightningModule whose ``config`` has ``flops_per_batch(batch_size, seq_length)`` (``GPTConfig``,
    ``BERTConfig``). The shape is taken from each batch's ``input_ids`` ``[B, S]`` as Lightning hands it over, before
    the strategy cuts a context-parallel rank's part (``on_before_batch_transfer``, which every stage calls)."""

    _batch_shape: Optional[tuple[int, int]] = None

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        tokens = batch.get("input_ids") if isinstance(batch, dict) else None
        if tokens is not None and tokens.dim() == 2:
            self._batch_shape = (int(tokens.shape[0]), int(tokens.shape[1]))
        return super().on_before_batch_transfer(batch, dataloader_idx)

    @property
    def flops_per_batch(self) -> Optional[float]:
        """This device's FLOPs of the last batch (see the module's docstring); None before the first batch. The model
        FLOPs of any batch shape: ``self.config.flops_per_batch(batch_size, seq_length)``."""
        if self._batch_shape is None:
            return None
        flops = self.config.flops_per_batch(*self._batch_shape)
        trainer = self._trainer
        if trainer is None:
            return float(flops)
        if not trainer.training:
            flops //= FORWARD_AND_BACKWARD
        return flops * data_parallel_size(trainer) / trainer.world_size
