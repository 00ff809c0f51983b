"""A candidate layout in the strategy's own argument names, the run it is for, and the checks it must pass.

``Layout`` holds what ``Megatron3DStrategy(...)`` takes (plus the Trainer's ``accumulate_grad_batches``, which
cuts a pipeline-free step into micro-batches); ``Workload`` holds what the layout does not choose: the model,
the global batch, the sequence length, the precision. :func:`check_layout` runs the validation the strategy
and the data module run before any collective (``ParallelConfig``, the model's ``validate_parallel_config``,
the pipeline's layer split, schedule and micro-batch checks, context parallelism's sequence cut), calling
them rather than restating them, so the planner proposes exactly the layouts the strategy accepts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lightning_megatron.context_parallel.inputs import check_sequence_length
from lightning_megatron.offload.settings import DEFAULT_BUFFER_MB, OffloadSettings, tier_of
from lightning_megatron.optim.param_gather import check_overlap_param_gather
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.pipeline.layout import SCHEDULE_SPECS, PipelineLayout, check_micro_batches, check_schedule
from lightning_megatron.optim.zero3 import ZERO3_PRECISIONS

SIXTEEN_BIT_PRECISIONS = ("bf16-true", "16-true", "bf16-mixed", "16-mixed")
#: What a planned ``"nvme"`` layout passes as ``offload_path``: the planner cannot know the disk, the user sets it.
OFFLOAD_PATH_PLACEHOLDER = "/SET/offload_path/TO/A/FOLDER/ON/A/LOCAL/NVME/DISK"
PRECISIONS = ("32-true", *SIXTEEN_BIT_PRECISIONS)


@dataclass(frozen=True)
class Workload:
    """What a layout is asked to run: ``global_batch_size`` sequences of ``seq_length`` tokens per optimizer step
    in ``precision``, with the strategy's ``bucket_size_mb``, ``pad_vocab_to_multiple_of`` and ``offload_buffer_mb``
    (the ``"nvme"`` tier's host buffers).

    ``attention``: how attention's core runs. ``"flash"`` (what this package runs: SDPA's fused kernels, no
    ``s x s`` scores in memory, causal blocks skipped) or ``"materialized"`` (the scores written out and
    scaled, masked, soft-maxed and dropped out by element-wise kernels, as Megatron-LM did before flash
    attention: for predicting its published runs).

    ``fp8``: the layers' linear GEMMs in FP8 (the strategy's ``fp8`` option; the output head and attention's core
    stay 16-bit). ``recomputed_gemm_share``: the share of each layer's forward linear FLOPs that backward recomputes
    besides what ``activation_checkpointing`` does; 0 for this package, which has no such policy: it describes
    other frameworks' published runs (torchtitan's op-level selective checkpointing recomputes every second
    matmul). ``overlap_tensor_parallel``: the tensor-parallel collectives run under the GEMMs (Megatron-Core's and
    Transformer Engine's userbuffers overlap; this package does not overlap them), for published runs likewise."""

    global_batch_size: int
    seq_length: int
    precision: str = "bf16-true"
    bucket_size_mb: float = 25.0
    pad_vocab_to_multiple_of: int = 128
    attention: str = "flash"
    offload_buffer_mb: float = DEFAULT_BUFFER_MB
    fp8: bool = False
    recomputed_gemm_share: float = 0.0
    overlap_tensor_parallel: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.recomputed_gemm_share <= 1:
            raise ValueError(f"recomputed_gemm_share is a fraction (0 to 1), got {self.recomputed_gemm_share}.")
        if not self.offload_buffer_mb > 0:
            raise ValueError(f"offload_buffer_mb must be > 0, got {self.offload_buffer_mb}.")
        for name in ("global_batch_size", "seq_length", "pad_vocab_to_multiple_of"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not one of {PRECISIONS}.")
        if self.attention not in ("flash", "materialized"):
            raise ValueError(f"attention={self.attention!r} is not 'flash' or 'materialized'.")

    @property
    def sixteen_bit_compute(self) -> bool:
        return self.precision in SIXTEEN_BIT_PRECISIONS

    @property
    def compute_bytes(self) -> int:
        """Bytes of an activation element: the compute dtype."""
        return 2 if self.sixteen_bit_compute else 4

    @property
    def parameter_bytes(self) -> int:
        """Bytes of a parameter element: 16-bit under the ``-true`` 16-bit precisions, else fp32."""
        return 2 if self.precision in ("bf16-true", "16-true") else 4


@dataclass(frozen=True)
class Layout(ParallelConfig):
    """One way to run a workload: a ``ParallelConfig`` (whose checks run when it is built) and the strategy's
    schedule, micro-batch, recomputation, offload and parameter-gather overlap arguments, and the Trainer's ``accumulate_grad_batches``.
    The field names are ``Megatron3DStrategy``'s. ``offload_optimizer`` (ZeRO 0-2) and ``offload_parameters``
    (ZeRO-3) are tiers of ``offload.TIERS`` (``"none"``, ``"cpu"``, ``"nvme"``); ``True``/``False`` are accepted and
    stored as ``"cpu"``/``"none"``, as the strategy reads them."""

    pipeline_schedule: str = "1f1b"
    micro_batch_size: int = 1
    activation_checkpointing: str = "none"
    offload_optimizer: str = "none"
    offload_parameters: str = "none"
    overlap_param_gather: bool = False
    accumulate_grad_batches: int = 1  # the Trainer's: micro-batches of a step without pipelining

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("offload_optimizer", "offload_parameters"):
            object.__setattr__(self, name, tier_of(getattr(self, name), option=name))

    @property
    def offload_tier(self) -> str:
        """Where this layout's fp32 main parameters and optimizer state live (ZeRO-3: also the parameters)."""
        return self.offload_parameters if self.zero_stage == 3 else self.offload_optimizer

    def offload_settings(self) -> OffloadSettings:
        """The strategy's ``OffloadSettings`` for this layout (``offload_path``: the placeholder where ``"nvme"``)."""
        nvme = "nvme" in (self.offload_optimizer, self.offload_parameters)
        path = OFFLOAD_PATH_PLACEHOLDER if nvme else None
        return OffloadSettings(self.offload_optimizer, self.offload_parameters, path)

    def micro_batches(self, workload: Workload) -> int:
        """Forward/backward passes of a step on one rank: pipeline micro-batches, or accumulated batches."""
        per_rank = workload.global_batch_size // self.data_parallel_size
        return per_rank // self.micro_batch_size

    def strategy_arguments(self) -> dict[str, Any]:
        """``Megatron3DStrategy(**this)``. The offload arguments appear only when used (a tier other than
        ``"none"``, the strategy's default), so a plan without offloading reads as before the tiers existed, and
        ``offload_path`` only for the ``"nvme"`` tier, as :data:`OFFLOAD_PATH_PLACEHOLDER`: the user must set it."""
        arguments = asdict(self)
        arguments.pop("accumulate_grad_batches")
        if arguments["pipeline_layers_per_stage"] is not None:
            arguments["pipeline_layers_per_stage"] = list(arguments["pipeline_layers_per_stage"])
        for name in ("offload_optimizer", "offload_parameters"):
            if arguments[name] == "none":
                arguments.pop(name)
        path = self.offload_settings().path
        if path is not None:
            arguments["offload_path"] = path
        return arguments

    def label(self) -> str:
        """A short name: ``tp8 pp16v2 dp8 z1+cpu sp ac-sel mb1`` (``ac-``: activation checkpointing; ``ep8etp1``:
        experts whole on each tp rank, ``expert_tensor_parallel_size=1``). After the ZeRO
        stage: ``+cpu``/``+nvme`` the optimizer's offload tier, ``+pcpu`` ZeRO-3's parameters' tier,
        ``+og`` the overlapped parameter gather."""
        parts = [f"tp{self.tensor_parallel_size}"]
        if self.pipeline_parallel_size > 1:
            parts.append(f"pp{self.pipeline_parallel_size}"
                         + (f"v{self.virtual_pipeline_size}" if self.virtual_pipeline_size > 1 else ""))
        if self.context_parallel_size > 1:
            parts.append(f"cp{self.context_parallel_size}")
        parts.append(f"dp{self.data_parallel_size}")
        if self.expert_parallel_size > 1:
            parts.append(f"ep{self.expert_parallel_size}"
                         + ("etp1" if self.expert_tensor_parallel < self.tensor_parallel_size else ""))
        offload = ("" if self.offload_optimizer == "none" else f"+{self.offload_optimizer}") + (
            "" if self.offload_parameters == "none" else f"+p{self.offload_parameters}")
        parts.append(f"z{self.zero_stage}{offload}" + ("+og" if self.overlap_param_gather else ""))
        if self.sequence_parallel:
            parts.append("sp")
        if self.activation_checkpointing != "none":
            parts.append({"selective": "ac-sel", "full": "ac-full"}[self.activation_checkpointing])
        parts.append(f"mb{self.micro_batch_size}")
        return " ".join(parts)


def check_layout(layout: Layout, workload: Workload, module: Any, num_layers: int) -> None:
    """Raise the ``ValueError`` the strategy (or the data module) would raise for this layout, before any
    collective; return quietly if it would run."""
    validate = getattr(module, "validate_parallel_config", None)
    if validate is not None:
        validate(layout)  # a Layout is the ParallelConfig the strategy hands the model
    check_schedule(layout.pipeline_schedule, layout.virtual_pipeline_size, zero_stage=layout.zero_stage)
    if SCHEDULE_SPECS[layout.pipeline_schedule].split_backward:
        raise ValueError(f"The planner models 1f1b, interleaved_1f1b and gpipe; pipeline_schedule="
                         f"{layout.pipeline_schedule!r} (a split backward, another stage placement and bubble) is not "
                         f"planned yet. Plan with interleaved_1f1b and switch the schedule in the config.")
    if layout.pipeline_parallel_size > 1:
        PipelineLayout(num_layers=num_layers, pipeline_parallel_size=layout.pipeline_parallel_size,
                       virtual_pipeline_size=layout.virtual_pipeline_size, layers_per_stage=layout.pipeline_layers_per_stage)
    if workload.global_batch_size % layout.data_parallel_size:
        raise ValueError(f"global_batch_size={workload.global_batch_size} is not divisible by the data-parallel size "
                         f"{layout.data_parallel_size}; choose a global_batch_size that is a multiple of it.")
    per_rank = workload.global_batch_size // layout.data_parallel_size
    if layout.pipeline_parallel_size > 1:
        if layout.accumulate_grad_batches != 1:
            raise ValueError("Under pipeline parallelism the schedule cuts the step into micro-batches; keep "
                             "accumulate_grad_batches=1.")
        check_micro_batches(schedule=layout.pipeline_schedule, batch_size=per_rank,
                            micro_batch_size=layout.micro_batch_size, pipeline_parallel_size=layout.pipeline_parallel_size)
    elif per_rank != layout.micro_batch_size * layout.accumulate_grad_batches:
        raise ValueError(f"Without pipelining a step's {per_rank} samples per data-parallel rank are "
                         f"accumulate_grad_batches={layout.accumulate_grad_batches} batches of "
                         f"{layout.micro_batch_size}; they must multiply to {per_rank}.")
    if layout.context_parallel_size > 1:
        check_sequence_length(workload.seq_length, layout.context_parallel_size,
                              tensor_parallel_size=layout.tensor_parallel_size, sequence_parallel=layout.sequence_parallel)
    elif layout.sequence_parallel and workload.seq_length % layout.tensor_parallel_size:
        raise ValueError(f"Sequence parallelism splits each sequence over tensor_parallel_size="
                         f"{layout.tensor_parallel_size}; seq_length={workload.seq_length} does not divide.")
    check_overlap_param_gather(layout.overlap_param_gather, layout.zero_stage)
    layout.offload_settings().check(layout.zero_stage)
    if layout.zero_stage == 3 and workload.precision not in ZERO3_PRECISIONS:
        raise ValueError(f"zero_stage=3 supports precision {', '.join(map(repr, ZERO3_PRECISIONS))}, not "
                         f"{workload.precision!r}.")
