"""Multi-token prediction (DeepSeek-V3, section 2.2; Megatron-Core's ``mtp_num_layers``): a training objective.

Besides the next token, the model learns to predict tokens further ahead through ``D`` small sequential modules.
Depth ``k`` (1..D) takes the previous depth's output as its head reads it (depth 0: the main model's hidden states
after its final norm; depth ``k``'s: after its own ``norm``), as Megatron-Core's decoder and MTP layers hand them on,
and the embeddings of the input tokens ``k`` positions ahead (learned positions: theirs, ``t + k``, as Megatron-Core
rolls the position ids with the tokens; rotary positions in the layer stay ``t``'s); it RMS-normalises each
(``hnorm``, ``enorm``), projects their concatenation ``[embedding; hidden]`` from ``2h`` to ``h`` (``eh_proj``), runs
one transformer layer of the model's kind (``layer``), and its own final norm (``norm``) feeds the model's output
head, which is shared, as is the embedding table. Position ``t`` of depth ``k`` predicts token ``t + k + 1``, i.e. the
main model's label at ``t + k``, counted only where ``t + k`` is inside the sequence and in the same document as ``t``
(packed samples).

The loss the gradient sees is ``L_main + loss_scaling_factor / D * sum_k L_k``, with each ``L_k`` a sum of token
losses normalised like the main loss (by the global batch's count of the main loss's tokens, Megatron-Core's
per-token-loss normalisation). The loss reported (``train_loss``, ``val_loss``) stays the main model's; ``GPT`` logs
the multi-token one as ``mtp_loss``. Generation, prediction and the Hugging Face conversions do not use the modules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor, nn

IGNORE_INDEX = -100


@dataclass(frozen=True)
class MTPConfig:
    """``num_layers``: the prediction depths ``D`` (Megatron-Core's ``mtp_num_layers``; DeepSeek-V3: 1), one
    transformer layer each. ``loss_scaling_factor``: the weight of their mean loss (``mtp_loss_scaling_factor``;
    DeepSeek-V3: 0.3 for its first 10T tokens, then 0.1)."""

    num_layers: int = 1
    loss_scaling_factor: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"MTPConfig.num_layers={self.num_layers!r}: the number of prediction depths must be an "
                             f"integer >= 1 (GPTConfig.mtp=None: no multi-token prediction).")
        factor = self.loss_scaling_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 0:
            raise ValueError(f"MTPConfig.loss_scaling_factor={factor!r} must be a finite number >= 0.")


def ahead(values: Tensor, k: int, fill: int = 0) -> Tensor:
    """``values[:, t + k]`` at ``t``, ``fill`` past the end (those positions are never counted, and a causal layer
    lets nothing earlier see them)."""
    return torch.nn.functional.pad(values[:, k:], (0, k), value=fill)


def shifted_tokens(input_ids: Tensor, depths: int) -> Tensor:
    """``[B, D, S]``: for depth ``k`` (index ``k - 1``) the input tokens ``k`` positions ahead (:func:`ahead`)."""
    return torch.stack([ahead(input_ids, k) for k in range(1, depths + 1)], dim=1)


def shifted_labels(labels: Tensor, depths: int, document_ids: Optional[Tensor] = None) -> Tensor:
    """``[B, D, S]``: depth ``k``'s targets, the main labels ``k`` positions ahead, ``IGNORE_INDEX`` past the end and
    where position ``t + k`` is in another document than ``t`` (``document_ids``, packed samples)."""
    rows = []
    for k in range(1, depths + 1):
        targets = ahead(labels, k, IGNORE_INDEX)
        if document_ids is not None:  # past the end the targets are already ignored
            targets = targets.masked_fill(ahead(document_ids, k) != document_ids, IGNORE_INDEX)
        rows.append(targets)
    return torch.stack(rows, dim=1)


class MTPDepth(nn.Module):
    """One prediction depth: ``enorm``, ``hnorm``, ``eh_proj`` (``2h -> h``, no bias), ``layer`` and ``norm``."""

    def __init__(self, hidden_size: int, layer: nn.Module, make_norm: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.enorm, self.hnorm = make_norm(), make_norm()
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layer = layer
        self.norm = make_norm()

    def forward(self, hidden: Tensor, embedded: Tensor, **layer_kwargs) -> Tensor:
        """The depth's hidden states (before ``norm``), from the previous depth's and the shifted embeddings."""
        return self.layer(self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)), **layer_kwargs)


class MultiTokenPrediction(nn.Module):
    """The ``D`` depths, keyed ``"0"``, ``"1"``, ... in ``depths``, and the model's input ``embedding`` module,
    registered here too: under pipeline parallelism the last stage, which runs these, then holds its own copy of the
    embedding, tied to the first stage's (``pipeline.stage``: ``pipeline_tied``, their gradients summed)."""

    def __init__(self, config: MTPConfig, hidden_size: int, embedding: nn.Module, make_layer: Callable[[int], nn.Module],
                 make_norm: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.embedding = embedding
        self.depths = nn.ModuleDict({str(k): MTPDepth(hidden_size, make_layer(k), make_norm)
                                     for k in range(config.num_layers)})

    def forward(self, hidden: Tensor, tokens: Tensor, *, position_ids: Optional[Tensor] = None,
                layer_kwargs: Optional[dict] = None) -> list[Tensor]:
        """Each depth's output after its ``norm`` (``[B, S, h]``, sequence-parallel shards under tensor
        parallelism; also the next depth's input), from the main model's normalised hidden states and
        ``shifted_tokens`` ``[B, D, S]``."""
        outputs = []
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[-1], device=tokens.device).expand(tokens.shape[0], -1)
        for k, depth in enumerate(self.depths.values()):
            embedded = self.embedding(tokens[:, k], ahead(position_ids, k + 1))
            hidden = depth.norm(depth(hidden, embedded, **(layer_kwargs or {})))
            outputs.append(hidden)
        return outputs
