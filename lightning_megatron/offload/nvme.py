"""The ``"nvme"`` optimizer tier: fp32 main parameters and optimizer state in files, stepped in tiles.

``MainParamOptimizer`` hands this tier the initial values of its fp32 pieces; the tier lays them out in its
files (``offload.files``) and gives back parameters that are memory-mapped views of them, so the optimizer's
param groups, its state dict and the checkpoint code see ordinary tensors. Its :meth:`NvmeOptimizerTier.step`
replaces the optimizer's ``step``: the tiles go through the host buffer pool (``offload.tiled_step``).

Which state tensors the optimizer keeps (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ...) is found by
stepping it once on a one-element parameter per param group, before any file is made, so that the disk the
state needs is known, checked and allocated before training starts.

Gradients: the optimizer reads fp32 host gradients. Where the reduced gradient already is one (fp32 on the
CPU) it is used in place; otherwise (16-bit or accelerator gradients) it is copied into a ``grad`` stream of
its own, memory-mapped too, so that no model-sized gradient lives in private host memory either.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_megatron.offload.files import OffloadFiles, clear_stale_folders, element_size, format_bytes
from lightning_megatron.offload.tiled_step import MAIN, TiledPiece, TiledStep, pool_bytes, state_stream, tile_numel

GRAD = "grad"


def probe_state_keys(optimizer: Optimizer, inner_step: Callable[[], object]) -> dict[str, torch.dtype]:
    """The per-element state tensors ``optimizer`` makes (name -> dtype): its own step on a one-element
    parameter with a zero gradient, once per param group (hyper-parameters such as ``amsgrad`` may differ)."""
    groups = optimizer.param_groups
    held = [group["params"] for group in groups]
    keys: dict[str, torch.dtype] = {}
    try:
        for group in groups:
            group["params"] = []
        for group in groups:
            probe = nn.Parameter(torch.zeros(1))
            probe.grad = torch.zeros(1)
            group["params"] = [probe]
            inner_step()
            keys.update({key: value.dtype for key, value in optimizer.state.pop(probe, {}).items()
                         if isinstance(value, Tensor) and value.dim() > 0})
            group["params"] = []
    finally:
        for group, params in zip(groups, held):
            group["params"] = params
    return keys


class NvmeOptimizerTier:
    """The files, the pool and the tiled step of one ``MainParamOptimizer``.

    ``pieces``: (initial fp32 values, param group) of each main piece, in order; ``grads_in_place``: whether
    the reduced gradients are fp32 host tensors the optimizer can read as they are; ``ranks_sharing_host``:
    ranks of this job on this machine (they share its disk and memory: each needs its own share); ``pin_memory``:
    page-locked pool buffers (the model is on an accelerator).
    """

    def __init__(self, optimizer: Optimizer, pieces: list[tuple[Tensor, int]], *, path: str, buffer_mb: float,
                 grads_in_place: bool, write_back: Callable[[int, int, int, Tensor], None], rank: int = 0,
                 ranks_sharing_host: int = 1, pin_memory: bool = False) -> None:
        self.optimizer = optimizer
        self.inner_step = optimizer.step
        self.state_keys = probe_state_keys(optimizer, self.inner_step)
        total = sum(values.numel() for values, _ in pieces)
        tile = tile_numel(buffer_mb)
        streams = {MAIN: (total, torch.float32),
                   **{state_stream(key): (total, dtype) for key, dtype in self.state_keys.items()}}
        if not grads_in_place:
            streams[GRAD] = (total, torch.float32)
        pool = pool_bytes(buffer_mb, [element_size(dtype) for name, (_, dtype) in streams.items() if name != GRAD],
                          total)
        for line in clear_stale_folders(path):  # before the disk check: the space they free counts
            print(f"lightning-megatron: rank {rank}: {line}", file=sys.stderr, flush=True)
        check_resources(path, disk_bytes=sum(n * element_size(d) for n, d in streams.values()), pool_bytes=pool,
                        ranks_sharing_host=ranks_sharing_host, rank=rank)
        try:
            self.files = OffloadFiles(path, streams, prefix=f"lightning-megatron-rank{rank}-")
        except OSError as error:
            raise RuntimeError(f"Rank {rank} could not allocate the 'nvme' offload tier's files under offload_path="
                               f"{path!r}: {error}. Free disk space there or choose another offload_path.") from error
        self.mains: list[TiledPiece] = []
        self._grads: dict[int, Tensor] = {}  # the file-backed fp32 gradients, mapped once
        start = 0
        with torch.no_grad():
            for values, group in pieces:
                main = nn.Parameter(self.files.piece(MAIN, start, values.numel()))
                main.copy_(values.reshape(-1))
                self.mains.append(TiledPiece(main, group, start))
                start += values.numel()
        self.engine = TiledStep(optimizer, self.mains, self.files, self.state_keys, tile_numel=tile,
                                write_back=write_back, pin_memory=pin_memory)
        optimizer.step = self._instance_step()  # Lightning, GradScaler and LR schedulers call this one

    def _instance_step(self) -> Callable:
        """The step that replaces the optimizer instance's. An LR scheduler made before this tier wrapped the
        instance's step to note that it ran, and warns at its first step when that wrapper is no longer the step it
        finds; it still runs on every step here (it is ``inner_step``, called for each tile), so the replacement
        carries its mark."""
        def step(closure: Optional[Callable[[], object]] = None):
            return self.step(closure)

        if getattr(self.inner_step, "_wrapped_by_lr_sched", False):
            step._wrapped_by_lr_sched = True  # torch.optim.lr_scheduler's mark of its wrapper
        return step

    def step(self, closure: Optional[Callable[[], object]] = None):
        """``torch.optim.Optimizer.step``'s contract: run ``closure`` (with grad), then step every tile."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self.engine.step(self.inner_step)
        return loss

    def grad_home(self, index: int) -> Optional[Tensor]:
        """Where piece ``index``'s fp32 gradient is kept when it cannot be read in place (else None)."""
        if GRAD not in self.files.streams:
            return None
        piece = self.mains[index]
        return self._grads.setdefault(index, self.files.piece(GRAD, piece.start, piece.numel))

    def state_home(self, index: int, key: str) -> Optional[Tensor]:
        """The file-backed tensor of piece ``index``'s state ``key`` (for loading a checkpoint in place)."""
        if key not in self.state_keys:
            return None
        piece = self.mains[index]
        return self.files.piece(state_stream(key), piece.start, piece.numel)

    def describe(self) -> str:
        """One line for the log: where the files are, how big they and the pool are, how many tiles a step walks."""
        return (f"'nvme' offload tier: {format_bytes(self.disk_bytes)} in {self.files.folder}, host buffer pool "
                f"{format_bytes(self.pool_bytes)}, {len(self.engine.tiles)} tile(s) per step")

    @property
    def disk_bytes(self) -> int:
        return self.files.nbytes

    @property
    def pool_bytes(self) -> int:
        return self.engine.pool_bytes

    def close(self) -> None:
        """Stop the I/O threads, give the optimizer its own step back and delete this tier's folder. The
        mapped views stay readable (a checkpoint after ``fit``) until they are dropped."""
        self.engine.close()
        self.optimizer.step = self.inner_step
        self.files.close()


def check_resources(path: str, *, disk_bytes: int, pool_bytes: int, ranks_sharing_host: int, rank: int) -> None:
    """Raise a ``ValueError`` naming the numbers and the fix when ``path`` cannot hold the state of the ranks
    sharing this machine, or its memory cannot hold their buffer pools (before any file is made)."""
    folder = Path(path)
    fix = "Choose a folder on a local disk this process can write."
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"Rank {rank}: offload_path={path!r} is a file, not a folder. {fix}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"Rank {rank}: offload_path={path!r} cannot be created ({error}). {fix}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"Rank {rank}: offload_path={path!r} is not writable by this process. {fix}")
    free = shutil.disk_usage(folder).free
    needed = disk_bytes * ranks_sharing_host
    if needed > free:
        raise ValueError(f"Rank {rank}: the 'nvme' offload tier needs {format_bytes(disk_bytes)} per rank x "
                         f"{ranks_sharing_host} rank(s) on this machine = {format_bytes(needed)} under offload_path="
                         f"{path!r}, which has {format_bytes(free)} free. Free disk space, choose another "
                         f"offload_path, or shard the state over more data-parallel ranks (zero_stage=1).")
    available = available_memory()
    pools = pool_bytes * ranks_sharing_host
    if available is not None and pools > available:
        raise ValueError(f"Rank {rank}: the 'nvme' offload tier's buffer pool needs {format_bytes(pool_bytes)} per "
                         f"rank x {ranks_sharing_host} rank(s) = {format_bytes(pools)} of host memory; "
                         f"{format_bytes(available)} is available. Lower offload_buffer_mb.")


def available_memory() -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
