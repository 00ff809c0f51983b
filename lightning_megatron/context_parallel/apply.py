"""Wiring context parallelism into a model: every ``CoreAttention`` gets a :class:`ContextParallelAttention`.

An attention module takes part by offering the hook: a ``context_parallel`` attribute it hands its inputs to
when set, and an ``attend(q, k, v, mask, causal)`` for whole sequences (``models.attention.CoreAttention``).
This package sits below the models, so it recognises the hook rather than the class.
"""

from __future__ import annotations

from torch import nn

from lightning_megatron.context_parallel.attention import ContextParallelAttention
from lightning_megatron.context_parallel.inputs import SequenceInputs, split_batch
from lightning_megatron.parallel.state import ParallelState


def apply_context_parallel(module: nn.Module, state: ParallelState, variant: str = "ring") -> None:
    """Install ring (or all-gather) attention over the context-parallel group in every ``CoreAttention`` of
    ``module``. Raises, on every rank alike, when the model's attention is not ours, uses
    attention dropout (which the split attention does not draw) or soft-caps its scores."""
    size = state.config.context_parallel_size
    if size == 1:
        return
    cores = [(name, m) for name, m in module.named_modules() if _offers_hook(m)]
    if not cores:
        raise ValueError(
            f"context_parallel_size={size} splits attention over the sequence, which only attention modules offering "
            f"the hook (lightning_megatron.models.attention.CoreAttention) can do: {type(module).__name__} has none. Build "
            f"the model's attention from SelfAttention / CoreAttention, or use context_parallel_size=1.")
    dropping = [name for name, m in cores if getattr(m, "attention_dropout", 0.0) > 0]
    if dropping:
        raise ValueError(
            f"context_parallel_size={size} does not support attention dropout (the split attention computes the "
            f"softmax block by block and draws no dropout mask), but {len(dropping)} attention module(s) have it "
            f"(first: {dropping[0]}, attention_dropout={dict(cores)[dropping[0]].attention_dropout}). Set attention_dropout=0 in "
            f"the model's config (Llama-family models train without it) or use context_parallel_size=1.")
    capped = [name for name, m in cores if getattr(m, "softcap", None) is not None]
    if capped:
        raise ValueError(
            f"context_parallel_size={size} does not support soft-capped attention scores (the split attention merges "
            f"blocks by a log-sum-exp that its kernels compute without the cap), but {len(capped)} attention "
            f"module(s) have one (first: {capped[0]}, softcap={dict(cores)[capped[0]].softcap}). Use "
            f"context_parallel_size=1, or a model without attn_logit_softcapping.")
    attention = ContextParallelAttention(state.context_parallel_group, variant)
    for _, core in cores:
        core.context_parallel = attention


def _offers_hook(module: nn.Module) -> bool:
    return hasattr(module, "context_parallel") and callable(getattr(module, "attend", None))


class BatchSplitter:
    """Cuts each batch a context-parallel rank receives into its part (``inputs.split_batch``), by the names the
    LightningModule's ``sequence_inputs()`` declares."""

    def __init__(self, module: nn.Module, state: ParallelState) -> None:
        config = state.config
        declare = getattr(module, "sequence_inputs", None)
        if declare is None:
            raise ValueError(
                f"context_parallel_size={config.context_parallel_size} cuts every batch along the sequence, and "
                f"{type(module).__name__} does not say which entries carry it: define sequence_inputs() returning a "
                f"lightning_megatron.context_parallel.SequenceInputs (GPT's and BERT's are examples).")
        self.inputs: SequenceInputs = declare()
        self.size, self.rank = config.context_parallel_size, state.context_parallel_rank
        self.tensor_parallel_size, self.sequence_parallel = config.tensor_parallel_size, config.sequence_parallel
        self.model_name = type(module).__name__

    def __call__(self, batch):
        return split_batch(batch, self.inputs, self.size, self.rank, tensor_parallel_size=self.tensor_parallel_size,
                           sequence_parallel=self.sequence_parallel, model_name=self.model_name)
