"""Which layers go to which pipeline stage, which stages run on which rank, and what each schedule needs.

With ``P`` pipeline ranks and ``V`` virtual stages per rank (interleaving, Narayanan et al.
2021) there are ``P * V`` stages. Most schedules *loop* over the ranks: rank ``r`` runs stages
``r, r + P, ..., r + (V - 1) P``. The V-shaped schedules (ZB-V, DualPipeV) hold two stages per
rank placed as a *V*: rank ``r`` runs stages ``r`` and ``2P - 1 - r``, so the first and the last
stage (embedding and head) share rank 0 and a rank's second stage starts its backward as soon
as its own forward ends.
The first stage also carries the embedding and the last the output head, which is why a
user may give them fewer layers (``layers_per_stage=[3, 5, 5, 3]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union


@dataclass(frozen=True)
class ScheduleSpec:
    """What a pipeline schedule asks of the layout (torch.distributed.pipelining runs it)."""

    virtual: str  # stages per rank: "one", "many" (>= 2), "any" (>= 1) or "two"
    placement: str = "loop"  # "loop" or "v" (see the module docstring)
    split_backward: bool = False  # backward cut into an input-gradient and a later weight-gradient pass
    micro_batches: str = ""  # the rule on the micro-batch count m (checked by check_micro_batches)


SCHEDULE_SPECS = {
    "1f1b": ScheduleSpec("one", micro_batches="m >= p"),
    "gpipe": ScheduleSpec("one"),
    "interleaved_1f1b": ScheduleSpec("many", micro_batches="rounds"),
    # Zero-bubble schedules (Qi et al. 2024): the weight-gradient passes fill what would be bubbles.
    "interleaved_zero_bubble": ScheduleSpec("any", split_backward=True, micro_batches="rounds"),
    "zbv": ScheduleSpec("two", placement="v", split_backward=True, micro_batches="m >= p"),
    "dualpipev": ScheduleSpec("two", placement="v", split_backward=True, micro_batches="m >= 2p"),
}
SCHEDULES = tuple(SCHEDULE_SPECS)


@dataclass(frozen=True)
class PipelineLayout:
    num_layers: int
    pipeline_parallel_size: int
    virtual_pipeline_size: int = 1
    layers_per_stage: Optional[tuple[int, ...]] = None
    schedule: str = "1f1b"  # decides the placement of the stages on the ranks

    def __post_init__(self) -> None:
        P, V, layers = self.pipeline_parallel_size, self.virtual_pipeline_size, self.num_layers
        if V < 1:
            raise ValueError(f"virtual_pipeline_size must be >= 1, got {V}.")
        if self.schedule not in SCHEDULE_SPECS or SCHEDULE_SPECS[self.schedule].placement == "v":
            check_schedule(self.schedule, V)  # the placement needs its stage count (the strategy checks the rest)
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
        """The stages ``pipeline_rank`` runs, in stage order."""
        P = self.pipeline_parallel_size
        if SCHEDULE_SPECS[self.schedule].placement == "v":
            return [pipeline_rank, 2 * P - 1 - pipeline_rank]
        return [pipeline_rank + v * P for v in range(self.virtual_pipeline_size)]

    def rank_of_stage(self, stage: int) -> int:
        """The pipeline rank that runs ``stage``."""
        return rank_of_stage(stage, self.pipeline_parallel_size, self.schedule)


def rank_of_stage(stage: int, pipeline_parallel_size: int, schedule: str) -> int:
    """The pipeline rank that runs ``stage`` under ``schedule``'s placement (see the module docstring)."""
    P = pipeline_parallel_size
    if SCHEDULE_SPECS[schedule].placement == "v":
        return stage if stage < P else 2 * P - 1 - stage
    return stage % P


def check_micro_batches(*, schedule: str, batch_size: int, micro_batch_size: int, pipeline_parallel_size: int) -> int:
    """Number of micro-batches of a per-rank batch; raises the same error on every rank before any send."""
    if batch_size % micro_batch_size != 0:
        raise ValueError(
            f"The per-rank batch of {batch_size} samples (global batch / data-parallel size) does not divide into "
            f"micro-batches of micro_batch_size={micro_batch_size}. Make global_batch_size a multiple of "
            f"micro_batch_size * data_parallel_size."
        )
    n, p = batch_size // micro_batch_size, pipeline_parallel_size
    rule = SCHEDULE_SPECS[schedule].micro_batches
    least = {"m >= p": p, "m >= 2p": 2 * p}.get(rule, 0)
    if n < least:
        raise ValueError(
            f"The {schedule} schedule needs at least {'' if least == p else '2 * '}pipeline_parallel_size={least} "
            f"micro-batches per step, but the per-rank batch of {batch_size} gives {n} of size {micro_batch_size}. "
            f"Lower micro_batch_size or raise the global batch."
        )
    rounds = max(1, n // p)
    if rule == "rounds" and n % rounds:
        fits = [k for k in range(1, 4 * p + 1) if k % max(1, k // p) == 0]
        raise ValueError(
            f"The {schedule} schedule runs the micro-batches in max(1, m // p) rounds of equal size, so m={n} "
            f"micro-batches at pipeline_parallel_size={p} do not fit ({n} % {rounds} != 0). Choose a micro-batch count "
            f"among {fits[:12]}... (any multiple of p works) via micro_batch_size or the global batch."
        )
    return n


def check_schedule(schedule: str, virtual_pipeline_size: Union[int, str], *, zero_stage: int = 0) -> None:
    """The schedule exists and suits ``virtual_pipeline_size`` stages per rank (``"auto"``: the planner's choice,
    not checked here) and the ZeRO stage."""
    if schedule not in SCHEDULE_SPECS:
        raise ValueError(f"Unknown pipeline_schedule {schedule!r}. Choose one of {', '.join(SCHEDULES)}.")
    if SCHEDULE_SPECS[schedule].split_backward and zero_stage == 3:
        raise ValueError(
            f"pipeline_schedule={schedule!r} splits each backward into an input- and a weight-gradient pass, but "
            f"zero_stage=3 (FSDP2) reduce-scatters a layer's gradients when its input gradient is done, before the "
            f"weight pass. Use zero_stage 1 or 2 with {schedule!r}, or a schedule without the split (1f1b, "
            f"interleaved_1f1b, gpipe) with zero_stage=3.")
    if virtual_pipeline_size == "auto":
        return
    V = virtual_pipeline_size
    needs = SCHEDULE_SPECS[schedule].virtual
    if needs == "many" and V < 2:
        raise ValueError(
            f"pipeline_schedule={schedule!r} needs virtual_pipeline_size >= 2 stages per rank; "
            "use '1f1b' for one stage per rank."
        )
    if needs == "two" and V != 2:
        raise ValueError(
            f"pipeline_schedule={schedule!r} places exactly two stages on each rank, in a V; set "
            f"virtual_pipeline_size=2 (got {V})."
        )
    if needs == "one" and V > 1:
        many = [name for name, spec in SCHEDULE_SPECS.items() if spec.virtual in ("many", "any")
                or (spec.virtual == "two" and V == 2)]
        raise ValueError(
            f"virtual_pipeline_size={V} needs a schedule with several stages per rank ({', '.join(map(repr, many))}), "
            f"not {schedule!r}."
        )
