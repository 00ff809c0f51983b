"""The dropout-on tiny GPT and the two training steps that every recomputation check compares.

Two steps, not one: the second shows that recomputation in the first backward left the
random streams where the forward left them (otherwise its dropout masks shift).
"""

import contextlib
from typing import Iterator

import torch

from lightning_megatron.models import GPTConfig
from lightning_megatron.transforms import recompute

SEED = 1234
BATCH, SEQ = 4, 16
CONFIG = GPTConfig(vocab_size=257, max_seq_length=SEQ, hidden_size=32, num_layers=2, num_heads=4,
                   dropout=0.1, attention_dropout=0.1)
LAYERS = "blocks.*"


def batches(steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED)
    tokens = [torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=generator) for _ in range(steps)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def two_steps(model: torch.nn.Module) -> dict:
    """Losses and gradients of two forward/backward steps in training mode, from one seed."""
    torch.manual_seed(SEED)
    model.train()
    losses, grads = [], []
    for input_ids, labels in batches():
        loss_sum, _ = model.loss(input_ids, labels)
        loss_sum.backward()
        losses.append(loss_sum.detach())
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads}


def max_deviation(run: dict, reference: dict) -> float:
    """Largest absolute difference of losses and gradients; 0.0 means bit-identical."""
    pairs = list(zip(run["losses"], reference["losses"]))
    for grads, reference_grads in zip(run["grads"], reference["grads"]):
        assert grads.keys() == reference_grads.keys()
        pairs += [(grads[name], reference_grads[name]) for name in grads]
    return max((a - b).abs().max().item() for a, b in pairs)


@contextlib.contextmanager
def without_tracker_replay() -> Iterator[None]:
    """Models given recomputation in here leave TensorParallelRNG alone (the bug the replay fixes): a control."""
    original = recompute._tracker_contexts
    recompute._tracker_contexts = lambda rng: (contextlib.nullcontext(), contextlib.nullcontext())
    try:
        yield
    finally:
        recompute._tracker_contexts = original
