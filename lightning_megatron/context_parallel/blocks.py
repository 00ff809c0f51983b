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
(``documents.py``) a block is cut into tiles, those whose queries and keys share no document are skipped, and
each other tile gets its own small mask (same document, causal on the diagonal).

A block runs torch's flash-attention kernel on CPU (``_scaled_dot_product_flash_attention_for_cpu`` and its
backward, which return and take the log-sum-exp); elsewhere the same computation in matmuls with fp32 scores (a
GPU flash kernel with log-sum-exp is the obvious next step). Blocks merge by the online softmax (a running
log-sum-exp per query, in fp32). Backward is FlashAttention's: with the whole attention's output ``o`` and
log-sum-exp ``L``, a block's probabilities are ``exp(q k^T / sqrt(d) - L)`` and its gradients follow without
the other blocks. Grouped-query key/value heads are repeated for their query heads one block at a time (a
transient copy) and their gradients summed back.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional

import torch
from torch import Tensor

from lightning_megatron.context_parallel.documents import DocumentMask

NEG_INF = float("-inf")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit and fp32 inputs (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _additive(keep: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """Booleans (True = attend: ``[B, 1, 1, Sk]`` key padding, ``[B, 1, Sq, Sk]`` a tile of documents) as SDPA's
    additive mask (0 or -inf) in ``dtype``."""
    if keep is None:
        return None
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, NEG_INF)


def uses_flash_kernel(device: torch.device) -> bool:
    """Whether blocks run torch's CPU flash-attention kernel (else the matmul form)."""
    return device.type == "cpu"


def _block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Optional[Tensor], *,
                   flash: bool) -> tuple[Tensor, Tensor]:
    """One block's ``(output, log-sum-exp)`` (``q`` [B, H, Sq, D], ``k, v`` [B, H, Sk, D]; a query with no key
    to attend to gets output 0 and log-sum-exp -inf). ``flash``: torch's CPU flash-attention kernel; else the
    same in matmuls (scores in fp32)."""
    if flash:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask)
        lse = lse.to(compute_dtype(q.dtype))
        if mask is not None:  # the kernel reports 0, not -inf, for a query whose keys are all masked
            empty = torch.isinf(mask).all(dim=-1)  # [B, 1, 1] (a key mask) or [B, 1, Sq] (a tile of documents)
            lse = lse.masked_fill(empty, NEG_INF)
            out = out.masked_fill(empty[..., None], 0.0)
        return out, lse
    scores = _scores(q, k, causal, mask)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - _finite(lse)[..., None]), v.to(scores.dtype)).to(q.dtype), lse


def _block_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                    mask: Optional[Tensor], *, flash: bool) -> tuple[Tensor, Tensor, Tensor]:
    """One block's share of ``(dq, dk, dv)`` given the *whole* attention's output and log-sum-exp (FlashAttention's
    backward: the block's probabilities are ``exp(scores - lse)``, and ``rowsum(dO * O)`` is the whole's)."""
    if flash:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, _finite(lse).to(torch.float64 if q.dtype == torch.float64 else torch.float32), 0.0,
            causal, attn_mask=mask)
    dtype = compute_dtype(q.dtype)
    grad, q, k, v, out = (t.to(dtype) for t in (grad, q, k, v, out))
    probs = torch.exp(_scores(q, k, causal, mask) - _finite(lse)[..., None])
    delta = (grad * out).sum(dim=-1, keepdim=True)
    dscores = probs * (torch.matmul(grad, v.transpose(-1, -2)) - delta)
    scale = 1.0 / math.sqrt(q.shape[-1])
    return (torch.matmul(dscores, k) * scale, torch.matmul(dscores.transpose(-1, -2), q) * scale,
            torch.matmul(probs.transpose(-1, -2), grad))


def _scores(q: Tensor, k: Tensor, causal: bool, mask: Optional[Tensor]) -> Tensor:
    """``q k^T / sqrt(d)`` in fp32 (fp64 for fp64), the causal and additive masks applied."""
    dtype = compute_dtype(q.dtype)
    scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, NEG_INF)
    return scores if mask is None else scores + mask.to(dtype)


def _finite(lse: Tensor) -> Tensor:
    """A row with no key to attend to has log-sum-exp -inf; read it as 0 so that its probabilities are 0, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _heads(kv: Tensor, heads: int) -> Tensor:
    """Grouped-query key/value heads ``[B, G, S, D]`` repeated for their query heads ``[B, H, S, D]`` (head ``h``
    reads group ``h // (H / G)``): one block at a time, so the copy is transient."""
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _grouped_sum(grad: Tensor, groups: int) -> Tensor:
    """The gradient of :func:`_heads`: each group's query heads' shares summed."""
    batch, heads, seq, dim = grad.shape
    return grad if heads == groups else grad.view(batch, groups, heads // groups, seq, dim).sum(dim=2)


class Block:
    """Which queries and keys of the rank's ``S_l`` positions the block of one source computes (see the module
    docstring); ``step``: the source is rank ``rank - step``. With a document mask the block is computed tile by
    tile (``documents.py``), skipping tiles whose queries and keys share no document."""

    def __init__(self, *, step: int, rank: int, size: int, causal: bool, length: int) -> None:
        source = (rank - step) % size
        half = length // 2
        self.rank, self.source, self.length = rank, source, length
        self.causal = causal and source == rank
        self.rows, self.cols = slice(0, length), slice(0, length)
        if causal and source < rank:
            self.cols = slice(0, half)
        elif causal and source > rank:
            self.rows = slice(half, length)

    def _positions(self, whole: Tensor, rank: int) -> Tensor:
        """Rank ``rank``'s part of a ``[B, n * S_l]`` per-position tensor in the ring's order."""
        return whole[:, rank * self.length:(rank + 1) * self.length]

    def _parts(self, key_mask: Optional[Tensor], documents: Optional[DocumentMask], dtype: torch.dtype
               ) -> Iterator[tuple[slice, slice, bool, Optional[Tensor]]]:
        """``(rows, cols, causal, additive mask)`` of each kernel call: the whole block with the source's key-padding
        mask, or its tiles that share a document, each with its own mask (causality folded in)."""
        keys = None if key_mask is None else self._positions(key_mask, self.source)
        if documents is None:
            padding = None if keys is None else keys[:, None, None, self.cols]
            yield self.rows, self.cols, self.causal, _additive(padding, dtype)
            return
        ids = documents.ids
        queries, sources = self._positions(ids, self.rank), self._positions(ids, self.source)
        for rows, cols, on_diagonal in documents.tiles(queries, sources, self.rows, self.cols, self.causal):
            yield rows, cols, False, _additive(documents.keep(queries, sources, rows, cols, on_diagonal, keys), dtype)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], documents: Optional[DocumentMask],
                out: Tensor, lse: Tensor) -> None:
        """Attend ``q`` (the rank's, ``[B, H, S_l, D]``) to the source's ``k, v`` (``[B, G, S_l, D]``) and merge the
        block into the running ``out`` and ``lse`` (compute dtype) in place."""
        heads = q.shape[1]
        for rows, cols, causal, mask in self._parts(key_mask, documents, q.dtype):
            kb, vb = (_heads(t[:, :, cols], heads) for t in (k, v))
            block_out, block_lse = _block_forward(q[:, :, rows], kb, vb, causal, mask,
                                                  flash=uses_flash_kernel(q.device))
            merged = torch.logaddexp(lse[..., rows], block_lse)
            safe = _finite(merged)
            out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[..., rows] - safe)[..., None]
                               + block_out.to(out.dtype) * torch.exp(block_lse - safe)[..., None])
            lse[..., rows] = merged

    def backward(self, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 key_mask: Optional[Tensor], documents: Optional[DocumentMask], dq: Tensor, dk: Tensor,
                 dv: Tensor) -> None:
        """Add this block's gradients: to ``dq`` (the rank's queries) and to ``dk, dv`` (the source's keys and
        values, ``[B, G, S_l, D]``), all in the compute dtype, in place."""
        heads, groups = q.shape[1], k.shape[1]
        for rows, cols, causal, mask in self._parts(key_mask, documents, q.dtype):
            kb, vb = (_heads(t[:, :, cols], heads) for t in (k, v))
            dq_block, dk_block, dv_block = _block_backward(
                grad[:, :, rows], q[:, :, rows], kb, vb, out[:, :, rows], lse[..., rows], causal, mask,
                flash=uses_flash_kernel(q.device))
            dq[:, :, rows] += dq_block.to(dq.dtype)
            dk[:, :, cols] += _grouped_sum(dk_block.to(dk.dtype), groups)
            dv[:, :, cols] += _grouped_sum(dv_block.to(dv.dtype), groups)


def start(q: Tensor) -> tuple[Tensor, Tensor]:
    """The running output (zeros) and log-sum-exp (-inf) of the online softmax, in the compute dtype. The output
    ``[B, H, S, D]`` is laid out as ``[B, S, H, D]`` in memory, as SDPA's flash kernels lay theirs: attention's
    ``transpose(1, 2).reshape(B, S, H * D)`` is then a view, not a second copy that the projection keeps."""
    dtype = compute_dtype(q.dtype)
    batch, heads, seq, dim = q.shape
    return (torch.zeros(batch, seq, heads, dim, dtype=dtype, device=q.device).transpose(1, 2),
            torch.full(q.shape[:-1], NEG_INF, dtype=dtype, device=q.device))


def save_for_backward(ctx, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, key_mask: Optional[Tensor],
                      documents: Optional[DocumentMask], causal: bool, group) -> None:
    """What the block attentions' backward needs: the inputs, the whole output and log-sum-exp, the pattern (the
    document ids among the saved tensors, so that they are counted with the rest), the group."""
    ctx.save_for_backward(q, k, v, out, lse, key_mask, None if documents is None else documents.ids)
    ctx.causal, ctx.group, ctx.has_mask = causal, group, key_mask is not None
    ctx.tile = None if documents is None else documents.tile


def saved(ctx) -> tuple:
    """``(q, k, v, out, lse, key_mask, documents, causal, group)`` as :func:`save_for_backward` kept them."""
    q, k, v, out, lse, key_mask, ids = ctx.saved_tensors
    documents = None if ctx.tile is None else DocumentMask(ids, ctx.tile)
    return q, k, v, out, lse, key_mask if ctx.has_mask else None, documents, ctx.causal, ctx.group

