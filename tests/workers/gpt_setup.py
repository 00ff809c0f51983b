"""The tiny GPT, data and optimiser shared by the layout-invariance worker and its single-process reference."""

import torch

from lightning_megatron.models import GPTConfig

SEED = 1234
STEPS = 5
GLOBAL_BATCH = 8
SEQ = 16
CONFIG = GPTConfig(vocab_size=257, max_seq_length=SEQ, hidden_size=32, num_layers=4, num_heads=4)
LR, WEIGHT_DECAY, CLIP = 1e-2, 0.1, 0.5


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) per step; about 10% of the labels are ignored (-100), unevenly per sample."""
    generator = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=generator)
        labels = tokens[:, 1:].clone()
        labels[torch.rand(labels.shape, generator=generator) < 0.1] = -100
        out.append((tokens[:, :-1], labels))
    return out


def optimizer(params) -> torch.optim.Optimizer:
    # eps: the key bias has an exactly-zero gradient (softmax ignores a shift of all scores), so with
    # the default eps=1e-8 AdamW turns 1e-10 rounding noise into full-size updates of it.
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, eps=1e-6)


def sgd_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR * 10, momentum=0.9, weight_decay=WEIGHT_DECAY)
