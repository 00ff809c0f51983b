"""Gradients that each rank of some group holds only a partial sum of, and the groups that sum them.

Three cases, each summed once per step by one flattened all-reduce per group (the
gradient paths of ``grad_sync`` and ``zero3`` run it after the data-parallel reduction):

* parameters replicated over tp but applied to sequence chunks (sequence parallelism's
  norms and row-parallel biases): the tp group;
* an embedding tied across the first and last pipeline stage: the embedding group;
* ranges of a segmented tensor-parallel shard held by several tp ranks (the key/value rows
  of ``QueryGroupColumn`` with more ranks than groups): each rank's contribution comes from
  its own query heads, so they are summed over exactly the ranks holding them, a block of
  consecutive tp ranks (``ParallelState.tensor_parallel_subgroup``).

A part is a flat range of a parameter's (tp-local) gradient. Ranks of one group list the
same parts in the same order with the same sizes (identical local shapes; replicated ranges
sorted by their global position), so the flattened buffers line up element for element.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron.parallel.shards import shard_of
from lightning_megatron.parallel.state import ParallelState


class PartialGrads(NamedTuple):
    """The flat ranges ``[start, stop)`` of these parameters' gradients are partial sums over ``group``."""

    group: dist.ProcessGroup
    parts: tuple[tuple[nn.Parameter, int, int], ...]

    def ranges_by_param(self) -> dict[int, list[tuple[int, int]]]:
        """``id(param)`` -> its ranges, in order."""
        ranges: dict[int, list[tuple[int, int]]] = {}
        for param, start, stop in self.parts:
            ranges.setdefault(id(param), []).append((start, stop))
        return ranges


def _replicated_parts(param: nn.Parameter) -> dict[int, list[tuple[int, int]]]:
    """Replica count -> the flat ranges of ``param``'s local shard replicated on that many tp ranks."""
    shard = shard_of(param)
    if shard is None or shard.rank_ranges is None:
        return {}
    by_size: dict[int, list[tuple[int, int]]] = {}
    for segment in sorted(shard.segments(), key=lambda segment: segment.start):
        size, first = len(segment.holders), segment.holders[0]
        if size == 1:
            continue
        if segment.holders != tuple(range(first, first + size)) or first % size:
            raise ValueError(f"A range of a parameter of shape {shard.global_shape} is replicated on tp ranks "
                             f"{segment.holders}; replicas must be an aligned block of consecutive tp ranks "
                             f"(k * n to (k + 1) * n - 1) to share a tensor-parallel subgroup.")
        by_size.setdefault(size, []).extend(shard.flat_ranges(segment))
    return by_size


def _agreed_sizes(sizes: set[int], state: ParallelState) -> list[int]:
    """The replica counts any rank has: every rank must create the same subgroups. Pipeline stages hold
    different modules, so under pp they are agreed on in one small all-reduce (at set-up only)."""
    if state.config.pipeline_parallel_size == 1:
        return sorted(sizes)  # every rank holds the same modules, split alike
    flags = torch.zeros(state.config.tensor_parallel_size + 1, device=state.device)
    flags[sorted(sizes)] = 1.0
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [size for size in range(len(flags)) if flags[size] > 0]


def partial_grad_groups(params: Iterable[nn.Parameter], state: ParallelState) -> list[PartialGrads]:
    """The partial gradients among ``params`` (trainable ones) and the groups summing them (see the module
    docstring); groups of one rank are left out. Collective on first use of a tp subgroup size (every
    rank must call it, at set-up)."""
    params = [p for p in dict.fromkeys(params) if p.requires_grad]
    whole = lambda tag: tuple((p, 0, p.numel()) for p in params if getattr(p, tag, False))  # noqa: E731
    groups = [PartialGrads(state.tensor_parallel_group, whole("sequence_parallel_grad")),
              PartialGrads(state.embedding_group, whole("pipeline_tied"))]
    replicated: dict[int, list[tuple[nn.Parameter, int, int]]] = {}
    if state.mesh is not None and state.config.tensor_parallel_size > 1:
        for param in params:
            for size, ranges in _replicated_parts(param).items():
                replicated.setdefault(size, []).extend((param, start, stop) for start, stop in ranges)
        for size in _agreed_sizes(set(replicated), state):
            groups.append(PartialGrads(state.tensor_parallel_subgroup(size), tuple(replicated.get(size, ()))))
    return [group for group in groups if group.parts and group.group is not None]
