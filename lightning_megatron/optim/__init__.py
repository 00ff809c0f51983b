"""Data-parallel gradient synchronisation and global-norm clipping."""

from lightning_megatron.optim.clip import clip_grads_by_global_norm, global_grad_norm
from lightning_megatron.optim.grad_sync import GradientSynchronizer

__all__ = ["GradientSynchronizer", "clip_grads_by_global_norm", "global_grad_norm"]
