"""The tensor-parallel region of a Mixture-of-Experts layer's experts.

A dense MLP communicates inside its own layers: the column layer enters the region (f, or the
sequence all-gather) and the row layer leaves it (g, or the reduce-scatter). An MoE layer has many
experts, each split over tp like a dense MLP, and a token visits ``top_k`` of them; entering and
leaving once per expert would repeat the collectives ``num_experts`` times. So the experts' layers
are split without communicating (:class:`InsideRegion`), and the MoE layer enters the region once
for all of them (the tokens and their combine weights) and leaves it once (the weighted sum):

======================  =============================  =============================
                         enter                          leave
======================  =============================  =============================
tensor parallelism       f: identity / all-reduce       g: all-reduce / identity
sequence parallelism     all-gather / reduce-scatter    reduce-scatter / all-gather
======================  =============================  =============================

A row-parallel layer inside the region leaves its bias out (``RowParallelLinear`` with ``communicates=False``):
added per rank it would be summed ``tp`` times. The MoE layer adds the experts' down-projection biases once, after
leaving (as Megatron-Core's ``RowParallelLinear`` adds its bias after the reduction), to this rank's part of the
output (:meth:`TensorParallelRegion.own_part`).

The router runs before the region on the tokens this rank holds, so its gradient is whole on
every rank (tp) or this sequence chunk's share (sequence parallelism, summed over tp like a
norm's); the combine weights enter with the tokens so that their gradient, computed from the
experts' partial outputs, is summed too. The expert ids (no gradient) are gathered along with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch.distributed as dist
from torch import Tensor

from lightning_megatron.tensor_parallel import mappings
from lightning_megatron.tensor_parallel.styles import PackedColumn


@dataclass(frozen=True)
class InsideRegion:
    """Split a layer as ``style`` (``"column"``, ``"row"`` or ``PackedColumn``) with no communication of its
    own: an enclosing module (``TensorParallelRegion``) enters and leaves the region for it. ``experts``: the layer
    is an MoE layer's expert, left whole when ``expert_tensor_parallel_size`` is below tp (the region's other
    users, e.g. latent attention's up projections, are split by tp whatever the experts do)."""

    style: Union[str, PackedColumn]
    experts: bool = False

    def __post_init__(self) -> None:
        if self.style not in ("column", "row") and not isinstance(self.style, PackedColumn):
            raise ValueError(f"InsideRegion takes 'column', 'row' or PackedColumn(...), got {self.style!r}.")


class TensorParallelRegion:
    """``enter``/``enter_ids``/``leave`` for an MoE layer over the tensor-parallel ``group``."""

    def __init__(self, group: Optional[dist.ProcessGroup], sequence_parallel: bool) -> None:
        self.group, self.sequence_parallel = group, sequence_parallel

    def enter(self, x: Tensor) -> Tensor:
        if self.sequence_parallel:
            return mappings.gather_from_sequence(x, self.group)
        return mappings.copy_to_tensor_parallel(x, self.group)

    def enter_ids(self, ids: Tensor) -> Tensor:
        """Integer routing (no gradient): gathered along the sequence under sequence parallelism."""
        if not self.sequence_parallel or mappings.sequences_are_whole() or self.group is None:
            return ids
        return mappings.all_gather_along(ids, self.group, dim=1)

    def leave(self, x: Tensor) -> Tensor:
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence(x, self.group)
        return mappings.reduce_from_tensor_parallel(x, self.group)

    def own_part(self, x: Tensor) -> Tensor:
        """This rank's part, as :meth:`leave` cuts its output, of ``x`` ``[B, S, ...]``: the same on every rank of the
        region and no partial sum (the experts' deferred biases). Its sequence chunk under sequence parallelism, a
        plain slice whose gradient is this chunk's share (summed over tp like a norm's), else all of it."""
        if not self.sequence_parallel or mappings.sequences_are_whole() or self.group is None:
            return x
        return x.chunk(dist.get_world_size(self.group), dim=1)[dist.get_rank(self.group)]
