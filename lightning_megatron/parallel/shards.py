"""How a tensor-parallel parameter relates to its global (layout-free) parameter.

Every sharded parameter carries a ``TensorShard`` as ``param.tensor_shard``. Initialisation
uses it to cut the local shard out of the full parameter, checkpoints use it to write the
global name with the global shape, and the gradient-norm code uses it to count each
element once across the tensor-parallel group.

Usually rank ``r`` holds the ``r``-th of ``world`` equal chunks of ``dim`` (zero-padded for the
vocabulary). A *segmented* shard instead lists, for every rank, the ranges of ``dim`` it holds,
concatenated in order: a fused projection ``[q | k | v]`` gives each rank a part of every
chunk (``tensor_parallel.styles.PackedColumn``), and grouped-query attention with more ranks than key/value
heads gives several ranks the same key/value rows (``tensor_parallel.styles.QueryGroupColumn``). A range held
by several ranks is *replicated* there; the lowest of them is its *primary*, which alone
counts it in the gradient norm. Replicated ranges are only ever equal or disjoint, so their
boxes in a checkpoint are identical on every replica (written once, read by each).

It sits in the base layer (``parallel``): initialisation, checkpoints, the optimizer and the planner read shards
without importing the parallel layers (``tensor_parallel``) that make them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

Range = tuple[int, int]  # (start, size) along ``dim`` of the global tensor
RankRanges = tuple[tuple[Range, ...], ...]  # per rank: the ranges it holds, in local order


class Segment(NamedTuple):
    """``size`` entries of ``dim`` from ``local_start`` of a local tensor are those from ``start`` of the
    global tensor; ``holders``: the ranks holding that range (``holders[0]`` is its primary)."""

    local_start: int
    start: int
    size: int
    holders: tuple[int, ...]


@dataclass(frozen=True)
class TensorShard:
    """``dim`` of the global tensor of shape ``global_shape`` is zero-padded to ``padded_size`` and cut into
    ``world`` equal chunks; this rank holds chunk ``rank``. With ``rank_ranges`` (a segmented shard, no
    padding) rank ``r`` holds instead the concatenation of the ranges ``rank_ranges[r]`` of ``dim``."""

    dim: int
    global_shape: tuple[int, ...]
    padded_size: int
    rank: int
    world: int
    rank_ranges: Optional[RankRanges] = None

    def __post_init__(self) -> None:
        if self.rank_ranges is not None:
            _check_rank_ranges(self.rank_ranges, self.world, self.global_shape[self.dim], self.global_shape)

    def ranges_of(self, rank: int) -> tuple[Range, ...]:
        """The ranges of ``dim`` (of the padded global tensor) that ``rank`` holds, in local order."""
        if self.rank_ranges is None:
            size = self.padded_size // self.world
            return ((rank * size, size),)
        return self.rank_ranges[rank]

    @property
    def local_size(self) -> int:
        return sum(size for _, size in self.ranges_of(self.rank))

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.global_shape)
        shape[self.dim] = self.local_size
        return tuple(shape)

    def segments(self, rank: Optional[int] = None) -> list[Segment]:
        """The real (unpadded) ranges of ``rank``'s local tensor (default: this rank's) and where they belong."""
        rank = self.rank if rank is None else rank
        extent = self.global_shape[self.dim]
        segments, local_start = [], 0
        for start, size in self.ranges_of(rank):
            real = max(0, min(size, extent - start))
            if real:
                holders = (rank,) if self.rank_ranges is None else tuple(
                    r for r in range(self.world) if (start, size) in self.rank_ranges[r])
                segments.append(Segment(local_start, start, real, holders))
            local_start += size
        return segments

    def local_slice(self, full: Tensor) -> Tensor:
        """This rank's part of ``full`` (of ``global_shape``), padded with zeros where needed."""
        if tuple(full.shape) != self.global_shape:
            raise ValueError(f"Expected a tensor of global shape {self.global_shape}, got {tuple(full.shape)}.")
        local = full.new_zeros(self.local_shape)
        for segment in self.segments():
            local.narrow(self.dim, segment.local_start, segment.size).copy_(
                full.narrow(self.dim, segment.start, segment.size))
        return local

    def assemble(self, parts: Sequence[Tensor]) -> Tensor:
        """The global tensor from every rank's local tensor (``parts[r]``: rank ``r``'s), padding dropped."""
        full = parts[0].new_empty(self.global_shape)
        for rank, part in enumerate(parts):
            for segment in self.segments(rank):
                if segment.holders[0] == rank:  # a replicated range: its primary's copy
                    full.narrow(self.dim, segment.start, segment.size).copy_(
                        part.narrow(self.dim, segment.local_start, segment.size))
        return full

    def real_local_size(self) -> int:
        """How many entries of the local tensor along ``dim`` are real (not padding)."""
        return sum(segment.size for segment in self.segments())

    def flat_ranges(self, segment: Segment) -> list[tuple[int, int]]:
        """The flat ``[start, stop)`` ranges of the (row-major) local tensor that ``segment`` occupies: one
        for ``dim == 0``, one per index of the leading dimensions otherwise."""
        shape = self.local_shape
        inner = math.prod(shape[self.dim + 1:])
        span = shape[self.dim] * inner
        begin, end = segment.local_start * inner, (segment.local_start + segment.size) * inner
        return [(outer * span + begin, outer * span + end) for outer in range(math.prod(shape[: self.dim]))]

    def counted_flat_ranges(self) -> Optional[list[tuple[int, int]]]:
        """The flat ranges of the local tensor this rank counts in a global norm (its segments that are not
        another rank's replica), or ``None`` when it counts all of it (every shard without replicas)."""
        if self.rank_ranges is None:
            return None
        segments = self.segments()
        if all(segment.holders[0] == self.rank for segment in segments):
            return None
        return [r for segment in segments if segment.holders[0] == self.rank for r in self.flat_ranges(segment)]


def _check_rank_ranges(rank_ranges: RankRanges, world: int, extent: int, global_shape: tuple[int, ...]) -> None:
    """Every rank holds as much; ranges of different ranks are equal (replicas) or disjoint; together they
    cover the dimension."""
    where = f"a segmented shard of a parameter of shape {global_shape} over {world} ranks ({rank_ranges})"
    if len(rank_ranges) != world:
        raise ValueError(f"{where} lists ranges for {len(rank_ranges)} ranks.")
    if any(len(set(ranges)) != len(ranges) for ranges in rank_ranges):
        raise ValueError(f"In {where} a rank holds a range twice.")
    if len({sum(size for _, size in ranges) for ranges in rank_ranges}) != 1:
        raise ValueError(f"In {where} the ranks hold different amounts; every rank must hold as much.")
    distinct = sorted({r for ranges in rank_ranges for r in ranges})
    covered = 0
    for start, size in distinct:
        if size <= 0 or start != covered:
            raise ValueError(f"In {where} the ranges overlap without being equal, leave a gap or are empty at "
                             f"{start}; replicated ranges must be identical and all of the dimension covered.")
        covered = start + size
    if covered != extent:
        raise ValueError(f"{where} covers {covered} of the {extent} entries of the dimension.")


def padded_size(size: int, world: int, multiple: int) -> int:
    """Round ``size`` up so that it splits evenly into ``world`` chunks of a multiple of ``multiple``."""
    step = world * multiple
    return math.ceil(size / step) * step


def make_shard(
    group, *, dim: int, global_shape: tuple[int, ...], pad_to_multiple_of: int | None = None,
    rank_ranges: Optional[RankRanges] = None,
) -> TensorShard:
    """The shard spec of this rank for a parameter split along ``dim`` over ``group``.

    ``pad_to_multiple_of=None`` (every layer but the vocabulary's): ``dim`` must divide over the
    group as it is. An int ``m`` (the vocabulary; Megatron's ``make_vocab_size_divisible_by``):
    ``dim`` is zero-padded to a multiple of ``world * m``, for ``m = 1`` too. ``rank_ranges``: a
    segmented shard (see :class:`TensorShard`; a style in ``tensor_parallel.styles`` computes them).
    """
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    size = global_shape[dim]
    if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1 (or None for no padding), got {pad_to_multiple_of}.")
    if rank_ranges is not None:
        if pad_to_multiple_of is not None:
            raise ValueError("A segmented shard (rank_ranges) is never padded: pass pad_to_multiple_of=None.")
        return TensorShard(dim=dim, global_shape=tuple(global_shape), padded_size=size, rank=rank, world=world,
                           rank_ranges=tuple(tuple(tuple(r) for r in ranges) for ranges in rank_ranges))
    padded = size if pad_to_multiple_of is None else padded_size(size, world, pad_to_multiple_of)
    if padded % world != 0:
        raise ValueError(
            f"Dimension {dim} of a parameter of shape {global_shape} has size {size}, which does not divide over "
            f"tensor_parallel_size={world}. Choose sizes divisible by {world} or a smaller tensor_parallel_size."
        )
    return TensorShard(dim=dim, global_shape=tuple(global_shape), padded_size=padded, rank=rank, world=world)


def shard_of(param: Tensor) -> TensorShard | None:
    return getattr(param, "tensor_shard", None)


def new_parameter(shard: TensorShard | None, shape, *, device=None, dtype=None) -> torch.nn.Parameter:
    """An uninitialised parameter of the local shape, tagged with its shard spec."""
    local_shape = shard.local_shape if shard is not None else tuple(shape)
    param = torch.nn.Parameter(torch.empty(local_shape, device=device, dtype=dtype))
    if shard is not None:
        param.tensor_shard = shard
    return param
