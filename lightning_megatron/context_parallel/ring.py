"""Ring attention: exact attention over a sequence split over the context-parallel ranks (Liu et al. 2023).

Each rank holds the queries, keys and values of its own ``S / n`` tokens (``inputs.py``'s load-balanced
chunks). Forward runs ``n`` steps: at step ``i`` a rank attends its queries to the keys and values of rank
``r - i`` while the next block is already on its way (the rotation is posted before the step's compute
and waited for after it), and merges the block into its output by the online softmax (``blocks.py``, which
also says which half of each causal block is skipped). So no rank ever holds more than two blocks of keys
and values, and the result is softmax attention over the whole sequence.

Backward recomputes each block's probabilities from the saved output and log-sum-exp. The keys and values go
round the ring again, and the gradients of each rank's keys and values travel with them, picking up every
rank's share, and take one more hop home: ``n - 1`` rotations of K and V and ``n`` of dK and dV, each a send
and a receive of two tensors (``batch_isend_irecv``, which NCCL needs for a ring and gloo runs as well).
What is saved for backward is ``q, k, v, o`` and the log-sum-exp, linear in the local length.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_megatron.context_parallel.blocks import (Block, compute_dtype, merge_sinks, save_for_backward, saved,
                                                        sinks_grad, start)
from lightning_megatron.context_parallel.documents import DocumentMask


def _rotate(tensors: list[Tensor], group: dist.ProcessGroup, tag: int) -> tuple[list[Tensor], list]:
    """Post sending ``tensors`` (contiguous) to the next rank of the ring and receiving the previous rank's into new buffers."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    to, frm = dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)
    received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, to, group, tag=tag + i) for i, t in enumerate(tensors)]
    ops += [dist.P2POp(dist.irecv, r, frm, group, tag=tag + i) for i, r in enumerate(received)]
    return received, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class RingAttention(torch.autograd.Function):
    """``attention(q, k, v)`` over the whole sequence from each rank's part (``q`` [B, H, S_l, D], ``k, v``
    [B, G, S_l, D]); ``key_mask``: ``[B, n * S_l]`` booleans in the ring's order, or None."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], documents: Optional[DocumentMask],
                causal: bool, group: dist.ProcessGroup, window: Optional[int],
                sinks: Optional[Tensor] = None) -> Tensor:
        rank, size, length = dist.get_rank(group), dist.get_world_size(group), q.shape[2]
        out, lse = start(q)
        k, v = k.contiguous(), v.contiguous()
        current = [k, v]
        for step in range(size):
            works: list = []
            if step < size - 1:  # the next block travels while this one is computed
                following, works = _rotate(current, group, tag=0)
            block = Block(step=step, rank=rank, size=size, causal=causal, length=length)
            block.forward(q, *current, key_mask, documents, out, lse, window=window)
            _wait(works)
            if step < size - 1:
                current = following
        out, lse = merge_sinks(out, lse, sinks)  # once, after every source's block
        out = out.to(q.dtype)
        ctx.sink_values = None if sinks is None else sinks.detach()
        save_for_backward(ctx, q, k, v, out, lse, key_mask, documents, causal, group, window)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse, key_mask, documents, causal, group, window = saved(ctx)
        rank, size, length = dist.get_rank(group), dist.get_world_size(group), q.shape[2]
        dtype = compute_dtype(q.dtype)
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        current = [k.contiguous(), v.contiguous()]
        partial = [torch.zeros(k.shape, dtype=dtype, device=k.device) for _ in range(2)]  # this step's source's
        incoming: tuple = ()
        for step in range(size):
            works: list = []
            if step < size - 1:
                following, works = _rotate(current, group, tag=0)
            if step > 0:  # the source's dK, dV so far, from the previous rank
                received, receiving, _sent = incoming
                _wait(receiving)
                partial = received
            Block(step=step, rank=rank, size=size, causal=causal, length=length).backward(
                grad_out, q, *current, out, lse, key_mask, documents, dq, *partial, window=window)
            incoming = (*_rotate(partial, group, tag=2), partial)  # on to the next rank (after the last step: home)
            _wait(works)
            if step < size - 1:
                current = following
        received, receiving, _sent = incoming
        _wait(receiving)
        dk, dv = (t.to(k.dtype) for t in received)
        sinks = ctx.sink_values
        dsinks = None if sinks is None else sinks_grad(grad_out, out, lse, sinks)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None, dsinks


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, group: dist.ProcessGroup,
                   key_mask: Optional[Tensor] = None, documents: Optional[DocumentMask] = None,
                   window: Optional[int] = None, sinks: Optional[Tensor] = None) -> Tensor:
    """Exact softmax attention of this rank's queries over every rank's keys (see the module docstring)."""
    return RingAttention.apply(q, k, v, key_mask, documents, causal, group, window, sinks)
