"""A tiny GPT with buffers of its own, set in ``__init__`` from precomputed tables as users write them: one
non-persistent (not in the state dict), one persistent. Built under the strategy's meta-device context the
parameters are meta but these buffers hold values (a copy of a real table is real). Both change the loss, so a
buffer that lost its value shows in every loss."""

import torch
from torch import Tensor

from lightning_megatron.models import GPTConfig, GPTModel

SCALE = 1.0 + 0.5 * torch.cos(torch.arange(64.0))  # per hidden unit (the first hidden_size entries)
SHIFT = torch.linspace(-0.1, 0.1, 64)


class BufferedGPT(GPTModel):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.register_buffer("embedding_scale", SCALE[:config.hidden_size].clone(), persistent=False)
        self.register_buffer("embedding_shift", SHIFT[:config.hidden_size].clone())

    def embed(self, input_ids: Tensor, **side: Tensor) -> Tensor:
        return super().embed(input_ids, **side) * self.embedding_scale + self.embedding_shift
