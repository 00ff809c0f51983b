"""How a tensor-parallel parameter relates to its global (layout-free) parameter.

Every sharded parameter carries a ``TensorShard`` as ``param.tensor_shard``. Initialisation
uses it to cut the local shard out of the full parameter, checkpoints use it to write the
global name with the global shape, and the gradient-norm code uses it to count each
element once across the tensor-parallel group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class TensorShard:
    """``dim`` of the global tensor of shape ``global_shape`` is zero-padded to ``padded_size`` and cut into
    ``world`` equal chunks; this rank holds chunk ``rank``."""

    dim: int
    global_shape: tuple[int, ...]
    padded_size: int
    rank: int
    world: int

    @property
    def local_size(self) -> int:
        return self.padded_size // self.world

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.global_shape)
        shape[self.dim] = self.local_size
        return tuple(shape)

    def local_slice(self, full: Tensor) -> Tensor:
        """This rank's chunk of ``full`` (of ``global_shape``), padded with zeros where needed."""
        if tuple(full.shape) != self.global_shape:
            raise ValueError(f"Expected a tensor of global shape {self.global_shape}, got {tuple(full.shape)}.")
        start = self.rank * self.local_size
        stop = min(start + self.local_size, self.global_shape[self.dim])
        local = full.new_zeros(self.local_shape)
        if stop > start:
            local.narrow(self.dim, 0, stop - start).copy_(full.narrow(self.dim, start, stop - start))
        return local

    def real_local_size(self) -> int:
        """How many entries of the local chunk along ``dim`` are real (not padding)."""
        start = self.rank * self.local_size
        return max(0, min(self.local_size, self.global_shape[self.dim] - start))


def padded_size(size: int, world: int, multiple: int) -> int:
    """Round ``size`` up so that it splits evenly into ``world`` chunks of a multiple of ``multiple``."""
    step = world * multiple
    return math.ceil(size / step) * step


def make_shard(
    group, *, dim: int, global_shape: tuple[int, ...], pad_to_multiple_of: int | None = None
) -> TensorShard:
    """The shard spec of this rank for a parameter split along ``dim`` over ``group``.

    ``pad_to_multiple_of=None`` (every layer but the vocabulary's): ``dim`` must divide over the
    group as it is. An int ``m`` (the vocabulary; Megatron's ``make_vocab_size_divisible_by``):
    ``dim`` is zero-padded to a multiple of ``world * m``, for ``m = 1`` too.
    """
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    size = global_shape[dim]
    if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1 (or None for no padding), got {pad_to_multiple_of}.")
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
