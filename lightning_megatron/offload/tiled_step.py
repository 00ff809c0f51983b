"""The optimizer step of the ``"nvme"`` tier: the state walked in tiles through a small pool of host buffers.

The fp32 main parameters and every optimizer state tensor are flat streams in files (``offload.files``), laid
out piece after piece. A *tile* is a range of ``tile_numel`` elements of that layout; it may cover the ends of
several pieces and a piece may span several tiles, which is exact because the optimizers that can be rebound
to pieces are element-wise (``optim.main_params.ELEMENTWISE_OPTIMIZERS``). The pool holds three tiles of
buffers (one per stream), used in turn, so that while tile ``t`` is updated, tile ``t + 1`` is being read and
tile ``t - 1`` written (DeepSpeed's pipelined optimizer swapper does the same):

    read t+1  |===========|
    step t    |====|  copy updated values to the model's parameters
    write t-1 |========|

The update itself is the user's optimizer, unchanged: for each tile its ``param_groups`` briefly hold
parameters that are views of the tile's main buffer, with their gradients (views of the fp32 gradients) and
their state (views of the tile's state buffers, the step counters as they were before this step), and its own
``step`` runs (fused or foreach kernels included). What it computed is then written back to the files, and the
updated values into the model's parameters. Host memory is the pool, whatever the size of the model.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_megatron.offload.files import OffloadFiles

MAIN = "main"
SLOTS = 3  # read ahead, step, write behind


def tile_numel(buffer_mb: float) -> int:
    """fp32 elements in a tile whose buffers hold ``buffer_mb`` MiB each (``offload_buffer_mb``)."""
    return max(1, int(buffer_mb * 2**20) // 4)


def pool_bytes(buffer_mb: float, element_sizes: list[int], total: Optional[int] = None) -> int:
    """Host bytes of the pool: :data:`SLOTS` tiles of one buffer per stream (``element_sizes``: bytes of an element of
    each; a tile holds at most ``total`` elements, the whole layout, where that is smaller)."""
    elements = tile_numel(buffer_mb) if total is None else min(tile_numel(buffer_mb), total)
    return SLOTS * elements * sum(element_sizes)


def state_stream(key: str) -> str:
    """The stream (file) of an optimizer state tensor, e.g. ``state.exp_avg``."""
    return f"state.{key}"


@dataclass(frozen=True)
class TiledPiece:
    """A main piece in the streams: the parameter the optimizer knows (a view of the ``main`` file), its param
    group, and where it starts in the flat layout."""

    main: nn.Parameter
    group: int
    start: int

    @property
    def numel(self) -> int:
        return self.main.numel()


@dataclass(frozen=True)
class Tile:
    start: int
    stop: int
    parts: tuple[tuple[int, int, int], ...]  # (piece index, first, last element of the piece in this tile)


def cut_into_tiles(pieces: list[TiledPiece], tile_numel: int) -> list[Tile]:
    """Consecutive ranges of at most ``tile_numel`` elements covering every piece's elements once."""
    total = sum(piece.numel for piece in pieces)
    tiles = []
    for start in range(0, total, tile_numel):
        stop = min(start + tile_numel, total)
        parts = tuple((i, max(start, p.start) - p.start, min(stop, p.start + p.numel) - p.start)
                      for i, p in enumerate(pieces) if p.start < stop and p.start + p.numel > start)
        tiles.append(Tile(start, stop, parts))
    return tiles


class TiledStep:
    """Steps ``optimizer`` over ``pieces`` tile by tile; ``write_back(piece index, lo, hi, values)`` puts the
    updated values of a piece's elements ``[lo, hi)`` into the model. ``state_keys``: the optimizer's per-element
    state tensors and their dtypes (each a stream of ``files``)."""

    def __init__(self, optimizer: Optimizer, pieces: list[TiledPiece], files: OffloadFiles,
                 state_keys: dict[str, torch.dtype], *, tile_numel: int,
                 write_back: Callable[[int, int, int, Tensor], None], pin_memory: bool = False) -> None:
        self.optimizer, self.pieces, self.files = optimizer, pieces, files
        self.state_keys, self.write_back = state_keys, write_back
        self.tiles = cut_into_tiles(pieces, tile_numel)
        size = min(tile_numel, max((tile.stop - tile.start for tile in self.tiles), default=0))
        streams = {MAIN: torch.float32, **{state_stream(k): dtype for k, dtype in state_keys.items()}}
        self.pool = [{name: torch.empty(size, dtype=dtype, pin_memory=pin_memory) for name, dtype in streams.items()}
                     for _ in range(SLOTS)]
        self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="offload-io")

    @property
    def pool_bytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for slot in self.pool for buffer in slot.values())

    def step(self, inner_step: Callable[[], object]) -> None:
        """One optimizer step over every tile holding a piece with a gradient; ``inner_step`` is the optimizer's
        own ``step``, run once per tile on that tile's views."""
        tiles = [t for t in self.tiles if any(self.pieces[i].main.grad is not None for i, _, _ in t.parts)]
        if not tiles:
            return  # a skipped step: nothing to read, change or write
        state = self.optimizer.state
        before = {i: dict(state[p.main]) for i, p in enumerate(self.pieces) if p.main in state}
        groups = self.optimizer.param_groups
        held = [group["params"] for group in groups]
        reads: dict[int, Future] = {0: self._io.submit(self._read, tiles[0], self.pool[0])}
        writes: dict[int, Future] = {}
        try:
            for t, tile in enumerate(tiles):
                slot = self.pool[t % SLOTS]
                reads.pop(t).result()
                if t + 1 < len(tiles):
                    if t - 2 in writes:  # tile t + 1's slot was tile t - 2's: its write must be done
                        writes.pop(t - 2).result()
                    reads[t + 1] = self._io.submit(self._read, tiles[t + 1], self.pool[(t + 1) % SLOTS])
                self._step_tile(tile, slot, before, inner_step)
                writes[t] = self._io.submit(self._write, tile, slot)
        finally:
            for group, params in zip(groups, held):
                group["params"] = params
            for future in [*reads.values(), *writes.values()]:
                future.result()

    def _step_tile(self, tile: Tile, slot: dict[str, Tensor], before: dict[int, dict],
                   inner_step: Callable[[], object]) -> None:
        groups = self.optimizer.param_groups
        made = []
        for group in groups:
            group["params"] = []
        for i, lo, hi in tile.parts:
            piece = self.pieces[i]
            if piece.main.grad is None:
                continue
            offset, n = piece.start + lo - tile.start, hi - lo
            view = nn.Parameter(slot[MAIN].narrow(0, offset, n))
            view.grad = piece.main.grad.narrow(0, lo, n)
            if i in before:  # state as before this step: a piece spanning tiles is stepped once per tile
                self.optimizer.state[view] = {
                    key: slot[state_stream(key)].narrow(0, offset, n) if value.dim() else value.clone()
                    for key, value in before[i].items()}
            groups[piece.group]["params"].append(view)
            made.append((i, lo, hi, view, offset, n))
        inner_step()
        for i, lo, hi, view, offset, n in made:
            piece = self.pieces[i]
            new, kept = self.optimizer.state.pop(view), self.optimizer.state[piece.main]
            for key, value in new.items():
                if value.dim() == 0:
                    kept[key] = value
                    continue
                buffer = slot[state_stream(key)].narrow(0, offset, n)
                if value.data_ptr() != buffer.data_ptr():  # made by the optimizer at its first step
                    buffer.copy_(value)
                if key not in kept:
                    kept[key] = self.files.piece(state_stream(key), piece.start, piece.numel)
            self.write_back(i, lo, hi, view.detach())

    def _read(self, tile: Tile, slot: dict[str, Tensor]) -> None:
        for name, buffer in slot.items():
            self.files.read(name, tile.start, buffer[: tile.stop - tile.start])

    def _write(self, tile: Tile, slot: dict[str, Tensor]) -> None:
        for name, buffer in slot.items():
            self.files.write(name, tile.start, buffer[: tile.stop - tile.start])

    def close(self) -> None:
        self._io.shutdown(wait=True)
