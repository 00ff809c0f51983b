"""The pieces both context-parallel attentions are made of: which block of queries and keys a step computes,
one block's attention with its log-sum-exp, the online-softmax merge, and one block's gradients.

Rank ``r`` of ``n`` holds chunks ``r`` and ``2n-1-r`` of the sequence (``inputs.py``); the keys and values of
rank ``s`` (the *source*) hold chunks ``s`` and ``2n-1-s``. Causal attention between the two needs one of three
blocks:

* ``s == r``: its own tokens, causally (its positions increase, so the usual lower triangle);
* ``s < r``: every query attends to the source's first chunk, which precedes both of the rank's, and to none
  of its second, which follows both: all queries x the first half of the keys;
* ``s > r``: the rank's first chunk precedes everything the source holds, its second follows it: the second
  half of the queries x all the keys.

The other half is skipped, so every rank computes the same amount per source. Bidirectional attention
(BERT) computes every block whole, with the key-padding mask of the source's tokens. With a document mask
(``documents.py``) or a sliding window, tiles of a block whose queries and keys share no document (or lie
outside the window) are skipped, and the others masked (``masks.py``).

A block's kernels come from ``kernels.py`` (one interface, a back end per device: torch's fused CPU kernel on CPU,
FlexAttention on CUDA), given the block's mask as a ``masks.BlockPattern`` (global positions, document ids, key
padding, an optional sliding window). Blocks merge by the online softmax (a running log-sum-exp per query, in
fp32). Backward is FlashAttention's: with the whole attention's output ``o`` and log-sum-exp ``L``, a block's
probabilities are ``exp(q k^T / sqrt(d) - L)`` and its gradients follow without the other blocks.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_megatron.context_parallel.documents import DocumentMask
from lightning_megatron.context_parallel.inputs import chunk_indices
from lightning_megatron.context_parallel.kernels import (NEG_INF, AttentionBackend, backend_for, compute_dtype,
                                                         finite)
from lightning_megatron.context_parallel.masks import DEFAULT_TILE, BlockPattern


class Block:
    """Which queries and keys of the rank's ``S_l`` positions the block of one source computes (see the module
    docstring); ``step``: the source is rank ``rank - step``. Its mask, as its back end reads it, is
    :meth:`pattern`."""

    def __init__(self, *, step: int, rank: int, size: int, causal: bool, length: int) -> None:
        source = (rank - step) % size
        half = length // 2
        self.rank, self.source, self.size, self.length = rank, source, size, length
        self.causal_attention = causal
        self.causal = causal and source == rank  # the block is a causal diagonal
        self.rows, self.cols = slice(0, length), slice(0, length)
        if causal and source < rank:
            self.cols = slice(0, half)
        elif causal and source > rank:
            self.rows = slice(half, length)

    def _positions(self, whole: Tensor, rank: int) -> Tensor:
        """Rank ``rank``'s part of a ``[B, n * S_l]`` per-position tensor in the ring's order."""
        return whole[:, rank * self.length:(rank + 1) * self.length]

    def _global(self, rank: int, device: torch.device) -> Tensor:
        """The global positions of rank ``rank``'s ``S_l`` tokens (``inputs.chunk_indices``)."""
        if self.size == 1:
            return torch.arange(self.length, device=device)
        return chunk_indices(self.size * self.length, self.size, rank, device)

    def pattern(self, key_mask: Optional[Tensor], documents: Optional[DocumentMask], device: torch.device,
                window: Optional[int] = None) -> BlockPattern:
        """The block's mask (``masks.BlockPattern``) over its ``rows x cols``: causal by global position, the
        documents of its queries and keys, the source's key padding, the sliding window."""
        keys = None if key_mask is None else self._positions(key_mask, self.source)[:, self.cols]
        q_ids = k_ids = None
        if documents is not None:
            q_ids = self._positions(documents.ids, self.rank)[:, self.rows]
            k_ids = self._positions(documents.ids, self.source)[:, self.cols]
        return BlockPattern(
            q_pos=self._global(self.rank, device)[self.rows], k_pos=self._global(self.source, device)[self.cols],
            causal=self.causal_attention, triangle=self.causal, window=window, q_ids=q_ids, k_ids=k_ids,
            k_keep=keys, tile=DEFAULT_TILE if documents is None else documents.tile,
            plans=None if documents is None else documents.plans,
            key=(self.rank, self.source, self.size, self.length, self.causal_attention, window))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], documents: Optional[DocumentMask],
                out: Tensor, lse: Tensor, *, window: Optional[int] = None,
                backend: Optional[AttentionBackend] = None) -> None:
        """Attend ``q`` (the rank's, ``[B, H, S_l, D]``) to the source's ``k, v`` (``[B, G, S_l, D]``) and merge the
        block into the running ``out`` and ``lse`` (compute dtype) in place. ``backend``: the kernels
        (``kernels.backend_for(q.device)`` when None)."""
        backend = backend or backend_for(q.device)
        pattern = self.pattern(key_mask, documents, q.device, window)
        q, k, v = q[:, :, self.rows], k[:, :, self.cols], v[:, :, self.cols]
        for part, block_out, block_lse in backend.forward(q, k, v, pattern):
            rows = _within(self.rows, part)
            merged = torch.logaddexp(lse[..., rows], block_lse)
            safe = finite(merged)
            out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[..., rows] - safe)[..., None]
                               + block_out.to(out.dtype) * torch.exp(block_lse - safe)[..., None])
            lse[..., rows] = merged

    def backward(self, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 key_mask: Optional[Tensor], documents: Optional[DocumentMask], dq: Tensor, dk: Tensor,
                 dv: Tensor, *, window: Optional[int] = None, backend: Optional[AttentionBackend] = None) -> None:
        """Add this block's gradients: to ``dq`` (the rank's queries) and to ``dk, dv`` (the source's keys and
        values, ``[B, G, S_l, D]``), all in the compute dtype, in place."""
        backend = backend or backend_for(q.device)
        pattern = self.pattern(key_mask, documents, q.device, window)
        r, c = self.rows, self.cols
        parts = backend.backward(grad[:, :, r], q[:, :, r], k[:, :, c], v[:, :, c], out[:, :, r], lse[..., r], pattern)
        for rows, cols, dq_part, dk_part, dv_part in parts:
            rows, cols = _within(r, rows), _within(c, cols)
            dq[:, :, rows] += dq_part.to(dq.dtype)
            dk[:, :, cols] += dk_part.to(dk.dtype)
            dv[:, :, cols] += dv_part.to(dv.dtype)


def _within(outer: slice, inner: slice) -> slice:
    """``inner`` (relative to ``outer``'s start) as a slice of the whole."""
    return slice(outer.start + inner.start, outer.start + inner.stop)


def start(q: Tensor) -> tuple[Tensor, Tensor]:
    """The running output (zeros) and log-sum-exp (-inf) of the online softmax, in the compute dtype. The output
    ``[B, H, S, D]`` is laid out as ``[B, S, H, D]`` in memory, as SDPA's flash kernels lay theirs: attention's
    ``transpose(1, 2).reshape(B, S, H * D)`` is then a view, not a second copy that the projection keeps."""
    dtype = compute_dtype(q.dtype)
    batch, heads, seq, dim = q.shape
    return (torch.zeros(batch, seq, heads, dim, dtype=dtype, device=q.device).transpose(1, 2),
            torch.full(q.shape[:-1], NEG_INF, dtype=dtype, device=q.device))


def merge_sinks(out: Tensor, lse: Tensor, sinks: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """The attention sinks (``[H]`` logits; None: none) merged last into the whole attention's output and
    log-sum-exp: one more key of logit ``s_h`` and value zero per query (``local.py``'s docstring). Each rank merges
    them into its own queries' rows once, after every block, so each softmax has the sink exactly once."""
    if sinks is None:
        return out, lse
    merged = torch.logaddexp(lse, _sink_logits(sinks, lse))
    return out * torch.exp(lse - merged)[..., None], merged


def sinks_grad(grad_out: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """The sinks' gradient from this rank's queries, given the merged output and log-sum-exp (:func:`merge_sinks`):
    ``-sum over queries of exp(s_h - L') D``, ``D = rowsum(grad * out)``, as for any key's score."""
    dtype = compute_dtype(out.dtype)
    rows = (grad_out.to(dtype) * out.to(dtype)).sum(-1)  # D of every query [B, H, S]
    share = torch.exp(_sink_logits(sinks, lse) - lse)
    return -(share * rows).sum(dim=(0, 2)).to(sinks.dtype)


def _sink_logits(sinks: Tensor, lse: Tensor) -> Tensor:
    """``[H]`` sink logits broadcast to the log-sum-exp's ``[B, H, S]``, in its dtype."""
    return sinks.to(lse.dtype)[None, :, None].expand_as(lse)


def save_for_backward(ctx, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, key_mask: Optional[Tensor],
                      documents: Optional[DocumentMask], causal: bool, group, window: Optional[int] = None) -> None:
    """What the block attentions' backward needs: the inputs, the whole output and log-sum-exp, the pattern (the
    document ids among the saved tensors, so that they are counted with the rest; the ``DocumentMask`` itself
    too, so that backward reuses the tile plans and block masks forward cached in it), the group."""
    ctx.save_for_backward(q, k, v, out, lse, key_mask, None if documents is None else documents.ids)
    ctx.causal, ctx.group, ctx.has_mask, ctx.window = causal, group, key_mask is not None, window
    ctx.documents = documents


def saved(ctx) -> tuple:
    """``(q, k, v, out, lse, key_mask, documents, causal, group, window)`` as :func:`save_for_backward` kept
    them."""
    q, k, v, out, lse, key_mask, _ids = ctx.saved_tensors
    return q, k, v, out, lse, key_mask if ctx.has_mask else None, ctx.documents, ctx.causal, ctx.group, ctx.window
