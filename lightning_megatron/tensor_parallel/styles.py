"""Column-parallel styles for fused projections that a contiguous split would cut wrongly.

``"column"`` gives rank ``r`` the ``r``-th contiguous block of a layer's output features,
which is right when the output is a sequence of independent units that the model reads
rank-locally in the same order (GPT-2's head-major ``qkv``, an MLP's ``fc``). Two common
fused layouts are not like that; a plan names them with these objects instead of a string:

* ``PackedColumn(chunks)``: the output is ``[c0 | c1 | ...]`` and the model splits it with
  ``y.chunk(n, -1)`` or ``y.split(sizes, -1)`` (nanoGPT's ``qkv``, a gated MLP's
  ``[gate | up]``). Rank ``r`` holds the ``r``-th ``1/tp`` of every chunk, concatenated in
  order, so the same ``chunk``/``split`` on the local output gives its part of each piece.
* ``QueryGroupColumn(num_heads, num_query_groups)``: grouped-query attention fused by query
  group (``[group, (q heads, k, v), head_dim]``). When tp divides the groups, each rank gets
  whole groups (a contiguous split, exactly ``"column"``); when tp is a multiple ``R`` times
  the groups, rank ``r`` gets its share of group ``r // R``'s query heads plus that group's
  key and value heads, which are then *replicated* on the group's ``R`` ranks: their
  gradients are partial sums over those ranks (``optim.partial_grads`` sums them).

Each style turns ``(out_features, tp)`` into the per-rank ranges of a segmented
:class:`~lightning_megatron.parallel.shards.TensorShard` (or ``None``: the plain
contiguous split), raising a ``ValueError`` with the numbers and a fix when the sizes don't fit.

The two fused styles also say what the fused layer is made of, for whatever computes its projections
separately (a LoRA adapter per projection, ``peft.lora``): the projections' global sizes (``part_sizes``),
each projection's own column style (``part_styles``: the rows of it that the fused split gives each rank,
so a separate per-projection layer split by it lands on the rank that holds those rows of the fused one),
their local sizes at a layout (``local_part_sizes``) and ``join``, which lays per-projection local outputs
out as the fused layer's local output. A third style serves the key and value projections:

* ``KeyValueHeads(num_query_groups)``: ``num_query_groups`` heads split by whole heads when tp divides
  them, else each head on ``tp / groups`` consecutive ranks (exactly the k or v rows ``QueryGroupColumn``
  gives each rank, replicated alike; ``optim.partial_grads`` sums their partial gradients the same way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from lightning_megatron.parallel.shards import RankRanges


@dataclass(frozen=True)
class PackedColumn:
    """``chunks``: how many equal chunks the output features are (an int), or their sizes (a tuple)."""

    chunks: Union[int, tuple[int, ...]]

    def __post_init__(self) -> None:
        if not isinstance(self.chunks, int):
            object.__setattr__(self, "chunks", tuple(int(c) for c in self.chunks))
        if (self.chunks if isinstance(self.chunks, int) else min(self.chunks, default=0)) < 1:
            raise ValueError(f"PackedColumn needs a positive number of chunks or positive chunk sizes, "
                             f"got {self.chunks!r}.")

    def chunk_sizes(self, out_features: int, *, name: str = "the layer") -> tuple[int, ...]:
        if isinstance(self.chunks, int):
            if out_features % self.chunks:
                raise ValueError(f"{name}: PackedColumn({self.chunks}) cannot cut {out_features} output features into "
                                 f"{self.chunks} equal chunks; give the chunk sizes as a tuple.")
            return (out_features // self.chunks,) * self.chunks
        if sum(self.chunks) != out_features:
            raise ValueError(f"{name}: PackedColumn chunk sizes {self.chunks} add up to {sum(self.chunks)}, but the "
                             f"layer has {out_features} output features.")
        return self.chunks

    def rank_ranges(self, out_features: int, world: int, *, name: str = "the layer") -> Optional[RankRanges]:
        sizes = self.chunk_sizes(out_features, name=name)
        if any(size % world for size in sizes):
            raise ValueError(
                f"{name}: PackedColumn chunks of sizes {sizes} do not split over tensor_parallel_size={world}: each "
                f"rank holds 1/{world} of every chunk. Use a tensor_parallel_size that divides {math.gcd(*sizes)}, "
                f"or chunk sizes that are multiples of {world}.")
        if world == 1 or len(sizes) == 1:
            return None  # one contiguous block per rank: the plain split
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return tuple(tuple((start + rank * (size // world), size // world) for start, size in zip(starts, sizes))
                     for rank in range(world))

    def part_sizes(self, out_features: int) -> tuple[int, ...]:
        """The chunks' global sizes (each chunk is one projection: ``[gate | up]``)."""
        return self.chunk_sizes(out_features)

    def part_styles(self) -> tuple[object, ...]:
        """Each rank holds the ``r``-th ``1/tp`` of every chunk: a plain column split of each."""
        return ("column",) * (self.chunks if isinstance(self.chunks, int) else len(self.chunks))

    def local_part_sizes(self, local_features: int, out_features: int) -> tuple[int, ...]:
        return tuple(size * local_features // out_features for size in self.chunk_sizes(out_features))

    def join(self, parts: Sequence[Tensor], out_features: int) -> Tensor:
        """The chunks' local outputs (last dimension) as the layer's local ``[c0 | c1 | ...]``."""
        return torch.cat(list(parts), dim=-1)


@dataclass(frozen=True)
class QueryGroupColumn:
    """The fused ``qkv`` of attention with ``num_query_groups`` key/value heads shared by ``num_heads`` query
    heads (``num_query_groups == num_heads``: multi-head attention, GPT-2's head-major layout)."""

    num_heads: int
    num_query_groups: int

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_query_groups < 1 or self.num_heads % self.num_query_groups:
            raise ValueError(f"QueryGroupColumn: num_heads={self.num_heads} must be a positive multiple of "
                             f"num_query_groups={self.num_query_groups} (each key/value head serves as many query "
                             f"heads).")

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_query_groups

    def valid_sizes(self) -> list[int]:
        """Tensor-parallel sizes this layout splits: divisors of the groups, or groups x divisors of a group's heads."""
        groups, heads = self.num_query_groups, self.heads_per_group
        return sorted({d for d in range(1, groups + 1) if groups % d == 0}
                      | {groups * r for r in range(1, heads + 1) if heads % r == 0})

    def rank_ranges(self, out_features: int, world: int, *, name: str = "the layer") -> Optional[RankRanges]:
        groups, heads = self.num_query_groups, self.heads_per_group
        rows_per_dim = self.num_heads + 2 * groups
        if out_features % rows_per_dim:
            raise ValueError(f"{name}: {out_features} output features are not (num_heads + 2 * num_query_groups) = "
                             f"{rows_per_dim} heads of equal size; is this the fused qkv of {self}?")
        if groups % world == 0:
            return None  # whole groups per rank: the plain split
        replicas = world // groups
        if world % groups or heads % replicas:
            raise ValueError(
                f"{name}: tensor_parallel_size={world} neither divides num_query_groups={groups} nor is a multiple "
                f"of it that divides the {heads} query heads of a group (num_heads={self.num_heads}); every rank must "
                f"hold whole key/value heads and an equal share of the query heads. Valid tensor_parallel_size "
                f"values: {self.valid_sizes()}.")
        head_dim = out_features // rows_per_dim
        block, share = (heads + 2) * head_dim, heads // replicas * head_dim
        return tuple(((group * block + part * share, share), (group * block + heads * head_dim, 2 * head_dim))
                     for group, part in (divmod(rank, replicas) for rank in range(world)))

    def part_sizes(self, out_features: int) -> tuple[int, ...]:
        """``q``, ``k`` and ``v``'s global sizes: ``num_heads``, ``num_query_groups`` and ``num_query_groups``
        heads."""
        head_dim = out_features // (self.num_heads + 2 * self.num_query_groups)
        return self.num_heads * head_dim, self.num_query_groups * head_dim, self.num_query_groups * head_dim

    def part_styles(self) -> tuple[object, ...]:
        """``q``: a plain column split (whole groups' heads, or a group's share of them, are the rank's
        contiguous ``1/tp`` of the query heads); ``k`` and ``v``: :class:`KeyValueHeads`."""
        return "column", KeyValueHeads(self.num_query_groups), KeyValueHeads(self.num_query_groups)

    def local_part_sizes(self, local_features: int, out_features: int) -> tuple[int, ...]:
        """The local ``q``, ``k``, ``v`` widths of a rank holding ``local_features`` rows (as
        ``SelfAttention.local_layout`` reads them: whole groups, or one group's share of query heads)."""
        head_dim = out_features // (self.num_heads + 2 * self.num_query_groups)
        rows = local_features // head_dim
        groups = max(1, rows // (self.heads_per_group + 2))
        return (rows - 2 * groups) * head_dim, groups * head_dim, groups * head_dim

    def join(self, parts: Sequence[Tensor], out_features: int) -> Tensor:
        """Local ``q``, ``k``, ``v`` outputs (last dimension) as the local fused ``[group, (q heads, k, v), d]``."""
        q, k, v = parts
        head_dim = out_features // (self.num_heads + 2 * self.num_query_groups)
        groups = k.shape[-1] // head_dim
        pieces = [q.unflatten(-1, (groups, -1, head_dim)), k.unflatten(-1, (groups, 1, head_dim)),
                  v.unflatten(-1, (groups, 1, head_dim))]
        return torch.cat(pieces, dim=-2).flatten(-3)


@dataclass(frozen=True)
class KeyValueHeads:
    """The key (or value) projection of grouped-query attention alone: ``num_query_groups`` heads, split as
    :class:`QueryGroupColumn` splits them inside the fused ``qkv`` (whole heads per rank, or one head on each
    block of ``tp / num_query_groups`` consecutive ranks, its gradients then partial sums over that block)."""

    num_query_groups: int

    def rank_ranges(self, out_features: int, world: int, *, name: str = "the layer") -> Optional[RankRanges]:
        groups = self.num_query_groups
        if out_features % groups:
            raise ValueError(f"{name}: {out_features} output features are not {groups} key/value heads of equal size.")
        if groups % world == 0:
            return None  # whole heads per rank: the plain split
        if world % groups:
            raise ValueError(f"{name}: tensor_parallel_size={world} neither divides num_query_groups={groups} nor is "
                             f"a multiple of it; every rank must hold whole key/value heads.")
        head_dim, replicas = out_features // groups, world // groups
        return tuple(((rank // replicas * head_dim, head_dim),) for rank in range(world))


LAYOUT_STYLES = (PackedColumn, QueryGroupColumn, KeyValueHeads)
