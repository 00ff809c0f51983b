"""Megatron-LM's tensor-parallel layers (Shoeybi et al. 2019, section 3).

A ``ColumnParallelLinear`` splits the output features, a ``RowParallelLinear`` the input
features; a column layer followed by a row layer needs one all-reduce in the forward
pass (g) and one in the backward pass (f). With ``sequence_parallel=True`` the
activations outside those pairs are split along the sequence, and the all-reduces become
all-gather / reduce-scatter pairs of the same volume (Korthikanti et al. 2022).

Shapes follow ``nn.Linear``/``nn.Embedding``; activations are ``[batch, sequence, ...]``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_megatron.parallel.shards import RankRanges, make_shard, new_parameter
from lightning_megatron.tensor_parallel.mappings import (
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    scatter_to_tensor_parallel,
)
from lightning_megatron.tensor_parallel.fp8 import HIGH_PRECISION, HighPrecisionGemms
from lightning_megatron.tensor_parallel.logits import VocabShard, mark_vocab_parallel
from lightning_megatron.tensor_parallel.overlap import SequenceParallelLinear

Group = Optional[dist.ProcessGroup]


def mark_sequence_parallel_grad(param: nn.Parameter) -> None:
    """A replicated parameter applied to sequence chunks (or to this rank's heads only) gets partial gradients: sum
    them over tp."""
    param.sequence_parallel_grad = True


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split along its rows (the output features) over the group.

    ``out_features`` must divide over the group, unless ``pad_to_multiple_of`` is given: then the
    output features are zero-padded to a multiple of ``tp * pad_to_multiple_of`` (what
    :class:`VocabParallelHead` does for the vocabulary). ``rank_ranges``: which ranges of the
    output features each rank holds, instead of one contiguous block (a segmented shard, see
    ``tensor_parallel.styles``); weight and bias are split alike. ``communicates = False``: the input is
    already in the tensor-parallel region (an MoE layer's experts, ``tensor_parallel.region``).
    ``sequence_linear``: how the sequence all-gather and the GEMM run under ``sequence_parallel`` (in turn by
    default; ``tensor_parallel.overlap`` overlaps them). ``gemms``: how its three GEMMs run (high precision; FP8 is
    ``tensor_parallel.fp8.Fp8Gemms``, set by ``tensor_parallel.fp8_plan``).
    """

    communicates = True
    gemms: HighPrecisionGemms = HIGH_PRECISION

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: Group = None,
        sequence_parallel: bool = False,
        gather_output: bool = False,
        pad_to_multiple_of: Optional[int] = None,
        rank_ranges: Optional[RankRanges] = None,
        sequence_linear: Optional[SequenceParallelLinear] = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if rank_ranges is not None and gather_output:
            raise ValueError("gather_output=True concatenates the ranks' outputs in rank order, which is not the "
                             "output order of a segmented shard (rank_ranges); gather in the model instead.")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.sequence_parallel, self.gather_output = group, sequence_parallel, gather_output
        self.sequence_linear = sequence_linear or SequenceParallelLinear()
        split = dict(pad_to_multiple_of=pad_to_multiple_of, rank_ranges=rank_ranges)
        shard = make_shard(group, dim=0, global_shape=(out_features, in_features), **split)
        self.weight = new_parameter(shard, None, device=device, dtype=dtype)
        if bias:
            bias_shard = make_shard(group, dim=0, global_shape=(out_features,), **split)
            self.bias = new_parameter(bias_shard, None, device=device, dtype=dtype)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        if self.communicates and self.sequence_parallel:
            y = self.sequence_linear.column(x, self.weight, self.bias, self.group, self.gemms)
        else:
            x = copy_to_tensor_parallel(x, self.group) if self.communicates else x
            y = self.gemms.linear(x, self.weight, self.bias)
        return gather_from_tensor_parallel(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, local_out={self.weight.shape[0]}"


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split along its columns; the input arrives already split. ``communicates =
    False``: the partial outputs stay partial and the bias is left out (an enclosing module leaves the region and
    adds it once after the sum, ``tensor_parallel.region``).
    ``sequence_linear``: how the GEMM and the sequence reduce-scatter run under ``sequence_parallel``; ``gemms``: as
    :class:`ColumnParallelLinear`'s. ``split_input``: the input arrives whole (replicated, e.g. after a column layer
    with ``gather_output``) and each rank keeps its own slice of it first (its gradient all-gathered backward)."""

    communicates = True
    gemms: HighPrecisionGemms = HIGH_PRECISION

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: Group = None,
        sequence_parallel: bool = False,
        sequence_linear: Optional[SequenceParallelLinear] = None,
        split_input: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if split_input and sequence_parallel:
            raise ValueError("split_input=True takes a whole, replicated input; under sequence parallelism the input "
                             "of a row-parallel layer is already split.")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.sequence_parallel, self.split_input = group, sequence_parallel, split_input
        self.sequence_linear = sequence_linear or SequenceParallelLinear()
        shard = make_shard(group, dim=1, global_shape=(out_features, in_features))
        self.weight = new_parameter(shard, None, device=device, dtype=dtype)
        if bias:
            self.bias = new_parameter(None, (out_features,), device=device, dtype=dtype)
            if sequence_parallel:
                mark_sequence_parallel_grad(self.bias)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        if self.split_input:
            x = scatter_to_tensor_parallel(x, self.group)
        if self.group is None:  # one rank: nothing to reduce, so the bias joins the matmul (addmm), as in nn.Linear
            return self.gemms.linear(x, self.weight, self.bias)
        if not self.communicates:
            return self.gemms.linear(x, self.weight)  # partial sums: the enclosing module adds the bias after them
        if self.sequence_parallel:
            y = self.sequence_linear.row(x, self.weight, self.group, self.gemms)
        else:
            y = reduce_from_tensor_parallel(self.gemms.linear(x, self.weight), self.group)
        # The bias is added once, after the reduction, not once per rank.
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, local_in={self.weight.shape[1]}"


class VocabParallelEmbedding(nn.Module):
    """An embedding table split along the vocabulary; each rank looks up the ids it owns.

    The vocabulary is padded to a multiple of ``tp * pad_to_multiple_of`` (Megatron's
    ``make_vocab_size_divisible_by``): the padding rows are never looked up, never
    predicted, and never written to checkpoints, which keep the true vocabulary size.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group: Group = None,
        pad_to_multiple_of: int = 128,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        shard = make_shard(group, dim=0, global_shape=(num_embeddings, embedding_dim), pad_to_multiple_of=pad_to_multiple_of)
        self.vocab_start = shard.rank * shard.local_size
        self.weight = new_parameter(shard, None, device=device, dtype=dtype)

    def forward(self, ids: Tensor) -> Tensor:
        if self.group is None:
            return F.embedding(ids, self.weight)
        local_size = self.weight.shape[0]
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + local_size)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel(out, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, local_rows={self.weight.shape[0]}"


class VocabParallelHead(ColumnParallelLinear):
    """The output projection onto a vocab-parallel embedding's rows; its logits stay split.

    Logits of padding rows are set to ``-inf`` so that no softmax ever predicts them. They come back
    marked (``logits.VocabParallelLogits``), so that ``gather_vocab_logits`` works at every tensor-parallel
    size; split over more than one rank, feed them to ``VocabParallelCrossEntropy`` or gather them:
    full-vocabulary functions refuse them.
    """

    def __init__(self, in_features: int, num_embeddings: int, bias: bool = False, *, pad_to_multiple_of: int = 128,
                 **kwargs) -> None:
        super().__init__(in_features, num_embeddings, bias, pad_to_multiple_of=pad_to_multiple_of, **kwargs)
        self.real_local_size = self.weight.tensor_shard.real_local_size()
        self._vocab_shard = VocabShard.of_head(self)

    def vocab_shard(self) -> VocabShard:
        return self._vocab_shard

    def forward(self, x: Tensor) -> Tensor:
        logits = super().forward(x)
        if self.real_local_size != logits.shape[-1]:
            padding = torch.arange(logits.shape[-1], device=logits.device) >= self.real_local_size
            logits = logits.masked_fill(padding, float("-inf"))
        return mark_vocab_parallel(logits, self._vocab_shard)
