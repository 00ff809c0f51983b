"""Data-parallel gradient synchronisation, global-norm clipping and the non-finite step check."""

from lightning_megatron.optim.clip import clip_grads_by_global_norm, global_grad_norm
from lightning_megatron.optim.grad_sync import GradientSynchronizer
from lightning_megatron.optim.nonfinite import NonFiniteCheck, NonFiniteError

__all__ = ["GradientSynchronizer", "NonFiniteCheck", "NonFiniteError", "clip_grads_by_global_norm", "global_grad_norm"]
