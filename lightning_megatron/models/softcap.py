"""Attention with soft-capped scores (Gemma 2's ``attn_logit_softcapping``): ``cap * tanh(q k^T / sqrt(d) / cap)``,
and/or with attention sinks (GPT-OSS's ``sinks``: a learned logit per head in every softmax's denominator).

The cap bends every score before the mask and the softmax, which no fused kernel here takes (SDPA has no score
hook, torch's CPU flash kernel neither), so this path computes the scores densely, as ``transformers``' eager
attention does: ``[B, H, Lq, Lk]`` scores, their tanh and fp32 softmax, then ``probs @ v``, autograd keeping the
tanh and the probabilities for backward (``plan.activations`` counts them). Correctness over speed: Gemma 3's
published configs leave the cap unset, and only then is this path taken. FlexAttention's ``score_mod`` could fuse it
on CUDA; not done yet. Context parallelism refuses it (``context_parallel.apply``): the ring's blocks merge by a
log-sum-exp its kernels compute without the cap.

A sink is one more key per head whose score is the learned ``s_h`` and whose value is zero: it takes a share of
each query's probability and gives nothing back, so a query may attend to "nothing" (Xiao et al. 2023; GPT-OSS).
The same dense scores take it as one more column, dropped after the softmax, as transformers' eager attention does
(the path of sinks where the block attention does not run: a KV cache, a boolean mask, attention dropout).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def softcapped_attention(q: Tensor, k: Tensor, v: Tensor, keep: Optional[Tensor], *, cap: Optional[float],
                         dropout: float = 0.0, sinks: Optional[Tensor] = None) -> Tensor:
    """``softmax(cap * tanh(q k^T / sqrt(d) / cap) masked by keep) v``; ``q`` ``[B, H, Lq, D]``, ``k, v``
    ``[B, G, Lk, D]`` (grouped-query: each key/value head serves ``H / G`` query heads); ``keep``: booleans
    broadcast to ``[B, H, Lq, Lk]`` (True = attend) or None (every key). The softmax runs in fp32 (fp64 stays fp64),
    its probabilities in ``q``'s dtype, as transformers' eager attention. ``cap`` None: scores not capped;
    ``sinks`` ``[H]``: each head's sink logit, a column of the softmax dropped after it (module docstring)."""
    heads = q.shape[1]
    if k.shape[1] != heads:
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    dtype = torch.promote_types(q.dtype, torch.float32)
    if sinks is None:
        probs = F.softmax(scores, dim=-1, dtype=dtype).to(q.dtype)
    else:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = F.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=dtype)[..., :-1].to(q.dtype)
    if dropout:
        probs = F.dropout(probs, p=dropout)
    return torch.matmul(probs, v)
