"""Megatron-style tensor parallelism: communication operators, parallel layers, cross-entropy, plans."""

from lightning_megatron.parallel.shards import TensorShard
from lightning_megatron.tensor_parallel.argmax import Argmax, VocabParallelArgmax, vocab_parallel_argmax
from lightning_megatron.tensor_parallel.chunked_cross_entropy import ChunkedHeadLoss
from lightning_megatron.tensor_parallel.cross_entropy import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from lightning_megatron.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from lightning_megatron.tensor_parallel.logits import (
    VocabParallelLogits,
    VocabShard,
    find_vocab_head,
    gather_vocab_logits,
)
from lightning_megatron.tensor_parallel.mappings import (
    copy_to_tensor_parallel,
    full_sequences,
    gather_from_sequence,
    gather_from_tensor_parallel,
    gather_sequence_to_replicated,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
)
from lightning_megatron.tensor_parallel.overlap import OverlappedSequenceParallelLinear, SequenceParallelLinear
from lightning_megatron.tensor_parallel.plan import STYLES, parallelize
from lightning_megatron.tensor_parallel.styles import KeyValueHeads, PackedColumn, QueryGroupColumn

__all__ = [
    "Argmax",
    "ChunkedHeadLoss",
    "ColumnParallelLinear",
    "KeyValueHeads",
    "OverlappedSequenceParallelLinear",
    "PackedColumn",
    "QueryGroupColumn",
    "RowParallelLinear",
    "STYLES",
    "SequenceParallelLinear",
    "TensorShard",
    "VocabParallelArgmax",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "VocabParallelLogits",
    "VocabShard",
    "copy_to_tensor_parallel",
    "find_vocab_head",
    "full_sequences",
    "gather_from_sequence",
    "gather_from_tensor_parallel",
    "gather_sequence_to_replicated",
    "gather_vocab_logits",
    "parallelize",
    "reduce_from_tensor_parallel",
    "reduce_scatter_to_sequence",
    "scatter_to_sequence",
    "vocab_parallel_argmax",
    "vocab_parallel_cross_entropy",
]
