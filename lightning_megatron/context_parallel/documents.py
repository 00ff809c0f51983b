"""Document masks of packed samples, applied tile by tile: no ``S x S`` tensor is ever built or kept.

A packed sample holds several documents, and Megatron-LM's ``reset_attention_mask`` confines each token to the
earlier tokens of its own document. Written as a dense ``[B, 1, S, S]`` mask that costs ``S^2`` bytes per
sample, pushes SDPA off its flash path, and SDPA's math path keeps the mask and the probabilities for backward.
Here the pattern is carried as the ``[B, S]`` document ids only (:class:`DocumentMask`), and the block attention
of ``blocks.py`` (the ring's, with one rank when the sequence is whole) cuts each block of queries and keys into
tiles of ``tile x tile``: a tile whose queries and keys share no document is skipped, the others get a
``tile x tile`` mask built from the ids and dropped after use. What backward keeps is ``q, k, v``, the output,
its log-sum-exp and the ids: linear in ``S``.

Which tiles to compute is decided on the host from each tile's smallest and largest document id (one transfer
per block): tiles whose id ranges do not meet share no document. That test is exact for documents that are
contiguous runs (as ``GPTDataset`` makes them) and still correct, only computing more tiles, for any ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import Tensor

#: Queries and keys per tile: large enough that each tile is one efficient kernel call, small enough that its
#: transient ``[B, 1, tile, tile]`` mask stays a few megabytes.
DEFAULT_TILE = 512


@dataclass(frozen=True)
class DocumentMask:
    """``ids`` ``[B, S]``: the document of every position (any integers; tokens attend only within their document).

    Passed where a boolean attention mask would go (``CoreAttention``'s ``attention_mask``). Under context
    parallelism ``ids`` covers the whole sequence in the ring's order (``inputs.split_batch`` keeps it whole, as it
    does key-padding masks), so each rank reads the documents of its own queries and of every rank's keys.
    """

    ids: Tensor
    tile: int = DEFAULT_TILE

    def __post_init__(self) -> None:
        if self.ids.dim() != 2:
            raise ValueError(f"DocumentMask takes document ids of shape [batch, sequence]; got {list(self.ids.shape)}.")
        if self.tile < 1:
            raise ValueError(f"DocumentMask(tile={self.tile}): a tile holds at least one query and one key.")

    def dense(self, causal: bool) -> Tensor:
        """``[B, 1, S, S]`` booleans, True = attend: same document (and causal). Only for what the tiles cannot do:
        attention dropout, which SDPA draws over the whole matrix."""
        keep = self.ids[:, None, :, None] == self.ids[:, None, None, :]
        if causal:
            seq = self.ids.shape[1]
            keep = keep & torch.ones(seq, seq, dtype=torch.bool, device=self.ids.device).tril()
        return keep

    def tiles(self, queries: Tensor, keys: Tensor, rows: slice, cols: slice, causal: bool
              ) -> Iterator[tuple[slice, slice, bool]]:
        """The ``(rows, cols, on_diagonal)`` tiles of the block ``rows x cols`` that some query attends in:
        ``queries``/``keys`` are the document ids of the block's query and key positions (``[B, L]`` each, indexed
        by ``rows``/``cols``); ``causal``: the block is a causal diagonal (query ``i`` sees keys ``<= i``)."""
        row_tiles = _cut(rows, self.tile)
        col_tiles = _cut(cols, self.tile)
        q_low, q_high = _ranges(queries, row_tiles)
        k_low, k_high = _ranges(keys, col_tiles)
        # [B, row tiles, col tiles] -> any sample: one transfer to the host for the whole block.
        meet = ((q_low[:, :, None] <= k_high[:, None, :]) & (k_low[:, None, :] <= q_high[:, :, None])).any(0).tolist()
        for i, r in enumerate(row_tiles):
            for j, c in enumerate(col_tiles):
                if causal and c.start >= r.stop:  # every key after every query
                    continue
                if meet[i][j]:
                    yield r, c, causal and c.stop > r.start + 1

    @staticmethod
    def keep(queries: Tensor, keys: Tensor, rows: slice, cols: slice, on_diagonal: bool,
             key_mask: Optional[Tensor]) -> Tensor:
        """One tile's ``[B, 1, rows, cols]`` booleans, True = attend: same document, causal on the diagonal, and the
        key-padding mask ``key_mask`` (``[B, L]`` over the block's keys) where given."""
        keep = queries[:, rows, None] == keys[:, None, cols]
        if on_diagonal:
            keep = keep & (torch.arange(rows.start, rows.stop, device=keep.device)[:, None]
                           >= torch.arange(cols.start, cols.stop, device=keep.device)[None, :])
        if key_mask is not None:
            keep = keep & key_mask[:, None, cols]
        return keep[:, None]


def _cut(span: slice, tile: int) -> list[slice]:
    return [slice(start, min(start + tile, span.stop)) for start in range(span.start, span.stop, tile)]


def _ranges(ids: Tensor, tiles: list[slice]) -> tuple[Tensor, Tensor]:
    """``[B, tiles]`` smallest and largest id of each tile."""
    return (torch.stack([ids[:, t].amin(1) for t in tiles], 1), torch.stack([ids[:, t].amax(1) for t in tiles], 1))
