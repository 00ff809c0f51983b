"""Document-masked attention over a whole sequence on one rank: the ring's block attention with a ring of one.

With the sequence whole (no context parallelism, or generation and prediction under it) the one block is the
rank's own tokens, causal, masked by the document ids (``documents.py``) and/or a sliding window, on the
device's back end (``kernels.py``); no message is sent.
Backward recomputes each block's probabilities from the saved output and log-sum-exp (``blocks.py``), so what is
kept for backward grows linearly in the sequence length.

Attention sinks (GPT-OSS: a learned logit ``s_h`` per head in every softmax's denominator) are one more key of logit
``s_h`` and value zero: merged last into the online softmax, they scale the output by ``exp(L - L')`` and make the
log-sum-exp ``L' = logaddexp(L, s_h)``. Backward with that output and ``L'`` is then the sink attention's own (the
sink's zero value adds nothing to ``dv``), and the sink's gradient is ``-sum over queries of exp(s_h - L') D``,
``D = rowsum(grad * out)``, as for any key's score.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_megatron.context_parallel.blocks import (Block, compute_dtype, merge_sinks, save_for_backward, saved,
                                                        sinks_grad, start)
from lightning_megatron.context_parallel.documents import DocumentMask


class LocalDocumentAttention(torch.autograd.Function):
    """``q`` [B, H, S, D], ``k, v`` [B, G, S, D] (grouped-query when G < H); ``documents.ids`` [B, S], or None (a
    sliding window over the whole sequence)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, documents: Optional[DocumentMask], causal: bool,
                window: Optional[int], sinks: Optional[Tensor] = None) -> Tensor:
        out, lse = start(q)
        _block(q, causal).forward(q, k, v, None, documents, out, lse, window=window)
        out, lse = merge_sinks(out, lse, sinks)  # the sink, merged last (module docstring)
        out = out.to(q.dtype)
        save_for_backward(ctx, q, k, v, out, lse, None, documents, causal, None, window)
        ctx.sink_values = None if sinks is None else sinks.detach()
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse, _, documents, causal, _, window = saved(ctx)
        dtype = compute_dtype(q.dtype)
        dq, dk, dv = (torch.zeros(t.shape, dtype=dtype, device=t.device) for t in (q, k, v))
        _block(q, causal).backward(grad_out.contiguous(), q, k, v, out, lse, None, documents, dq, dk, dv,
                                   window=window)
        sinks = ctx.sink_values
        dsinks = None if sinks is None else sinks_grad(grad_out, out, lse, sinks)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, dsinks


def _block(q: Tensor, causal: bool) -> Block:
    return Block(step=0, rank=0, size=1, causal=causal, length=q.shape[2])


def document_attention(q: Tensor, k: Tensor, v: Tensor, documents: Optional[DocumentMask], *, causal: bool,
                       window: Optional[int] = None, sinks: Optional[Tensor] = None) -> Tensor:
    """Softmax attention of each query over the keys of its own document (``documents`` None: one document) and,
    if ``causal``, not after it; with a sliding ``window``, only the keys less than ``window`` positions away;
    ``sinks`` ``[H]``: each head's sink logit in the softmax's denominator (module docstring)."""
    if documents is not None and documents.ids.shape != (q.shape[0], q.shape[2]):
        raise ValueError(f"Document ids of shape {list(documents.ids.shape)} do not match the {q.shape[0]} sequences "
                         f"of {q.shape[2]} queries attention got: give one id per token, [batch, sequence].")
    return LocalDocumentAttention.apply(q, k, v, documents, causal, window, sinks)
