"""A column-parallel linear under sequence parallelism that keeps only this rank's sequence chunk of its input.

The layer needs the whole sequence: it all-gathers the input's sequence chunks before its GEMM. Stated with the
autograd operators of ``mappings`` (``F.linear(gather_from_sequence(x))``), autograd would save the gathered
input for the weight gradient, ``tp`` times the chunk: under sequence parallelism the inputs of ``qkv``, the
MLP's ``fc`` and the output layer would then be the only activations of a layer not divided by ``tp``. So this
autograd function saves the chunk and all-gathers it again in backward, as Megatron-LM does (Korthikanti et al.
2022, section 4.2.2; Megatron-Core's ``LinearWithGradAccumulationAndAsyncCommunication``):

=================  ==================================================  =====================================
pass               collective                                          runs while
=================  ==================================================  =====================================
forward            all-gather of the input's sequence chunks           (``overlap_forward``: this rank's own
                                                                       chunk's GEMM)
backward           all-gather of the input again (weight gradient)     the input-gradient GEMM
backward           reduce-scatter of the input gradient                the weight-gradient GEMM
=================  ==================================================  =====================================

That is one more all-gather per column layer in backward than the gather/reduce-scatter pair of ``mappings``.
The two ways of running the forward GEMM (``overlap_forward``: in turn after the gather, or rank chunk by rank
chunk while it arrives; ``tensor_parallel.overlap``) compute the same function and share the backward.

What backward needs is all that is saved: the input chunk only when the weight gets a gradient, the weight only
when the input does (a frozen layer keeps no activation at all). Under autocast the input, weight and bias are
cast first, so the chunk is saved in the compute dtype, as ``F.linear`` would save it (an FP8 layer's are not: it casts
the fp32 weight to FP8 itself).

The three GEMMs are the layer's ``gemms`` (``tensor_parallel.fp8``): in high precision, or in FP8, where the
gathered input is cast as a whole, so its scale is the whole sequence's on every rank.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_megatron.tensor_parallel.fp8 import HIGH_PRECISION, HighPrecisionGemms
from lightning_megatron.tensor_parallel.mappings import (
    Group,
    all_gather_into,
    copy_to_tensor_parallel,
    reduce_scatter_into,
    sequences_are_whole,
)


def sequence_parallel_column(x: Tensor, weight: Tensor, bias: Optional[Tensor], group: Group, *,
                             overlap_forward: bool = False, gemms: HighPrecisionGemms = HIGH_PRECISION) -> Tensor:
    """``F.linear(all_gather_seq(x), weight, bias)``: ``x`` ``[batch, seq / tp, ..., in]`` (this rank's sequence
    chunk) -> ``[batch, seq, ..., out / tp]``, saving only ``x`` for backward (module docstring).

    With no group it is ``F.linear``; inside ``mappings.full_sequences`` (generation: whole sequences on every
    rank) tensor parallelism's f, then ``F.linear``."""
    if group is None:
        return gemms.linear(x, weight, bias)
    if sequences_are_whole():
        return gemms.linear(copy_to_tensor_parallel(x, group), weight, bias)
    if x.dim() < 3:
        raise ValueError(f"A sequence-parallel column layer takes [batch, sequence chunk, ..., features] inputs and "
                         f"gathers dimension 1; got shape {list(x.shape)}. Give the input a batch dimension.")
    device = x.device.type
    if torch.is_autocast_enabled(device) and not gemms.fp8:  # cast here: the chunk is saved in the compute dtype
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    return _SequenceParallelColumn.apply(x, weight, bias, group, overlap_forward, gemms)


def _asynchronous() -> bool:
    """Whether to issue the collectives with ``async_op=True``: not while ``torch.compile`` traces (dynamo breaks the
    graph on it; a compiled graph's collectives are scheduled by the compiler instead)."""
    return not torch.compiler.is_compiling()


def _to_rank_order(y: Tensor, world: int) -> Tensor:
    """``[batch, seq, ...]`` -> ``[tp * batch, seq / tp, ...]``, rank ``r``'s chunk at rows ``r * batch`` onwards:
    the layout of an all-gather along dimension 0, which the collectives send and receive."""
    return y.unflatten(1, (world, -1)).transpose(0, 1).flatten(0, 1)


def _to_sequence_order(y: Tensor, world: int) -> Tensor:
    """The inverse of :func:`_to_rank_order` (a contiguous copy; a view at batch 1)."""
    return y.unflatten(0, (world, -1)).transpose(0, 1).flatten(1, 2)


class _SequenceParallelColumn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], group: Group, overlap_forward: bool,
                gemms: HighPrecisionGemms) -> Tensor:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        x = x.contiguous()
        gathered = x.new_empty((world * x.shape[0], *x.shape[1:]))  # rank order (_to_rank_order)
        if overlap_forward:
            work = all_gather_into(gathered, x, group, async_op=_asynchronous())
            own = gemms.forward(x, weight, bias)  # while the other chunks arrive
            if work is not None:
                work.wait()
            chunks = gathered.view(world, *x.shape)
            y = torch.cat([own if r == rank else gemms.forward(chunks[r], weight, bias) for r in range(world)], dim=1)
        else:
            all_gather_into(gathered, x, group)
            y = _to_sequence_order(gemms.forward(gathered, weight, bias), world)
        need_input, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.save_for_backward(x if need_weight else None, weight if need_input else None)
        ctx.group, ctx.input_shape, ctx.gemms = group, x.shape, gemms
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        group, world, gemms = ctx.group, dist.get_world_size(ctx.group), ctx.gemms
        x_dtype, weight_dtype, bias_dtype = ctx.dtypes
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        gathered, gathering = None, None
        if need_weight:  # the input again, while the input gradient's GEMM runs
            gathered = x.new_empty((world * x.shape[0], *x.shape[1:]))
            gathering = all_gather_into(gathered, x, group, async_op=_asynchronous())
        grad_parts = _to_rank_order(grad, world)  # what the reduce-scatter sends
        grad_x, scattering = None, None
        if need_input:
            grad_x_parts = gemms.grad_input(grad_parts, weight).to(x_dtype)
            if gathering is not None:
                gathering.wait()
                gathering = None
            grad_x = grad_x_parts.new_empty(ctx.input_shape)
            scattering = reduce_scatter_into(grad_x, grad_x_parts, group, async_op=_asynchronous())
        grad_weight = grad_bias = None
        flat_grad = grad_parts.reshape(-1, grad.shape[-1])
        if need_weight:  # while the input gradient is reduce-scattered
            if gathering is not None:
                gathering.wait()
            grad_weight = gemms.grad_weight(flat_grad, gathered).to(weight_dtype)
        if need_bias:
            grad_bias = flat_grad.sum(0).to(bias_dtype)
        if scattering is not None:
            scattering.wait()
        return grad_x, grad_weight, grad_bias, None, None, None
