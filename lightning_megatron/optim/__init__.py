"""Data-parallel gradient synchronisation, global-norm clipping and the non-finite step check."""

from lightning_megatron.optim.clip import clip_grads_by_global_norm, global_grad_norm
from lightning_megatron.optim.grad_sync import GradientSynchronizer
from lightning_megatron.optim.nonfinite import NonFiniteCheck, NonFiniteError
from lightning_megatron.optim.partial_grads import PartialGrads, partial_grad_groups

__all__ = ["GradientSynchronizer", "NonFiniteCheck", "NonFiniteError", "PartialGrads", "clip_grads_by_global_norm",
           "global_grad_norm", "partial_grad_groups"]
