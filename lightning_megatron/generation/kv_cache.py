"""The keys and values of the tokens generated so far, for every attention layer of this rank.

Generation runs the prompt once (prefill) and then one token per step; without a cache every
step would recompute attention's keys and values for the whole prefix. The cache keeps them in
buffers of the final length, allocated at a layer's first call with that layer's local shape,
so it serves any layout unchanged: under tensor parallelism a layer holds its own key/value heads,
under pipeline parallelism a rank caches only its own layers. Layers are told apart by identity.

Prompts of different lengths are left-padded (as ``transformers`` does): ``valid`` marks the real
tokens, and :attr:`mask` lets every query see the real tokens up to its own position. A padding
position also sees itself, so that no row of the softmax is empty (an empty row is ``nan``, and
``0 * nan`` would leak it into the real tokens' outputs).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn


class KVCache:
    """Keys and values of ``batch_size`` sequences of up to ``max_length`` tokens.

    One forward step: :meth:`start` with the new tokens' validity, the model's attention layers
    :meth:`append` their keys and values, then :meth:`advance`.
    """

    def __init__(self, batch_size: int, max_length: int, *, device: torch.device) -> None:
        self.batch_size, self.max_length, self.device = batch_size, max_length, device
        self.length = 0  # tokens cached before the current step
        self.valid = torch.zeros(batch_size, max_length, dtype=torch.bool, device=device)
        # The current step's pattern: ``mask`` [B, 1, new, length + new] booleans (True = attend), or None and
        # ``causal`` (a prefill: plain causal attention; one new token: it sees every cached one).
        self.mask: Optional[Tensor] = None
        self.causal = True
        self._padded = False
        self._new = 0
        self._buffers: dict[int, tuple[Tensor, Tensor]] = {}

    def start(self, valid: Tensor) -> None:
        """Begin a step over ``valid.shape[1]`` new tokens (``valid``: ``[B, new]``, False at padding)."""
        new = valid.shape[1]
        end = self.length + new
        if end > self.max_length:
            raise ValueError(f"The cache holds {self.max_length} tokens per sequence; this step would make {end}.")
        self.valid[:, self.length:end] = valid
        self._new = new
        self._padded = self._padded or not bool(valid.all())
        if not self._padded and (self.length == 0 or new == 1):  # SDPA's own patterns, its fastest kernels
            self.mask, self.causal = None, self.length == 0
            return
        self.causal = False
        query = torch.arange(self.length, end, device=self.device)[:, None]
        key = torch.arange(end, device=self.device)[None, :]
        mask = (key <= query) & self.valid[:, None, :end]
        self.mask = (mask | (key == query)).unsqueeze(1)

    def append(self, layer: nn.Module, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``layer``'s keys and values ``[B, kv_heads, new, head_dim]`` of this step; return all so far."""
        buffers = self._buffers.get(id(layer))
        if buffers is None:
            shape = (*key.shape[:2], self.max_length, key.shape[-1])
            buffers = (key.new_empty(shape), value.new_empty(shape))
            self._buffers[id(layer)] = buffers
        end = self.length + self._new
        keys, values = buffers
        keys[:, :, self.length:end] = key
        values[:, :, self.length:end] = value
        return keys[:, :, :end], values[:, :, :end]

    def advance(self) -> None:
        """The step's tokens are now part of the cached prefix."""
        self.length += self._new
        self._new = 0
