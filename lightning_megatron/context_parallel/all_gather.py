"""All-gather attention: each rank gathers every rank's keys and values, then attends its own queries.

The other context-parallel variant (Megatron-Core's ``cp_comm_type="all_gather"``): one all-gather of K and
one of V per layer forward, one reduce-scatter of dK and of dV backward, no ring of messages to keep in
step. The gathered keys and values are kept for backward, ``2 * G * d`` values per token of the whole
sequence, which is cheap with few key/value heads (grouped-query and multi-query attention) and the reason
to choose it there. The attention itself is the ring's, source by source (``blocks.py``: the same causal
half-blocks, the same online softmax), so no ``[S/n, S]`` mask is ever built.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_megatron.context_parallel.blocks import (Block, compute_dtype, merge_sinks, save_for_backward, saved,
                                                        sinks_grad, start)
from lightning_megatron.context_parallel.documents import DocumentMask


def _gather(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``[n, *x.shape]``: every rank's ``x``, in rank order."""
    size = dist.get_world_size(group)
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))  # concatenated along dim 0, as the collective writes it
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x.contiguous(), group=group)
    return out.view(size, *x.shape)


def _reduce_scatter(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """This rank's ``x[rank]`` summed over the ranks (``x``: ``[n, ...]``)."""
    out = x.new_empty(x.shape[1:])
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, x.contiguous().flatten(0, 1), group=group)
    return out


class AllGatherAttention(torch.autograd.Function):
    """``attention(q, k, v)`` over the whole sequence (shapes and ``key_mask`` as :class:`ring.RingAttention`)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], documents: Optional[DocumentMask],
                causal: bool, group: dist.ProcessGroup, window: Optional[int],
                sinks: Optional[Tensor] = None) -> Tensor:
        rank, size, length = dist.get_rank(group), dist.get_world_size(group), q.shape[2]
        keys, values = _gather(k, group), _gather(v, group)
        out, lse = start(q)
        for step in range(size):
            block = Block(step=step, rank=rank, size=size, causal=causal, length=length)
            block.forward(q, keys[block.source], values[block.source], key_mask, documents, out, lse, window=window)
        out, lse = merge_sinks(out, lse, sinks)  # once, after every source's block
        out = out.to(q.dtype)
        ctx.sink_values = None if sinks is None else sinks.detach()
        save_for_backward(ctx, q, keys, values, out, lse, key_mask, documents, causal, group, window)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, keys, values, out, lse, key_mask, documents, causal, group, window = saved(ctx)
        rank, size, length = dist.get_rank(group), dist.get_world_size(group), q.shape[2]
        dtype = compute_dtype(q.dtype)
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        dkeys, dvalues = (torch.zeros(t.shape, dtype=dtype, device=t.device) for t in (keys, values))
        for step in range(size):
            block = Block(step=step, rank=rank, size=size, causal=causal, length=length)
            s = block.source
            block.backward(grad_out, q, keys[s], values[s], out, lse, key_mask, documents, dq, dkeys[s], dvalues[s],
                           window=window)
        dk, dv = (_reduce_scatter(t, group).to(keys.dtype) for t in (dkeys, dvalues))
        sinks = ctx.sink_values
        dsinks = None if sinks is None else sinks_grad(grad_out, out, lse, sinks)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None, dsinks


def all_gather_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, group: dist.ProcessGroup,
                         key_mask: Optional[Tensor] = None, documents: Optional[DocumentMask] = None,
                   window: Optional[int] = None, sinks: Optional[Tensor] = None) -> Tensor:
    """Exact softmax attention of this rank's queries (``[B, H, S_l, D]``) over every rank's keys and values."""
    return AllGatherAttention.apply(q, k, v, key_mask, documents, causal, group, window, sinks)
