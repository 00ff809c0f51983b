"""Where a rank's tensor sits inside its global tensor, in the terms torch.distributed.checkpoint writes.

Every tensor a rank holds is a *flat range* of its tensor-parallel shard: the whole shard
for model parameters, a contiguous range of it for ZeRO-1/2 fp32 pieces and their optimizer
state (``OwnedPiece``), a block of rows for ZeRO-3. A flat range of a row-major tensor is
a union of at most ``2 * ndim - 1`` boxes (a partial first row, whole rows, a partial last
row, recursively), and a box of the shard is a box of the global tensor once shifted by the
shard's offset and clipped to the unpadded size; a segmented shard (several ranges of the
global tensor, see ``TensorShard``) first cuts each box at its segments' boundaries. DCP
stores and reshards boxes ("chunks"), so writing the boxes under the tensor's global name
makes every checkpoint layout-free: a reader at another layout asks for its own boxes and
DCP reads the overlaps. A range replicated on several tp ranks gives the same boxes on each
(same local position, same flat range), which DCP's save planner writes once, as it does
for every replicated tensor; on load every replica reads them.

``ShardedEntry`` implements the hooks DCP's planners call on checkpointable objects
(``__create_write_items__``, ``__create_chunk_list__``, ``size``); the planners in
``checkpoint.sharded`` look its boxes up by offset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from lightning_megatron.parallel.shards import TensorShard


class Box(NamedTuple):
    """``sizes`` entries from ``offsets`` of a tensor; ``flat_start``: where the box begins in the flat range."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The boxes of a row-major tensor of ``shape`` that together are its flat elements ``[start, stop)``.

    >>> flat_range_boxes((3, 4), 2, 11)
    [Box(offsets=(0, 2), sizes=(1, 2), flat_start=2), Box(offsets=(1, 0), sizes=(1, 4), flat_start=4), \
Box(offsets=(2, 0), sizes=(1, 3), flat_start=8)]
    """
    if start >= stop:
        return []
    if not shape:
        return [Box((), (), start)]
    row = math.prod(shape[1:])
    boxes: list[Box] = []

    def within_row(index: int, begin: int, end: int) -> None:
        for box in flat_range_boxes(shape[1:], begin - index * row, end - index * row):
            boxes.append(Box((index, *box.offsets), (1, *box.sizes), box.flat_start + index * row))

    if start % row:  # a partial first row
        end = min(stop, (start // row + 1) * row)
        within_row(start // row, start, end)
        start = end
    whole = (stop - start) // row
    if whole:
        boxes.append(Box((start // row,) + (0,) * (len(shape) - 1), (whole, *shape[1:]), start))
        start += whole * row
    if start < stop:  # a partial last row
        within_row(start // row, start, stop)
    return boxes


@dataclass(frozen=True)
class Placement:
    """A local tensor holds the flat elements ``[start, stop)`` of this rank's tensor-parallel shard
    (``shard``; ``None``: the tensor is not split over tp) of a tensor of ``global_shape``."""

    global_shape: tuple[int, ...]
    shard: Optional[TensorShard] = None
    start: int = 0
    stop: Optional[int] = None

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return self.shard.local_shape if self.shard is not None else self.global_shape

    @property
    def numel(self) -> int:
        return (math.prod(self.shard_shape) if self.stop is None else self.stop) - self.start

    def views(self, local: Tensor) -> dict[tuple[int, ...], Tensor]:
        """``local``'s boxes by their global offsets, as views of ``local``; padding rows are left out."""
        if local.numel() != self.numel or not local.is_contiguous():
            raise ValueError(f"A local tensor of {local.numel()} elements (contiguous: {local.is_contiguous()}) "
                             f"cannot hold the {self.numel} elements of {self}.")
        flat = local.detach().reshape(-1)
        segments = self.shard.segments() if self.shard is not None else []  # real ranges only: padding is left out
        views = {}
        for box in flat_range_boxes(self.shard_shape, self.start, self.start + self.numel):
            view = flat.narrow(0, box.flat_start - self.start, math.prod(box.sizes)).view(box.sizes)
            if self.shard is None:
                views[box.offsets] = view
                continue
            dim = self.shard.dim
            lo, hi = box.offsets[dim], box.offsets[dim] + box.sizes[dim]
            for segment in segments:
                first, last = max(lo, segment.local_start), min(hi, segment.local_start + segment.size)
                if first < last:
                    offsets = list(box.offsets)
                    offsets[dim] = segment.start + first - segment.local_start
                    views[tuple(offsets)] = view.narrow(dim, first - lo, last - first)
        return views


class ShardedEntry:
    """One global tensor as far as this rank holds it: one view of the local tensor per box, so DCP
    writes from and reads into the local tensor in place."""

    def __init__(self, local: Tensor, placement: Placement) -> None:
        self.global_shape = torch.Size(placement.global_shape)
        self.properties = TensorProperties.create_from_tensor(local)
        self.pieces = placement.views(local)

    def size(self) -> torch.Size:
        return self.global_shape

    def to_cpu(self) -> "ShardedEntry":
        """A copy of the boxes in CPU memory, for writing while the originals change."""
        copy = object.__new__(ShardedEntry)
        copy.global_shape, copy.properties = self.global_shape, self.properties
        copy.pieces = {offsets: piece.to("cpu", copy=True) for offsets, piece in self.pieces.items()}
        return copy

    def piece_at(self, offsets) -> Tensor:
        return self.pieces[tuple(offsets)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=piece.shape)
                for offsets, piece in self.pieces.items()]

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(chunk.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=self.properties, size=self.global_shape),
            )
            for chunk in self.__create_chunk_list__()
        ]
