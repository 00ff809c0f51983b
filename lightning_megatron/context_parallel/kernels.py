"""One block's attention and its gradients: one interface, a back end per device (chosen in :func:`backend_for`).

A back end computes a block of queries against a block of keys under a :class:`~.masks.BlockPattern` and gives
``(rows, output, log-sum-exp)`` parts, which the caller merges by the online softmax (``blocks.py``); its
backward takes the *whole* attention's output ``O`` and log-sum-exp ``L`` (not the block's) and gives
``(rows, cols, dq, dk, dv)`` parts: FlashAttention's backward, whose probabilities ``exp(q k^T / sqrt(d) - L)``
and ``rowsum(dO * O)`` are then the whole attention's, so each block's share of the gradients is exact without
the other blocks. No back end builds an ``[S, S]`` tensor:

* :class:`CpuFlash` (CPU): torch's fused CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu`` and
  its backward, which return and take the log-sum-exp). An unmasked block (or one with key padding only) is one
  call; a block with documents or a window is cut into ``tile x tile`` tiles (:meth:`BlockPattern.tile_plan`:
  tiles that keep nothing are skipped), each with its own small additive mask.
* :class:`Flex` (CUDA): FlexAttention compiled to fused Triton kernels. The block's
  :class:`~torch.nn.attention.flex_attention.BlockMask` is built on the device from the pattern's tile test
  (skipped, partial and full 128 x 128 blocks; no host transfer) with the pattern's ``mask_mod``; forward
  returns the log-sum-exp, and backward calls Flex's backward operator directly with the whole ``O`` and ``L``
  (Flex's Triton kernels keep the log-sum-exp in base 2). Grouped-query heads are read in place
  (``enable_gqa``). Off CUDA the same calls run eagerly (dense scores per block): that is how the CUDA back
  end's masks and arithmetic are tested on CPU, and what a device other than CPU or CUDA gets.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Optional, Protocol

import torch
from torch import Tensor

from lightning_megatron.context_parallel.masks import BlockPattern

NEG_INF = float("-inf")
#: The query/key block size of FlexAttention's block masks (its kernels' default tile).
FLEX_BLOCK = 128

Forward = Iterator[tuple[slice, Tensor, Tensor]]
Backward = Iterator[tuple[slice, slice, Tensor, Tensor, Tensor]]


class AttentionBackend(Protocol):
    """``q`` ``[B, H, Lq, D]``, ``k, v`` ``[B, G, Lk, D]`` (``G`` divides ``H``); ``out`` ``[B, H, Lq, D]`` and
    ``lse`` ``[B, H, Lq]`` the whole attention's rows of this block; parts' ``dk, dv`` have ``G`` heads."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, pattern: BlockPattern) -> Forward: ...

    def backward(self, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 pattern: BlockPattern) -> Backward: ...


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit and fp32 inputs (fp64 stays fp64): the dtype of the online softmax and the gradients."""
    return torch.promote_types(dtype, torch.float32)


def finite(lse: Tensor) -> Tensor:
    """A row with no key to attend to has log-sum-exp -inf; read it as 0 so that its probabilities are 0, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


class CpuFlash:
    """torch's fused CPU flash-attention kernel, the whole block or tile by tile (see the module docstring)."""

    def _parts(self, pattern: BlockPattern, dtype: torch.dtype
               ) -> Iterator[tuple[slice, slice, bool, Optional[Tensor]]]:
        """``(rows, cols, causal, additive mask)`` of each kernel call."""
        rows, cols = slice(0, pattern.shape[0]), slice(0, pattern.shape[1])
        if pattern.q_ids is None and pattern.window is None:
            padding = None if pattern.k_keep is None else pattern.k_keep[:, None, None, :]
            yield rows, cols, pattern.triangle, _additive(padding, dtype)
            return
        for rows, cols in pattern.tile_plan(pattern.tile):
            yield rows, cols, False, _additive(pattern.keep(rows, cols), dtype)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, pattern: BlockPattern) -> Forward:
        heads = q.shape[1]
        for rows, cols, causal, mask in self._parts(pattern, q.dtype):
            kb, vb = (_heads(t[:, :, cols], heads) for t in (k, v))
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, :, rows], kb, vb, 0.0, causal, attn_mask=mask)
            lse = lse.to(compute_dtype(q.dtype))
            if mask is not None:  # the kernel reports 0, not -inf, for a query whose keys are all masked
                empty = torch.isinf(mask).all(dim=-1)  # [B, 1, 1] (a key mask) or [B, 1, rows] (a tile)
                lse = lse.masked_fill(empty, NEG_INF)
                out = out.masked_fill(empty[..., None], 0.0)
            yield rows, out, lse

    def backward(self, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 pattern: BlockPattern) -> Backward:
        heads, groups = q.shape[1], k.shape[1]
        lse = finite(lse).to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        for rows, cols, causal, mask in self._parts(pattern, q.dtype):
            kb, vb = (_heads(t[:, :, cols], heads) for t in (k, v))
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad[:, :, rows], q[:, :, rows], kb, vb, out[:, :, rows], lse[..., rows], 0.0, causal, attn_mask=mask)
            wide = compute_dtype(q.dtype)  # the query heads' shares summed in the compute dtype, not in 16 bits
            yield rows, cols, dq, _grouped_sum(dk.to(wide), groups), _grouped_sum(dv.to(wide), groups)


class Flex:
    """FlexAttention with the pattern's block mask; ``compiled``: through ``torch.compile`` (fused kernels, CUDA),
    else eager (see the module docstring)."""

    def __init__(self, *, compiled: bool) -> None:
        self.compiled = compiled
        # Compiled: Flex's Triton kernels, whose log-sum-exp (base 2) the backward operator reads; pinned so that no
        # other Flex back end's convention can slip in.
        self.kernel_options = {"BACKEND": "TRITON"} if compiled else None
        self._forward: Optional[Callable] = None
        self._backward: Optional[Callable] = None

    def _functions(self) -> tuple[Callable, Callable]:
        if self._forward is None:  # compiled on first use, once per process
            wrap = (lambda f: torch.compile(f, fullgraph=True)) if self.compiled else (lambda f: f)
            self._forward, self._backward = wrap(_flex_forward), wrap(_flex_backward)
        return self._forward, self._backward

    def _options(self, q: Tensor, k: Tensor, v: Tensor) -> dict:
        """Flex's kernel options, completed as its own entry point completes them (the backward operator takes
        them whole)."""
        from torch.nn.attention.flex_attention import _apply_kernel_options

        return _apply_kernel_options(q, k, v, True, self.kernel_options)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, pattern: BlockPattern) -> Forward:
        flex_forward, _ = self._functions()
        out, lse = flex_forward(q, k, v, block_mask(pattern), q.shape[1] != k.shape[1], self.kernel_options)
        yield slice(0, pattern.shape[0]), out, lse.to(compute_dtype(q.dtype))

    def backward(self, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 pattern: BlockPattern) -> Backward:
        _, flex_backward = self._functions()
        stats = torch.float64 if q.dtype == torch.float64 else torch.float32
        dq, dk, dv = flex_backward(q, k, v, out.to(q.dtype).contiguous(), finite(lse).to(stats).contiguous(),
                                   grad.to(q.dtype).contiguous(), block_mask(pattern), 1.0 / math.sqrt(q.shape[-1]),
                                   self._options(q, k, v))
        yield slice(0, pattern.shape[0]), slice(0, pattern.shape[1]), dq, dk, dv


def block_mask(pattern: BlockPattern):
    """The pattern's FlexAttention ``BlockMask``: ``FLEX_BLOCK``-sized blocks that keep nothing are skipped,
    blocks kept whole run without the ``mask_mod``, the rest with it; built on the device from the pattern's tile
    test, so no ``[S, S]`` tensor and no host transfer. Cached with the pattern's plans (a ``DocumentMask``'s:
    every layer and backward reuse it) when it has documents and no key padding (which the cache key does not
    hold)."""
    from torch.nn.attention.flex_attention import BlockMask

    key = ("flex", *pattern.key)
    cache = pattern.plans if pattern.q_ids is not None and pattern.k_keep is None and pattern.key else None
    if cache is not None and key in cache:
        return cache[key]
    some, every = pattern.tiles(FLEX_BLOCK)
    partial = some & ~every
    built = BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(every), BLOCK_SIZE=FLEX_BLOCK,
                                     mask_mod=pattern.mask_mod(FLEX_BLOCK), seq_lengths=pattern.shape)
    if cache is not None:
        cache[key] = built
    return built


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Flex's sparse form of ``[B, row blocks, col blocks]`` booleans: per row block the count of True and their
    column indices first (``[B, 1, rows]``, ``[B, 1, rows, cols]``, int32; one head, broadcast over all)."""
    counts = blocks.sum(-1, dtype=torch.int32)
    indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[:, None], indices[:, None]


def _score(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Flex's score modification: none (plain softmax attention)."""
    return score


def _flex_forward(q: Tensor, k: Tensor, v: Tensor, mask, gqa: bool, options: Optional[dict]) -> tuple[Tensor, Tensor]:
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    out, aux = flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=options,
                              return_aux=AuxRequest(lse=True))
    return out, aux.lse


def _flex_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad: Tensor, mask, scale: float,
                   options: dict) -> tuple[Tensor, Tensor, Tensor]:
    """Flex's backward operator with the whole attention's ``out`` and natural log-sum-exp ``lse`` (finite)."""
    from torch._higher_order_ops.flex_attention import flex_attention_backward

    dq, dk, dv, _ = flex_attention_backward(q, k, v, out, lse * math.log2(math.e), grad, None, _score, None,
                                            mask.as_tuple(), scale, options, (), ())
    return dq, dk, dv


def _additive(keep: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """Booleans (True = attend) as SDPA's additive mask (0 or -inf) in ``dtype``."""
    if keep is None:
        return None
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, NEG_INF)


def _heads(kv: Tensor, heads: int) -> Tensor:
    """Grouped-query key/value heads ``[B, G, S, D]`` repeated for their query heads ``[B, H, S, D]`` (head ``h``
    reads group ``h // (H / G)``): one tile at a time, so the copy is transient."""
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _grouped_sum(grad: Tensor, groups: int) -> Tensor:
    """The gradient of :func:`_heads`: each group's query heads' shares summed."""
    batch, heads, seq, dim = grad.shape
    return grad if heads == groups else grad.view(batch, groups, heads // groups, seq, dim).sum(dim=2)


CPU_FLASH = CpuFlash()
FLEX_COMPILED = Flex(compiled=True)
FLEX_EAGER = Flex(compiled=False)


def backend_for(device: torch.device) -> AttentionBackend:
    """The one place the device picks the kernels: CPU, torch's fused CPU kernel; CUDA, FlexAttention compiled;
    any other device, FlexAttention eager (right numbers, but each block's scores computed whole)."""
    if device.type == "cpu":
        return CPU_FLASH
    return FLEX_COMPILED if device.type == "cuda" else FLEX_EAGER
