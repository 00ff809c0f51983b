"""Document masks of packed samples, applied block by block: no ``S x S`` tensor is ever built or kept.

A packed sample holds several documents, and Megatron-LM's ``reset_attention_mask`` confines each token to the
earlier tokens of its own document. Written as a dense ``[B, 1, S, S]`` mask that costs ``S^2`` bytes per
sample, pushes SDPA off its flash path, and SDPA's math path keeps the mask and the probabilities for backward.
Here the pattern is carried as the ``[B, S]`` document ids only (:class:`DocumentMask`), and the block attention
of ``blocks.py`` (the ring's, with one rank when the sequence is whole) hands each block's ids to its back end
(``kernels.py``) as a ``masks.BlockPattern``: tiles whose queries and keys share no document are skipped, the
others masked tile by tile (CPU) or by FlexAttention's block mask (CUDA). What backward keeps is ``q, k, v``, the
output, its log-sum-exp and the ids: linear in ``S``.

Which tiles to compute is decided from each tile's smallest and largest document id, on the device. A back end
that loops over tiles on the host (the CPU's) needs that decision on the host: one transfer per block, made
once per :class:`DocumentMask` and cached in it (:attr:`DocumentMask.plans`). The model builds one
``DocumentMask`` per micro-batch and hands the same object to every layer, and backward reuses it, so host
transfers per step do not grow with the number of layers (a test counts them). Carrying the cumulative lengths
from the data side instead would save even that one transfer, but would tie every data source to one layout of
the ids; the cache keeps ``document_ids`` the only contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_megatron.context_parallel.masks import DEFAULT_TILE


@dataclass(frozen=True)
class DocumentMask:
    """``ids`` ``[B, S]``: the document of every position (any integers; tokens attend only within their document).

    Passed where a boolean attention mask would go (``CoreAttention``'s ``attention_mask``). Under context
    parallelism ``ids`` covers the whole sequence in the ring's order (``inputs.split_batch`` keeps it whole, as it
    does key-padding masks), so each rank reads the documents of its own queries and of every rank's keys.
    ``tile``: the CPU back end's tile size. ``plans``: the tile plans and block masks the back ends derived from
    ``ids``, per block (filled as they are used; not part of the mask's identity).
    """

    ids: Tensor
    tile: int = DEFAULT_TILE
    plans: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.ids.dim() != 2:
            raise ValueError(f"DocumentMask takes document ids of shape [batch, sequence]; got {list(self.ids.shape)}.")
        if self.tile < 1:
            raise ValueError(f"DocumentMask(tile={self.tile}): a tile holds at least one query and one key.")

    def dense(self, causal: bool) -> Tensor:
        """``[B, 1, S, S]`` booleans, True = attend: same document (and causal). Only for what the blocks cannot do:
        attention dropout, which SDPA draws over the whole matrix, and soft-capped scores (``models.softcap``)."""
        keep = self.ids[:, None, :, None] == self.ids[:, None, None, :]
        if causal:
            seq = self.ids.shape[1]
            keep = keep & torch.ones(seq, seq, dtype=torch.bool, device=self.ids.device).tril()
        return keep
