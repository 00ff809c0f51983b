"""Context parallelism: every sample's sequence split over ``context_parallel_size`` ranks inside attention.

``inputs.py`` cuts the batch (Megatron's load-balanced chunks), ``ring.py`` and ``all_gather.py`` are the
two exact attentions over the split sequence, ``attention.py`` the piece installed in each
``CoreAttention``, ``apply.py`` the set-up step. ``documents.py`` carries the document masks of packed
samples as ids; ``blocks.py`` is one block of queries against one source's keys and the online softmax that
merges blocks; ``masks.py`` says which keys a block's queries keep (causal, documents, sliding window, padding);
``kernels.py`` computes a block on the device's back end (torch's CPU flash kernel, FlexAttention on CUDA); and
``local.py`` runs the blocks over a whole sequence on one rank: document masks in O(S) memory with or without
context parallelism.
"""

from lightning_megatron.context_parallel.apply import apply_context_parallel
from lightning_megatron.context_parallel.attention import VARIANTS, ContextParallelAttention
from lightning_megatron.context_parallel.documents import DocumentMask
from lightning_megatron.context_parallel.inputs import SequenceInputs, chunk_indices, ring_order, split_batch
from lightning_megatron.context_parallel.local import document_attention

__all__ = ["VARIANTS", "ContextParallelAttention", "DocumentMask", "SequenceInputs", "apply_context_parallel",
           "chunk_indices", "document_attention", "ring_order", "split_batch"]
