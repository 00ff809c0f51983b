"""Self-attention: multi-head, grouped-query and multi-query, from one fused projection.

The fused ``qkv`` output is laid out by query group: for each of the ``num_query_groups``
groups, its query heads, then its key head, then its value head (``head_dim`` channels
each). Multi-head attention is the case of one query head per group, i.e. GPT-2's
head-major ``[head, (q, k, v), head_dim]``. A contiguous column split over tensor-parallel
ranks therefore hands each rank whole groups; with more ranks than groups the strategy's
``QueryGroupColumn`` style gives each rank some query heads of one group plus that group's
key and value heads. Either way the local layout is ``[group, (q heads, k, v), head_dim]``
and the module reads it from its weight, so one class serves every layout.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_megatron.context_parallel.documents import DocumentMask
from lightning_megatron.context_parallel.local import document_attention
from lightning_megatron.context_parallel.masks import BlockPattern
from lightning_megatron.models.softcap import softcapped_attention


class CoreAttention(nn.Module):
    """``dropout(softmax(q k^T / sqrt(d))) v``, without parameters.

    A module of its own so that selective activation recomputation (Korthikanti et al.
    2022) can recompute just this part: its saved activations grow with the square of the
    sequence length while its FLOPs are a small share of the layer's. With fewer key/value
    heads than query heads, SDPA's grouped-query path (``enable_gqa``) reads each key/value
    head for its group of query heads without materialising repeated copies.

    ``window``: a sliding window, each query sees the ``window`` keys ending at its own position (transformers'
    ``kv_idx > q_idx - window``); the queries are the last ``Lq`` positions of the ``Lk`` keys (the whole sequence, or
    a generation step's new tokens after the cached ones). Causal, without dropout, it runs the block attention of
    ``context_parallel.local`` (O(S) memory, tiles outside the window skipped); otherwise SDPA over a boolean mask.
    ``softmax_scale``: the factor of ``q k^T`` (None: ``1 / sqrt(d)``), applied by scaling ``q`` so that every
    kernel, context parallelism's included, computes it. ``softcap``: scores become ``cap * tanh(scores / cap)``
    before the mask (``models.softcap``: dense scores, kept for backward; refused under context parallelism).
    ``sinks`` (a forward argument, the owning attention's parameter: this module has none): a learned logit per
    head in each softmax's denominator (GPT-OSS): merged last into the block attention's online softmax where that
    runs (whole causal sequences, packed documents, windows: O(S) memory), else (a KV cache, a boolean mask,
    attention dropout) on the same dense path as ``softcap``.
    """

    def __init__(self, *, attention_dropout: float, causal: bool, window: Optional[int] = None,
                 softmax_scale: Optional[float] = None, softcap: Optional[float] = None) -> None:
        super().__init__()
        self.attention_dropout, self.causal = attention_dropout, causal
        self.window, self.softmax_scale, self.softcap = window, softmax_scale, softcap
        # Set by a context-parallel layout (lightning_megatron.context_parallel): attention of this rank's part of
        # the sequence over every rank's keys. It is given :meth:`attend` for calls on whole sequences.
        self.context_parallel: Optional[nn.Module] = None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, attention_mask: Union[Tensor, DocumentMask, None] = None, *,
                causal: Optional[bool] = None, sinks: Optional[Tensor] = None) -> Tensor:
        """``attention_mask``: booleans (True = attend), or the document ids of packed samples; ``causal``:
        overrides the module's pattern (generation: one new query attends to every cached key); ``sinks``:
        ``[heads]`` sink logits of this rank's heads, or None."""
        causal = self.causal if causal is None else causal
        if self.softmax_scale is not None:  # the kernels divide by sqrt(d): q k^T * softmax_scale in all of them
            q = q * (self.softmax_scale * math.sqrt(q.shape[-1]))
        if self.context_parallel is not None:
            return self.context_parallel(q, k, v, attention_mask, causal=causal, local=partial(self.attend, sinks=sinks),
                                         window=self.window, sinks=sinks)
        return self.attend(q, k, v, attention_mask, causal, sinks=sinks)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, attention_mask: Union[Tensor, DocumentMask, None],
               causal: bool, sinks: Optional[Tensor] = None) -> Tensor:
        """SDPA over the keys given; a :class:`DocumentMask` or a sliding window in O(S) memory by
        ``document_attention`` (torch's CPU flash kernel tile by tile on CPU, FlexAttention's fused kernels on CUDA:
        ``context_parallel/kernels.py``), except under attention dropout, which only SDPA draws, over the dense
        mask; soft-capped scores by ``models.softcap`` over the dense mask."""
        dropout = self.attention_dropout if self.training else 0.0
        window = self.window if self.window is not None and self.window < k.shape[2] else None  # else: no effect
        whole = causal and q.shape[2] == k.shape[2] and not dropout
        blockwise = isinstance(attention_mask, DocumentMask) and not dropout or (whole and attention_mask is None)
        if sinks is not None and self.softcap is None and blockwise:
            return document_attention(q, k, v, attention_mask, causal=causal, window=window, sinks=sinks)
        if self.softcap is not None or sinks is not None:
            return softcapped_attention(q, k, v, self._keep(q, k, attention_mask, causal, window), cap=self.softcap,
                                        dropout=dropout, sinks=sinks)
        if isinstance(attention_mask, DocumentMask) and not dropout or (window and whole and attention_mask is None):
            return document_attention(q, k, v, attention_mask, causal=causal, window=window)
        if isinstance(attention_mask, DocumentMask) or window:
            attention_mask, causal = self._keep(q, k, attention_mask, causal, window), False
        grouped = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attention_mask,
            dropout_p=dropout,
            is_causal=causal and attention_mask is None,
            **({"enable_gqa": True} if grouped else {}),
        )

    @staticmethod
    def _keep(q: Tensor, k: Tensor, attention_mask: Union[Tensor, DocumentMask, None], causal: bool,
              window: Optional[int]) -> Optional[Tensor]:
        """``[B or 1, 1, Lq, Lk]`` booleans (True = attend) of the pattern: causal, the window, the documents, and a
        boolean ``attention_mask``'s own (the queries being the last ``Lq`` of the ``Lk`` key positions)."""
        documents = attention_mask if isinstance(attention_mask, DocumentMask) else None
        given = None if documents is not None else attention_mask
        if not causal and window is None and documents is None:
            return given
        lq, lk = q.shape[2], k.shape[2]
        positions = torch.arange(lk, device=q.device)
        keep = BlockPattern(q_pos=positions[lk - lq:], k_pos=positions, causal=causal, window=window).keep()
        if documents is not None:
            keep = keep & documents.dense(causal=False)
        return keep if given is None else keep & given


class SelfAttention(nn.Module):
    """``proj(attention(rotary(q), rotary(k), v))`` with ``q, k, v`` from one fused projection.

    ``num_query_groups`` (default ``num_heads``: multi-head) key/value heads are shared by
    ``num_heads / num_query_groups`` query heads each; 1 is multi-query attention.
    ``rotary``: a :class:`~lightning_megatron.models.rotary.RotaryEmbedding`, or ``None`` when
    positions are added to the embeddings instead. ``head_dim``: each head's channels (default
    ``hidden_size / num_heads``; Qwen3's are wider). ``qk_norm``: builds a norm over ``head_dim``
    channels, applied to every query head (``q_norm``) and key head (``k_norm``) before rotary positions,
    one gain shared by all heads (Qwen3's, OLMo's per-head form); ``None``: none. ``window``, ``softmax_scale``,
    ``softcap``: :class:`CoreAttention`'s (a sliding window, the scores' factor, tanh soft-capping). ``sinks``: a
    learned sink logit per query head (``self.sinks`` ``[num_heads]``, GPT-OSS's; zeros at init, as no sink at all
    is ``-inf``), which :class:`CoreAttention` adds to each softmax's denominator.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        num_query_groups: Optional[int] = None,
        attention_dropout: float,
        causal: bool,
        qkv_bias: bool = True,
        proj_bias: bool = True,
        rotary: Optional[nn.Module] = None,
        head_dim: Optional[int] = None,
        qk_norm: Optional[Callable[[], nn.Module]] = None,
        window: Optional[int] = None,
        softmax_scale: Optional[float] = None,
        softcap: Optional[float] = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        groups = num_query_groups or num_heads
        if num_heads % groups:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_query_groups={groups}: each key/value "
                             f"head serves the same number of query heads.")
        self.head_dim = head_dim or hidden_size // num_heads
        self.heads_per_group = num_heads // groups
        self.qkv = nn.Linear(hidden_size, (num_heads + 2 * groups) * self.head_dim, bias=qkv_bias)
        self.q_norm = None if qk_norm is None else qk_norm()
        self.k_norm = None if qk_norm is None else qk_norm()
        self.rotary = rotary
        self.core_attention = CoreAttention(attention_dropout=attention_dropout, causal=causal, window=window,
                                            softmax_scale=softmax_scale, softcap=softcap)
        self.proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=proj_bias)
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None

    def local_layout(self) -> tuple[int, int]:
        """(query groups, query heads per group) in this rank's ``qkv`` rows: whole groups, or a part of one
        group's query heads when the key/value heads are replicated over more ranks than groups."""
        rows = self.qkv.weight.shape[0] // self.head_dim
        groups = max(1, rows // (self.heads_per_group + 2))
        return groups, rows // groups - 2

    def forward(self, x: Tensor, attention_mask: Optional[Tensor] = None, positions: Optional[Tensor] = None,
                kv_cache=None) -> Tensor:
        """``kv_cache``: when generating, the keys and values of the tokens before ``x`` (a
        :class:`~lightning_megatron.generation.KVCache`): this call's are appended to it, attention reads all of
        them, and the cache's pattern applies (causal over the cached positions, padding excluded)."""
        qkv = self.qkv(x)
        batch, seq = qkv.shape[:2]  # the full sequence, also when x is a sequence-parallel chunk
        groups, heads_per_group = self.local_layout()
        qkv = qkv.view(batch, seq, groups, heads_per_group + 2, self.head_dim)
        q, k, v = qkv.split([heads_per_group, 1, 1], dim=3)
        q = q.reshape(batch, seq, groups * heads_per_group, self.head_dim).transpose(1, 2)
        k, v = k.squeeze(3).transpose(1, 2), v.squeeze(3).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(q, k, positions)
            # Attention saves q, k and v for backward; v alone, a view, would keep the whole qkv output alive (its
            # unrotated queries and keys too, (a + g) d a token): a compact copy of v lets that storage go.
            v = v.contiguous()
        causal = None
        if kv_cache is not None:
            k, v = kv_cache.append(self, k, v)
            attention_mask, causal = kv_cache.mask, kv_cache.causal
        y = self.core_attention(q, k, v, attention_mask, causal=causal, sinks=self.sinks)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, groups * heads_per_group * self.head_dim))
