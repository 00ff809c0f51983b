"""The parallel layout: how many ways the model and the data are split.

All validation that does not need the model lives here, so that a bad layout is
reported by every rank with the same message before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the four parallel dimensions and the features layered on them.

    ``world_size == tensor_parallel_size * context_parallel_size * pipeline_parallel_size * data_parallel_size``.
    Context parallelism splits every sample's sequence over ``context_parallel_size`` ranks that hold the same
    weights, so the weights are replicated over ``dp x cp`` (:attr:`replica_size`). Expert parallelism is
    carved out of data parallelism: ``expert_parallel_size`` divides ``data_parallel_size``, and data-parallel
    rank ``d`` is expert-parallel rank ``d % ep`` of expert-data-parallel rank ``d // ep``. Under ZeRO-3 the dense
    parameters are sharded over dp and the experts' over their expert-data-parallel group (``dp / ep`` ranks).
    ``expert_tensor_parallel_size=1`` (Megatron-Core's MoE parallel folding, its ``etp=1`` case) keeps every expert
    whole on each tp rank: the tp x dp ranks of a pipeline stage are then the expert slots (:meth:`expert_slot`)
    that ``expert_parallel_size`` divides, while attention stays split over tp.

    Example::

        >>> ParallelConfig(tensor_parallel_size=2, data_parallel_size=4).world_size
        8
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 0
    virtual_pipeline_size: int = 1
    pipeline_layers_per_stage: Optional[tuple[int, ...]] = None
    expert_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "expert_parallel_size",
                     "context_parallel_size"):
            _check_positive(name, getattr(self, name))
        if self.expert_tensor_parallel_size is not None:
            _check_positive("expert_tensor_parallel_size", self.expert_tensor_parallel_size)
        if self.context_parallel_size > 1 and self.expert_parallel_size > 1:
            raise ValueError(
                f"context_parallel_size={self.context_parallel_size} with expert_parallel_size="
                f"{self.expert_parallel_size} is not supported: the MoE routing statistics and capacity are per "
                f"sequence, and under context parallelism a sequence is split over ranks. Use one of the two.")
        ep, dp, tp = self.expert_parallel_size, self.data_parallel_size, self.tensor_parallel_size
        etp = self.expert_tensor_parallel
        if etp not in (1, tp):
            raise ValueError(
                f"expert_tensor_parallel_size={etp} with tensor_parallel_size={tp} is not supported: the experts are "
                f"split over all tp ranks (expert_tensor_parallel_size=None or {tp}) or kept whole on each "
                f"(expert_tensor_parallel_size=1, the tp ranks then hold different experts).")
        if self.whole_experts and ep == 1:
            raise ValueError(
                f"expert_tensor_parallel_size=1 with tensor_parallel_size={tp} keeps every expert whole, so the {tp} "
                f"tp ranks must hold different experts: set expert_parallel_size to a divisor of tp x dp = {tp * dp} "
                f"above 1, or expert_tensor_parallel_size={tp}.")
        if self.whole_experts:
            if (tp * dp) % ep:
                raise ValueError(
                    f"expert_parallel_size={ep} must divide tensor_parallel_size x data_parallel_size = {tp * dp} "
                    f"with expert_tensor_parallel_size=1 (the experts are spread over the tp and dp ranks). Use "
                    f"an expert_parallel_size in {[d for d in range(2, tp * dp + 1) if (tp * dp) % d == 0]}.")
        elif dp % ep:
            raise ValueError(
                f"expert_parallel_size={ep} must divide data_parallel_size={dp}: the experts are split over groups of "
                f"{ep} data-parallel ranks (Megatron-Core's layout), each rank holding 1/{ep} of them. Use an "
                f"expert_parallel_size in {[d for d in range(1, dp + 1) if dp % d == 0]} or more data-parallel ranks.")
        _check_positive("virtual_pipeline_size", self.virtual_pipeline_size)
        if self.virtual_pipeline_size > 1 and self.pipeline_parallel_size == 1:
            raise ValueError(
                f"virtual_pipeline_size={self.virtual_pipeline_size} interleaves stages across pipeline ranks, but "
                f"pipeline_parallel_size=1. Set pipeline_parallel_size > 1 or virtual_pipeline_size=1."
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(
                f"zero_stage must be 0 (no sharding), 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters), "
                f"got {self.zero_stage!r}."
            )

        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ValueError(
                "sequence_parallel=True needs tensor_parallel_size > 1: it splits the sequence over the "
                "tensor-parallel group. Set tensor_parallel_size or turn sequence_parallel off."
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.context_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def replica_size(self) -> int:
        """Ranks that hold the same weight shards (the same tp and pp coordinates): ``dp x cp``. Gradients are
        reduced, and ZeRO shards, over them."""
        return self.data_parallel_size * self.context_parallel_size

    @property
    def expert_tensor_parallel(self) -> int:
        """Over how many tp ranks each expert is split (Megatron-Core's ``expert_tensor_parallel_size``): tp (the
        default) or 1, where each tp rank holds whole experts and the tp ranks join expert parallelism."""
        return self.tensor_parallel_size if self.expert_tensor_parallel_size is None else self.expert_tensor_parallel_size

    @property
    def whole_experts(self) -> bool:
        """Whether each tp rank holds whole experts (``expert_tensor_parallel_size=1`` at tp > 1): the tp ranks then
        hold different experts and join expert parallelism."""
        return self.expert_tensor_parallel < self.tensor_parallel_size

    @property
    def expert_slots(self) -> int:
        """Ranks of one pipeline stage that hold different experts or replicas of them (Megatron-Core's "MoE
        parallel folding"): dp, or tp x dp when the experts are whole on each tp rank. ``expert_parallel_size``
        divides it; slot ``j`` is expert-parallel rank ``j % ep`` of expert-data-parallel rank ``j // ep``."""
        return self.data_parallel_size * self.tensor_parallel_size // self.expert_tensor_parallel

    def expert_slot(self, data_rank: int, tensor_rank: int) -> int:
        """The slot of the rank at (``data_rank``, ``tensor_rank``): dp-major, its tp ranks next to each other."""
        folded = self.tensor_parallel_size // self.expert_tensor_parallel
        return data_rank * folded + tensor_rank // self.expert_tensor_parallel

    @property
    def expert_data_parallel_size(self) -> int:
        """Replicas of each expert: the slots left once the experts are split ``expert_parallel_size`` ways."""
        return self.expert_slots // self.expert_parallel_size

    @classmethod
    def for_world(
        cls,
        world_size: int,
        *,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int | str = "auto",
        sequence_parallel: bool = False,
        zero_stage: int = 0,
        virtual_pipeline_size: int = 1,
        pipeline_layers_per_stage: Optional[tuple[int, ...]] = None,
        expert_parallel_size: int = 1,
        context_parallel_size: int = 1,
        expert_tensor_parallel_size: Optional[int] = None,
    ) -> "ParallelConfig":
        """Build a config for ``world_size`` processes; ``data_parallel_size="auto"`` takes what is left."""
        _check_positive("tensor_parallel_size", tensor_parallel_size)
        _check_positive("pipeline_parallel_size", pipeline_parallel_size)
        _check_positive("context_parallel_size", context_parallel_size)
        model_parallel = tensor_parallel_size * pipeline_parallel_size * context_parallel_size
        if world_size % model_parallel != 0:
            raise ValueError(
                f"The world size ({world_size} processes) is not a multiple of tensor_parallel_size * "
                f"pipeline_parallel_size * context_parallel_size = {tensor_parallel_size} * {pipeline_parallel_size} "
                f"* {context_parallel_size} = {model_parallel}. "
                f"Launch a multiple of {model_parallel} processes (devices * num_nodes) or change the sizes."
            )
        if data_parallel_size == "auto":
            data_parallel_size = world_size // model_parallel
        config = cls(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,  # type: ignore[arg-type]
            sequence_parallel=sequence_parallel,
            zero_stage=zero_stage,
            virtual_pipeline_size=virtual_pipeline_size,
            pipeline_layers_per_stage=pipeline_layers_per_stage,
            expert_parallel_size=expert_parallel_size,
            context_parallel_size=context_parallel_size,
            expert_tensor_parallel_size=expert_tensor_parallel_size,
        )
        if config.world_size != world_size:
            raise ValueError(
                f"tensor_parallel_size * context_parallel_size * pipeline_parallel_size * data_parallel_size = "
                f"{tensor_parallel_size} * {context_parallel_size} * {pipeline_parallel_size} * {data_parallel_size} "
                f"= {config.world_size}, but {world_size} processes "
                f"were launched. Set data_parallel_size='auto' or launch {config.world_size} processes."
            )
        return config

    def rank_of(self, *, pipeline_rank: int, data_rank: int, tensor_rank: int, context_rank: int = 0) -> int:
        """Global rank of a coordinate of the ("pp", "dp", "cp", "tp") mesh: tensor-parallel is innermost, so a TP
        group sits on one node, and context-parallel next to it (its ring also wants fast links)."""
        replica = (pipeline_rank * self.data_parallel_size + data_rank) * self.context_parallel_size + context_rank
        return replica * self.tensor_parallel_size + tensor_rank

    def coordinates_of(self, rank: int) -> tuple[int, int, int, int]:
        """``(pipeline_rank, data_rank, context_rank, tensor_rank)`` of a global rank; the inverse of :meth:`rank_of`."""
        tensor_rank = rank % self.tensor_parallel_size
        rest = rank // self.tensor_parallel_size
        context_rank = rest % self.context_parallel_size
        rest //= self.context_parallel_size
        return rest // self.data_parallel_size, rest % self.data_parallel_size, context_rank, tensor_rank


def requested_layout(*, tensor_parallel_size: int | str, pipeline_parallel_size: int | str,
                     data_parallel_size: int | str, sequence_parallel: bool, zero_stage: int,
                     virtual_pipeline_size: int | str, pipeline_layers_per_stage: Optional[Sequence[int]],
                     expert_parallel_size: int | str, context_parallel_size: int | str,
                     expert_tensor_parallel_size: Optional[int] = None) -> dict[str, Any]:
    """``Megatron3DStrategy``'s layout arguments as given, checked as far as they can be before any process exists
    (the world size is known only then): ``"auto"`` sizes, which the layout planner fills in, count as 1 here;
    ``data_parallel_size="auto"`` takes what the others leave. What :meth:`ParallelConfig.for_world` takes."""
    if data_parallel_size != "auto" and (not isinstance(data_parallel_size, int) or data_parallel_size < 1):
        raise ValueError(f"data_parallel_size must be a positive integer or 'auto', got {data_parallel_size!r}.")
    sizes = dict(tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                 virtual_pipeline_size=virtual_pipeline_size, expert_parallel_size=expert_parallel_size,
                 context_parallel_size=context_parallel_size)
    known = {name: 1 if value == "auto" else value for name, value in sizes.items()}
    ParallelConfig(data_parallel_size=known["expert_parallel_size"] if data_parallel_size == "auto" else data_parallel_size,
                   sequence_parallel=sequence_parallel and tensor_parallel_size != "auto", zero_stage=zero_stage,
                   expert_tensor_parallel_size=None if tensor_parallel_size == "auto" else expert_tensor_parallel_size,
                   **known)
    return dict(sizes, data_parallel_size=data_parallel_size, sequence_parallel=sequence_parallel, zero_stage=zero_stage,
                pipeline_layers_per_stage=tuple(pipeline_layers_per_stage) if pipeline_layers_per_stage else None,
                expert_tensor_parallel_size=expert_tensor_parallel_size)
