"""Context parallelism: every sample's sequence split over ``context_parallel_size`` ranks inside attention.

``inputs.py`` cuts the batch (Megatron's load-balanced chunks), ``ring.py`` and ``all_gather.py`` are the
two exact attentions over the split sequence, ``attention.py`` the piece installed in each
``CoreAttention``, ``apply.py`` the set-up step.
"""

from lightning_megatron.context_parallel.apply import apply_context_parallel
from lightning_megatron.context_parallel.attention import VARIANTS, ContextParallelAttention
from lightning_megatron.context_parallel.inputs import SequenceInputs, chunk_indices, ring_order, split_batch

__all__ = ["VARIANTS", "ContextParallelAttention", "SequenceInputs", "apply_context_parallel", "chunk_indices",
           "ring_order", "split_batch"]
