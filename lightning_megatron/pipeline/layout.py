"""Which layers go to which pipeline stage, and which stages run on which rank.

With ``P`` pipeline ranks and ``V`` virtual stages per rank (interleaving, Narayanan et al.
2021) there are ``P * V`` stages; rank ``r`` runs stages ``r, r + P, ..., r + (V - 1) P``.
The first stage also carries the embedding and the last the output head, which is why a
user may give them fewer layers (``layers_per_stage=[3, 5, 5, 3]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe")


@dataclass(frozen=True)
class PipelineLayout:
    num_layers: int
    pipeline_parallel_size: int
    virtual_pipeline_size: int = 1
    layers_per_stage: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        P, V, layers = self.pipeline_parallel_size, self.virtual_pipeline_size, self.num_layers
        if V < 1:
            raise ValueError(f"virtual_pipeline_size must be >= 1, got {V}.")
        if V > 1 and P == 1:
            raise ValueError(
                f"virtual_pipeline_size={V} interleaves stages across pipeline ranks, but pipeline_parallel_size=1. "
                f"Set pipeline_parallel_size > 1 or virtual_pipeline_size=1."
            )
        if self.layers_per_stage is None:
            if layers % (P * V) != 0:
                raise ValueError(
                    f"num_layers={layers} does not divide into pipeline_parallel_size * virtual_pipeline_size = "
                    f"{P} * {V} = {P * V} equal stages. Choose sizes whose product divides {layers}, or give "
                    f"layers_per_stage explicitly (a list of {P * V} counts summing to {layers})."
                )
        else:
            counts = self.layers_per_stage
            if len(counts) != P * V or sum(counts) != layers or min(counts) < 0:
                raise ValueError(
                    f"layers_per_stage={list(counts)} must have pipeline_parallel_size * virtual_pipeline_size = "
                    f"{P * V} non-negative entries summing to num_layers={layers} (it has {len(counts)} entries "
                    f"summing to {sum(counts)})."
                )

    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel_size * self.virtual_pipeline_size

    def stage_layers(self) -> list[list[int]]:
        """Layer indices of each stage, in order."""
        counts = self.layers_per_stage or (self.num_layers // self.num_stages,) * self.num_stages
        out, start = [], 0
        for count in counts:
            out.append(list(range(start, start + count)))
            start += count
        return out

    def stages_of_rank(self, pipeline_rank: int) -> list[int]:
        return [pipeline_rank + v * self.pipeline_parallel_size for v in range(self.virtual_pipeline_size)]


def check_micro_batches(*, schedule: str, batch_size: int, micro_batch_size: int, pipeline_parallel_size: int) -> int:
    """Number of micro-batches of a per-rank batch; raises the same error on every rank before any send."""
    if batch_size % micro_batch_size != 0:
        raise ValueError(
            f"The per-rank batch of {batch_size} samples (global batch / data-parallel size) does not divide into "
            f"micro-batches of micro_batch_size={micro_batch_size}. Make global_batch_size a multiple of "
            f"micro_batch_size * data_parallel_size."
        )
    n = batch_size // micro_batch_size
    if schedule in ("1f1b", "interleaved_1f1b") and n < pipeline_parallel_size:
        raise ValueError(
            f"The {schedule} schedule needs at least pipeline_parallel_size={pipeline_parallel_size} micro-batches per "
            f"step, but the per-rank batch of {batch_size} gives {n} of size {micro_batch_size}. Lower "
            f"micro_batch_size or raise the global batch."
        )
    return n


def check_schedule(schedule: str, virtual_pipeline_size: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"Unknown pipeline_schedule {schedule!r}. Choose one of {', '.join(SCHEDULES)}.")
    if schedule == "interleaved_1f1b" and virtual_pipeline_size < 2:
        raise ValueError(
            "pipeline_schedule='interleaved_1f1b' needs virtual_pipeline_size >= 2 stages per rank; "
            "use '1f1b' for one stage per rank."
        )
    if schedule != "interleaved_1f1b" and virtual_pipeline_size > 1:
        raise ValueError(
            f"virtual_pipeline_size={virtual_pipeline_size} needs pipeline_schedule='interleaved_1f1b', "
            f"not {schedule!r}."
        )
