"""The communication operators of Megatron-LM (Shoeybi et al. 2019, Korthikanti et al. 2022).

Each operator is an autograd function whose backward is the conjugate collective of its
forward, so a layer states its communication once and the gradient follows:

=============================  ======================  ======================
operator                       forward                 backward
=============================  ======================  ======================
``copy_to_tensor_parallel``    identity            (f) all-reduce
``reduce_from_tensor_parallel`` all-reduce          (g) identity
``gather_from_sequence``       all-gather(seq)         reduce-scatter(seq)
``reduce_scatter_to_sequence`` reduce-scatter(seq)     all-gather(seq)
``scatter_to_sequence``        keep own chunk(seq)     all-gather(seq)
``gather_from_tensor_parallel`` all-gather(last dim)   keep own chunk
``gather_sequence_to_replicated`` all-gather(seq)      keep own chunk(seq)
=============================  ======================  ======================

``group=None`` means a group of one: every operator is then the identity. Collectives
are looked up on ``torch.distributed`` at call time, so a test can count them.

Inside :func:`full_sequences` the sequence-parallel operators fall back to plain tensor
parallelism (the two sequence all-gathers become f, the reduce-scatter becomes g, the
scatter keeps the whole sequence): generation feeds one token at a time, which no
sequence split can divide, and the result is the same function.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor

Group = Optional[dist.ProcessGroup]

_full_sequences = False


@contextlib.contextmanager
def full_sequences() -> Iterator[None]:
    """Run a sequence-parallel model on whole sequences (any length), with tensor parallelism's f and g."""
    global _full_sequences
    previous, _full_sequences = _full_sequences, True
    try:
        yield
    finally:
        _full_sequences = previous


def sequences_are_whole() -> bool:
    """True inside :func:`full_sequences` (sequence-parallel operators then act as plain tensor parallelism)."""
    return _full_sequences


def all_gather_along(x: Tensor, group: Group, dim: int) -> Tensor:
    """All-gather ``x`` along ``dim`` with no autograd (integer tensors, e.g. routing decisions)."""
    return x if group is None else _all_gather(x, group, dim)


def _all_reduce(x: Tensor, group: Group) -> Tensor:
    # In place is safe: every caller passes a fresh matmul output or a fresh gradient.
    dist.all_reduce(x, group=group)
    return x


def all_gather_into(out: Tensor, x: Tensor, group: Group, async_op: bool = False):
    """``out`` (``tp`` times ``x`` along dim 0) <- every rank's ``x``; with ``async_op`` the work to wait on."""
    # torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, x, group=group, async_op=async_op)


def reduce_scatter_into(out: Tensor, x: Tensor, group: Group, async_op: bool = False):
    """``out`` <- this rank's ``1/tp`` (along dim 0) of the sum of every rank's ``x``; with ``async_op`` the work."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(out, x, group=group, async_op=async_op)


def _all_gather(x: Tensor, group: Group, dim: int) -> Tensor:
    world = dist.get_world_size(group)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    all_gather_into(out, x, group)
    return out.movedim(0, dim)


def _reduce_scatter(x: Tensor, group: Group, dim: int) -> Tensor:
    world = dist.get_world_size(group)
    if x.shape[dim] % world != 0:
        raise ValueError(
            f"Sequence parallelism splits dimension {dim} of size {x.shape[dim]} over {world} ranks, which does not "
            f"divide. Use a sequence length divisible by tensor_parallel_size={world}."
        )
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    reduce_scatter_into(out, x, group)
    return out.movedim(0, dim)


def _own_chunk(x: Tensor, group: Group, dim: int) -> Tensor:
    world = dist.get_world_size(group)
    if x.shape[dim] % world != 0:
        raise ValueError(
            f"Cannot split dimension {dim} of size {x.shape[dim]} over {world} tensor-parallel ranks. "
            f"Use a size divisible by tensor_parallel_size={world}."
        )
    # A copy, also when the chunk is contiguous already (batch 1): a view would keep the whole tensor's storage
    # alive for as long as the chunk is (the first norm saves the scattered embedding output for backward).
    return x.chunk(world, dim=dim)[dist.get_rank(group)].clone(memory_format=torch.contiguous_format)


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        return _all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _own_chunk(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class _GatherSequenceToReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _own_chunk(grad, ctx.group, ctx.dim), None, None


class _GatherFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return _all_gather(x, group, x.dim() - 1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _own_chunk(grad, ctx.group, grad.dim() - 1), None


class _ScatterToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return _own_chunk(x, group, x.dim() - 1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather(grad, ctx.group, grad.dim() - 1), None


def copy_to_tensor_parallel(x: Tensor, group: Group) -> Tensor:
    """Megatron's f: enter a tensor-parallel region with a replicated input."""
    return x if group is None else _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: Tensor, group: Group) -> Tensor:
    """Megatron's g: leave a tensor-parallel region by summing the partial outputs."""
    return x if group is None else _ReduceFromTensorParallel.apply(x, group)


def gather_from_sequence(x: Tensor, group: Group, dim: int = 1) -> Tensor:
    """Sequence-parallel f: rebuild the full sequence before a column-parallel layer."""
    if _full_sequences:
        return copy_to_tensor_parallel(x, group)
    return x if group is None else _GatherFromSequence.apply(x, group, dim)


def reduce_scatter_to_sequence(x: Tensor, group: Group, dim: int = 1) -> Tensor:
    """Sequence-parallel g: sum partial outputs and keep only this rank's sequence chunk."""
    if _full_sequences:
        return reduce_from_tensor_parallel(x, group)
    return x if group is None else _ReduceScatterToSequence.apply(x, group, dim)


def scatter_to_sequence(x: Tensor, group: Group, dim: int = 1) -> Tensor:
    """Enter the sequence-parallel region from a replicated tensor (no communication forward)."""
    if _full_sequences:
        return x
    return x if group is None else _ScatterToSequence.apply(x, group, dim)


def gather_sequence_to_replicated(x: Tensor, group: Group, dim: int = 1) -> Tensor:
    """Leave the sequence-parallel region into a replicated computation (BERT's pooler on [CLS]).

    Every rank then computes the same function of the full sequence, so each already holds the
    whole gradient: backward keeps this rank's chunk instead of reduce-scattering (which would
    count it ``tp`` times). Megatron-LM: ``tensor_parallel_output_grad=False``.
    """
    if _full_sequences:
        return x
    return x if group is None else _GatherSequenceToReplicated.apply(x, group, dim)


def gather_from_tensor_parallel(x: Tensor, group: Group) -> Tensor:
    """Concatenate last-dimension shards, e.g. vocab-parallel logits for generation."""
    return x if group is None else _GatherFromTensorParallel.apply(x, group)


def scatter_to_tensor_parallel(x: Tensor, group: Group) -> Tensor:
    """Keep this rank's contiguous last-dimension shard of a replicated tensor (all-gather backward): the input of a
    row-parallel layer that follows a replicated computation (transformers' ``rowwise_split_input``)."""
    return x if group is None else _ScatterToTensorParallel.apply(x, group)
