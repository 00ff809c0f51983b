"""Random streams for dropout under tensor parallelism.

Replicated activations (the residual stream without sequence parallelism) must see the
same dropout mask on every tensor-parallel rank, so they draw from the default
generator, seeded identically across the group. Sharded activations (an attention
head that lives on one rank, or a sequence chunk under sequence parallelism) must see
independent masks, so they draw from a second stream offset by the tensor-parallel
rank. This is Megatron-LM's ``CudaRNGStatesTracker`` idea, for any device.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

TENSOR_PARALLEL_SEED_OFFSET = 2718


class TensorParallelRNG:
    """Holds the per-tensor-parallel-rank dropout stream and swaps it in on demand."""

    def __init__(self, seed: int, tensor_parallel_rank: int, device: torch.device) -> None:
        self.device = torch.device(device)
        self._active = False
        with torch.random.fork_rng(devices=self._fork_devices()):
            torch.manual_seed(seed + TENSOR_PARALLEL_SEED_OFFSET + tensor_parallel_rank)
            self._state = self._get_state()

    def _fork_devices(self) -> list:
        return [self.device] if self.device.type == "cuda" else []

    def _get_state(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set_state(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def get_state(self) -> tuple[bool, torch.Tensor]:
        """``(inside fork(), saved stream)``: all that decides the masks drawn next.

        Inside ``fork()`` the stream lives in the default generator (which torch saves and
        restores itself for recomputation) and the saved copy is stale. ``fork()`` replaces the
        saved tensor rather than changing it in place, so the returned state is a snapshot.
        """
        return self._active, self._state

    def set_state(self, state: tuple[bool, torch.Tensor]) -> None:
        """Put back a state from :meth:`get_state` (activation recomputation replays the stream)."""
        self._active, self._state = state

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Run the body on the sharded stream; re-entrant, so nested sharded regions share one stream."""
        if self._active:
            yield
            return
        default_state = self._get_state()
        self._set_state(self._state)
        self._active = True
        try:
            yield
        finally:
            self._active = False
            self._state = self._get_state()
            self._set_state(default_state)
