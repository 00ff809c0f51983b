"""Which keys each query of one attention block attends: the mask logic every attention back end reads.

A *block* is the queries of one rank against the keys of one source (``blocks.py``; the whole sequence when there
is one rank). Query ``i`` keeps key ``j`` when all of these that apply hold:

* causal: ``pos_q[i] >= pos_k[j]`` (global positions, so the ring's half-blocks and the two chunks of a rank need
  no special case);
* documents: ``ids_q[b, i] == ids_k[b, j]`` (packed samples, ``documents.py``);
* sliding window ``w``: ``|pos_q[i] - pos_k[j]| < w`` (with causal: the ``w`` latest keys, the query's own
  included, as Mistral, Gemma and GPT-OSS count it);
* key padding: ``keep_k[b, j]``.

:class:`BlockPattern` holds those per-position tensors (``O(S)``) and gives the mask three ways, all from the same
conditions: one tile of booleans (:meth:`~BlockPattern.keep`: the CPU kernel's additive mask, and the dense
reference in tests), which ``tile x tile`` tiles can hold a kept pair and which are kept whole
(:meth:`~BlockPattern.tiles`, from each tile's smallest and largest position and id, so no ``[S, S]`` tensor is
built), and FlexAttention's ``mask_mod`` (:meth:`~BlockPattern.mask_mod`). The range test is exact for documents
that are contiguous runs (as ``GPTDataset`` and the SFT packer make them) and still correct for any ids: a tile
whose id ranges meet is computed, only perhaps in vain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

#: Queries and keys per tile of a back end that loops over tiles (the CPU's): large enough that each tile is one
#: efficient kernel call, small enough that its transient ``[B, 1, tile, tile]`` mask stays a few megabytes.
DEFAULT_TILE = 512


@dataclass(frozen=True)
class BlockPattern:
    """The mask of one block (see the module docstring). ``q_pos`` ``[Lq]`` and ``k_pos`` ``[Lk]``: global
    positions; ``q_ids`` ``[B, Lq]`` / ``k_ids`` ``[B, Lk]``: document ids or None; ``k_keep`` ``[B, Lk]``: key
    padding (True = a real key) or None; ``window``: sliding-window size or None. ``triangle``: the block is a
    causal diagonal (queries and keys are the same positions), which an unmasked kernel runs as its ``is_causal``.
    ``tile``: the tile size of a back end that loops over tiles on the host (``DocumentMask.tile``);
    ``plans``/``key``: where such a tile plan (and a back end's block mask) is cached (``DocumentMask.plans``) and
    under which key; see :meth:`tile_plan`."""

    q_pos: Tensor
    k_pos: Tensor
    causal: bool
    triangle: bool = False
    window: Optional[int] = None
    q_ids: Optional[Tensor] = None
    k_ids: Optional[Tensor] = None
    k_keep: Optional[Tensor] = None
    tile: int = DEFAULT_TILE
    plans: Optional[dict] = None
    key: tuple = ()

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"A sliding window of {self.window} keys leaves a query nothing to attend to: give a "
                             f"window of at least 1 (the query's own position), or None for no window.")
        if (self.q_ids is None) != (self.k_ids is None):
            raise ValueError("BlockPattern takes the document ids of both its queries and its keys, or of neither.")

    @property
    def shape(self) -> tuple[int, int]:
        return self.q_pos.shape[0], self.k_pos.shape[0]

    def keep(self, rows: slice = slice(None), cols: slice = slice(None)) -> Tensor:
        """The ``[B, 1, rows, cols]`` booleans (True = attend) of the tile ``rows x cols`` (batch 1 when nothing
        differs by sample)."""
        q_pos, k_pos = self.q_pos[rows], self.k_pos[cols]
        keep = torch.ones(1, 1, q_pos.shape[0], k_pos.shape[0], dtype=torch.bool, device=q_pos.device)
        if self.causal:
            keep = keep & (q_pos[:, None] >= k_pos[None, :])
        if self.window is not None:
            keep = keep & ((q_pos[:, None] - k_pos[None, :]).abs() < self.window)
        if self.q_ids is not None:
            keep = keep & (self.q_ids[:, None, rows, None] == self.k_ids[:, None, None, cols])
        if self.k_keep is not None:
            keep = keep & self.k_keep[:, None, None, cols]
        return keep

    def tiles(self, tile: int, *, padding: bool = True) -> tuple[Tensor, Tensor]:
        """``(some, every)``: ``[B, row tiles, col tiles]`` booleans (batch 1 when nothing differs by sample) for
        ``tile x tile`` tiles: ``some``, the tile may hold a kept pair (skip it where False); ``every``, every pair
        in it is kept (no mask needed; never a short last tile). Computed on the device from each tile's bounds,
        without a transfer to the host. ``padding=False`` leaves key padding out of ``some`` (then it depends on
        the documents only)."""
        q_lo, q_hi = _bounds(self.q_pos, tile)
        k_lo, k_hi = _bounds(self.k_pos, tile)
        some = torch.ones(1, q_lo.shape[0], k_lo.shape[0], dtype=torch.bool, device=q_lo.device)
        lq, lk = self.shape
        every = some & _whole(q_lo, lq, tile)[:, None] & _whole(k_lo, lk, tile)[None, :]
        if self.causal:
            some = some & (q_hi[:, None] >= k_lo[None, :])
            every = every & (q_lo[:, None] >= k_hi[None, :])
        if self.window is not None:  # the tile's differences pos_q - pos_k span [q_lo - k_hi, q_hi - k_lo]
            low, high = q_lo[:, None] - k_hi[None, :], q_hi[:, None] - k_lo[None, :]
            some = some & (low < self.window) & (high > -self.window)
            every = every & (high < self.window) & (low > -self.window)
        if self.q_ids is not None:
            qi_lo, qi_hi = _bounds(self.q_ids, tile)
            ki_lo, ki_hi = _bounds(self.k_ids, tile)
            some = some & (qi_lo[:, :, None] <= ki_hi[:, None, :]) & (ki_lo[:, None, :] <= qi_hi[:, :, None])
            one = (qi_lo == qi_hi)[:, :, None] & (ki_lo == ki_hi)[:, None, :]
            every = every & one & (qi_lo[:, :, None] == ki_lo[:, None, :])
        if self.k_keep is not None:
            keys = _pad(self.k_keep, tile, False).view(self.k_keep.shape[0], -1, tile)
            if padding:
                some = some & keys.any(-1)[:, None, :]
            every = every & _pad(self.k_keep, tile, True).view(self.k_keep.shape[0], -1, tile).all(-1)[:, None, :]
        return some, every & some

    def tile_plan(self, tile: int) -> list[tuple[slice, slice]]:
        """The ``(rows, cols)`` tiles to compute, for a back end that loops over tiles on the host (the CPU's).

        Deciding it needs the tile test's result on the host: one transfer, made once per block pattern and cached
        in ``plans`` (a ``DocumentMask``'s, which every layer and backward share, or a process-wide cache for
        patterns without documents, which depend on the shapes only). So the number of transfers a training step
        makes is the number of distinct blocks a micro-batch has (the ring's size), whatever the number of layers.
        Key padding is left to each tile's mask (it would make the plan depend on data without documents)."""
        plans = _STATIC_PLANS if self.q_ids is None else self.plans
        key = (*self.key, tile)
        if plans is not None and key in plans:
            return plans[key]
        some, _ = self.tiles(tile, padding=False)
        computed = some.any(0).tolist()
        lq, lk = self.shape
        plan = [(slice(i * tile, min((i + 1) * tile, lq)), slice(j * tile, min((j + 1) * tile, lk)))
                for i, row in enumerate(computed) for j, kept in enumerate(row) if kept]
        if plans is not None and self.key:
            plans[key] = plan
        return plan

    def mask_mod(self, multiple: int) -> Callable:
        """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` for this block. Its tensors are padded to a multiple
        of ``multiple`` (the block size), so that an index in a short last block never reads past them."""
        q_pos, k_pos = _pad(self.q_pos, multiple), _pad(self.k_pos, multiple)
        causal, window = self.causal, self.window
        q_ids = None if self.q_ids is None else _pad(self.q_ids, multiple)
        k_ids = None if self.k_ids is None else _pad(self.k_ids, multiple)
        k_keep = None if self.k_keep is None else _pad(self.k_keep, multiple, False)

        def mask_mod(b, h, q_idx, kv_idx):
            keep = q_idx >= 0  # all True, of the index's type and device
            if causal:
                keep = keep & (q_pos[q_idx] >= k_pos[kv_idx])
            if window is not None:
                keep = keep & ((q_pos[q_idx] - k_pos[kv_idx]).abs() < window)
            if q_ids is not None:
                keep = keep & (q_ids[b, q_idx] == k_ids[b, kv_idx])
            if k_keep is not None:
                keep = keep & k_keep[b, kv_idx]
            return keep

        return mask_mod


#: Tile plans of patterns without documents: they depend on shapes, positions and the window only.
_STATIC_PLANS: dict = {}


def _pad(x: Tensor, multiple: int, value=None) -> Tensor:
    """``x`` padded along its last dimension to a multiple of ``multiple``: with ``value``, or by repeating its last
    entry (which leaves every tile's smallest and largest entry as they were)."""
    extra = -x.shape[-1] % multiple
    if not extra:
        return x
    tail = x[..., -1:].expand(*x.shape[:-1], extra) if value is None else x.new_full((*x.shape[:-1], extra), value)
    return torch.cat([x, tail], dim=-1)


def _bounds(x: Tensor, tile: int) -> tuple[Tensor, Tensor]:
    """Smallest and largest entry of each ``tile`` consecutive entries along the last dimension."""
    tiled = _pad(x, tile).unflatten(-1, (-1, tile))
    return tiled.amin(-1), tiled.amax(-1)


def _whole(like: Tensor, length: int, tile: int) -> Tensor:
    """``[tiles]`` (on ``like``'s device): which tiles of ``length`` positions are a whole ``tile`` long."""
    return torch.arange(1, math.ceil(length / tile) + 1, device=like.device) * tile <= length
