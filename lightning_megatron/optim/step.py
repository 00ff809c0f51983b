"""One optimizer step's gradient bookkeeping, between Lightning's hooks and the optimizer.

Lightning hands the strategy micro-batches (``training_step``, ``backward``) and then one
``optimizer_step``; ``StepGradients`` turns what happens in between into exact gradients:
it counts the tokens the loss is averaged over, chooses what each backward multiplies the
token-summed loss by, completes the data-parallel reduction and divides those factors out,
hands the owned pieces to the fp32 main parameters, and decides (the same on every rank)
whether an fp16 step overflowed.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_megatron.optim.grad_sync import GradientSynchronizer
from lightning_megatron.optim.loss_scaler import DynamicLossScaler, found_overflow
from lightning_megatron.optim.main_params import MainParamOptimizer


class StepGradients:
    def __init__(
        self,
        sync: GradientSynchronizer,
        main_params: Optional[MainParamOptimizer],
        loss_scaler: Optional[DynamicLossScaler],
        *,
        data_parallel_group: Optional[dist.ProcessGroup],
        device: torch.device,
    ) -> None:
        self.sync, self.main_params, self.loss_scaler = sync, main_params, loss_scaler
        self.data_parallel_group, self.device = data_parallel_group, device
        self.data_parallel_size = 1 if data_parallel_group is None else dist.get_world_size(data_parallel_group)
        self._tokens: Tensor | float = 0.0
        self._token_estimate: Optional[float] = None

    def add_tokens(self, tokens: Tensor | float) -> None:
        """Tokens the loss of one micro-batch (or one pipeline schedule) counted on this rank."""
        self._tokens = self._tokens + tokens

    def backward_scale(self, micro_batch_tokens: Tensor | float, *, accumulation: int, loss_scale: float) -> float:
        """What a micro-batch's token-summed loss is multiplied by before backward.

        The exact per-token mean needs the global token count, known only once every
        micro-batch has run; so backward uses a fixed guess made at the step's first
        micro-batch (the most tokens any dp rank's micro-batch counts x accumulation x dp),
        which keeps gradients at the size of a mean (fp16 would overflow on a sum), and
        :meth:`finish` divides out guess / true count. The guess must be the same on every dp
        rank, whose gradients are summed: hence one scalar all-reduce per step. An fp16 loss
        scale joins the factor.
        """
        if self._token_estimate is None:
            tokens = torch.tensor(max(float(micro_batch_tokens), 1.0), device=self.device)
            if self.data_parallel_group is not None:
                dist.all_reduce(tokens, op=dist.ReduceOp.MAX, group=self.data_parallel_group)
            self._token_estimate = float(tokens) * accumulation * self.data_parallel_size
        return loss_scale / self._token_estimate

    def finish(self, *, accumulation: int, loss_scale: float) -> bool:
        """Reduce, normalise, and prepare the optimizer's gradients; returns whether the step overflowed
        (fp16 with our loss scaler; then the optimizer finds no gradients and changes nothing)."""
        tokens = self._tokens if isinstance(self._tokens, Tensor) else torch.tensor(float(self._tokens))
        self.sync.finish(tokens, backward_scale=self.backward_scale(tokens, accumulation=accumulation, loss_scale=loss_scale))
        self._tokens, self._token_estimate = 0.0, None
        if self.main_params is not None:
            self.main_params.prepare_step()
        if self.loss_scaler is None:
            return False
        owner = self.main_params if self.main_params is not None else self.sync  # ZeRO-3: fp32 shards step
        overflow = found_overflow(owner.main_grads(), self.device)
        self.loss_scaler.update(overflow)
        if overflow:
            owner.drop_grads()
        return overflow

    def after_step(self) -> None:
        if self.main_params is not None:
            self.main_params.finish_step()
        self.sync.zero()

    def remove(self) -> None:
        self.sync.remove()
