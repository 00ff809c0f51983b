"""Clocks and memory meters for measured steps."""

from __future__ import annotations

import resource
import sys
import time
from typing import Optional

import lightning as L
import torch
from torch import Tensor


class PeakMemory:
    """Peak memory this run added on top of what the process held before the model existed.

    CUDA: ``max_memory_allocated`` (tensors only, not the caching allocator's reserve).
    CPU: growth of ``ru_maxrss``, the kernel's high-water mark of resident memory. tracemalloc
    cannot be used: it sees only Python allocations, not torch's C++ allocator. RSS also counts
    allocator slack and thread-local arenas, which is what the machine really pays. The
    baseline is taken after imports and data, where the high-water mark equals the current
    RSS to within a MiB (imports leave no transient peak), so the growth charges each run
    exactly its model, optimizer, activations and framework machinery.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline = torch.cuda.memory_allocated(device)
        else:
            self.baseline = self._max_rss()

    @staticmethod
    def _max_rss() -> int:
        scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return self._max_rss() - self.baseline


class Stopwatch:
    """The duration of every measured step: from its start to the next step's start (the last: to its end).

    A period covers everything done between two steps (data, trainer bookkeeping, the
    optimizer), so framework overhead is charged; taking the median over steps rejects
    the spikes that other processes cause on a shared machine. On CUDA the marks are
    events on the current stream, so timing adds no host synchronisation to the loop.

    ``clock="cpu"`` (CPU runs) reads ``time.process_time`` instead: the CPU seconds this
    process got, all its threads. Jobs competing for the cores can stretch wall time many
    times over but barely move CPU time; the price is that idle waiting (a rank blocked in
    a collective on a slower peer) is not counted, so use it for single-threaded,
    CPU-bound comparisons on a busy machine, and wall time otherwise.
    """

    def __init__(self, warmup: int, steps: int, device: torch.device, clock: str = "wall") -> None:
        self.first, self.last, self.device = warmup, warmup + steps - 1, device
        self.cpu_clock = clock == "cpu" and device.type == "cpu"
        self.marks: list = []

    def _mark(self):
        if self.device.type != "cuda":
            return time.process_time() if self.cpu_clock else time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step_started(self, step: int) -> None:
        if self.first <= step <= self.last:
            self.marks.append(self._mark())

    def step_ended(self, step: int) -> None:
        if step == self.last:
            self.marks.append(self._mark())

    def step_seconds(self) -> list[float]:
        if len(self.marks) != self.last - self.first + 2:
            raise RuntimeError(f"Timed {len(self.marks) - 1} steps instead of {self.last - self.first + 1}: "
                               "is the loader long enough and --steps positive?")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [start.elapsed_time(end) / 1000 for start, end in zip(self.marks, self.marks[1:])]
        return [end - start for start, end in zip(self.marks, self.marks[1:])]


class StopwatchCallback(L.Callback):
    """Drives a ``Stopwatch`` from Lightning's batch hooks and keeps the last step's loss."""

    def __init__(self, stopwatch: Stopwatch) -> None:
        self.stopwatch = stopwatch
        self.last_loss: Optional[Tensor] = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.stopwatch.step_started(batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.stopwatch.step_ended(batch_idx)
        self.last_loss = outputs["loss"]
