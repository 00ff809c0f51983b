"""The planner: every valid layout of a workload on a machine, with its predicted memory and step time.

``Planner(make_module, workload, hardware, world_size=N)`` enumerates the layouts the strategy would accept
(:func:`lightning_megatron.plan.layout.check_layout`), predicts for each the memory of its fullest GPU
(model states exactly, ``plan.model_state``; activations, ``plan.activations``; a stated allowance for
buffers) and its step time (``plan.step_time``), and ranks the ones that fit by predicted tokens/s. A layout
fits when its fullest GPU's bytes fit the GPU's memory and, per node (its ranks together), the offload tiers'
host bytes (``plan.model_state.placement``, plus ``HOST_PROCESS_BYTES`` a rank) fit the host's RAM and the
``"nvme"`` tier's files its disk; ``LayoutPlan.limits`` says which limit a layout exceeds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

from torch import nn

from lightning_megatron.models.flops import flops_per_batch
from lightning_megatron.offload.settings import PARAMETER_TIERS, TIERS, tier_of
from lightning_megatron.plan.activations import activation_bytes, buffer_bytes
from lightning_megatron.plan.hardware import GIB, Hardware
from lightning_megatron.plan.inventory import Inventory, optimizer_state_bytes_per_element
from lightning_megatron.plan.layout import Layout, Workload, check_layout
from lightning_megatron.plan.model_state import HOST_PROCESS_BYTES, placement, rank_model_state_bytes
from lightning_megatron.plan.shape import ModelShape
from lightning_megatron.plan.step_time import StepTime, step_time
from lightning_megatron.transforms.recompute import MODES as RECOMPUTE_MODES

#: Context parallelism is searched only while each rank keeps at least this many tokens of a sequence.
MIN_CONTEXT_TOKENS = 2048
#: Layout fields the search may choose; ``Planner(fixed=...)`` pins any of them.
SEARCHED = ("tensor_parallel_size", "pipeline_parallel_size", "virtual_pipeline_size", "context_parallel_size",
            "expert_parallel_size", "expert_tensor_parallel_size", "sequence_parallel", "zero_stage",
            "offload_optimizer", "offload_parameters", "activation_checkpointing", "micro_batch_size")


@dataclass(frozen=True)
class RankMemory:
    """One pipeline rank's predicted bytes: model states (the strategy's keys), activations, buffers, and what of
    all that is in GPU memory (``total``: offloaded state is not), in host RAM (``host``: offloaded state, host
    gradients, the ``"nvme"`` pool and ``HOST_PROCESS_BYTES``) and on disk (``disk``)."""

    pipeline_rank: int
    model_state_bytes: dict[str, int]
    activation_bytes: int
    buffer_bytes: int
    total: int
    host: int = 0
    disk: int = 0


@dataclass(frozen=True)
class LayoutPlan:
    """One layout's predictions (per GPU: the fullest one)."""

    layout: Layout
    model_state_bytes: dict[str, int]  # of the rank with the most memory, the strategy's keys
    activation_bytes: int
    buffer_bytes: int
    memory_per_gpu_bytes: int
    fits: bool
    time: StepTime
    tokens_per_second: float
    mfu: float
    host_bytes_per_gpu: int = 0  # host RAM of the rank with the most (HOST_PROCESS_BYTES included)
    disk_bytes_per_gpu: int = 0
    ranks_per_node: int = 1
    limits: tuple[str, ...] = ()  # why it does not fit: each limit exceeded, in words

    @property
    def step_seconds(self) -> float:
        return self.time.total

    @property
    def host_bytes_per_node(self) -> int:
        return self.host_bytes_per_gpu * self.ranks_per_node

    @property
    def disk_bytes_per_node(self) -> int:
        return self.disk_bytes_per_gpu * self.ranks_per_node

    def to_json(self, precision: str) -> dict[str, Any]:
        """The object ``lightning-megatron plan --json`` prints for this layout."""
        return {**self.layout.strategy_arguments(), "accumulate_grad_batches": self.layout.accumulate_grad_batches,
                "precision": precision, "model_state_bytes": dict(self.model_state_bytes),
                "activation_bytes": self.activation_bytes, "buffer_bytes": self.buffer_bytes,
                "memory_per_gpu_bytes": self.memory_per_gpu_bytes, "host_bytes_per_gpu": self.host_bytes_per_gpu,
                "host_bytes_per_node": self.host_bytes_per_node, "disk_bytes_per_gpu": self.disk_bytes_per_gpu,
                "disk_bytes_per_node": self.disk_bytes_per_node, "fits": self.fits, "limits": list(self.limits),
                "step_seconds": self.step_seconds, "tokens_per_second": self.tokens_per_second, "mfu": self.mfu,
                "step_time_parts": self.time.parts()}


@dataclass
class PlanResult:
    """Every evaluated layout (ranked: fitting ones by tokens/s, then the rest by memory) and those refused."""

    plans: list[LayoutPlan]
    refused: dict[str, str] = field(default_factory=dict)  # why sizes were skipped: a sample message per reason

    @property
    def fitting(self) -> list[LayoutPlan]:
        return [p for p in self.plans if p.fits]

    @property
    def best(self) -> Optional[LayoutPlan]:
        fitting = self.fitting
        return fitting[0] if fitting else None

    @property
    def nearest(self) -> Optional[LayoutPlan]:
        """The layout needing the least memory per GPU (what comes closest to fitting)."""
        return min(self.plans, key=lambda p: p.memory_per_gpu_bytes) if self.plans else None


class Planner:
    """Layouts of ``make_module()`` running ``workload`` on ``world_size`` GPUs of ``hardware``.

    ``make_module``: returns a new LightningModule (``configure_model`` not called: the planner builds it on the
    meta device). ``fixed``: layout fields to keep (e.g. ``{"zero_stage": 1}``); the others are searched.
    ``fixed["overlap_param_gather"]`` applies to the ZeRO 1/2 layouts (the others have no parameter gather).
    """

    def __init__(self, make_module: Callable[[], nn.Module], workload: Workload, hardware: Hardware, *,
                 world_size: int, fixed: Optional[dict[str, Any]] = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be a positive number of GPUs, got {world_size}.")
        unknown = sorted(set(fixed or {}) - set(SEARCHED) - {"pipeline_schedule", "pipeline_layers_per_stage",
                                                                  "data_parallel_size", "accumulate_grad_batches",
                                                                  "overlap_param_gather"})
        if unknown:
            raise ValueError(f"fixed names {unknown} are not layout fields; use some of {', '.join(SEARCHED)}.")
        if workload.fp8:
            hardware.fp8_flops()  # a GPU without FP8 says so before any layout is evaluated
        self.make_module, self.workload, self.hardware = make_module, workload, hardware
        self.world_size, self.fixed = world_size, dict(fixed or {})
        self.module = make_module()  # not configured: its config, validation and optimizer recipe
        self.shape = ModelShape.of(self.module)
        self.state_bytes_per_element, self.optimizer_name = optimizer_state_bytes_per_element(self.module)
        self._inventories: dict[tuple[int, int, Optional[int]], Inventory | ValueError] = {}
        self._model_states: dict[tuple, dict[str, int]] = {}

    # ------------------------------------------------------------------ model state
    def inventory(self, tensor_parallel_size: int, expert_parallel_size: int = 1,
                  expert_tensor_parallel_size: Optional[int] = None) -> Inventory:
        whole = expert_tensor_parallel_size is not None and expert_tensor_parallel_size < tensor_parallel_size
        key = (tensor_parallel_size, expert_parallel_size, 1 if whole else None)
        if key not in self._inventories:
            try:
                self._inventories[key] = Inventory.build(
                    self.make_module, tensor_parallel_size=tensor_parallel_size,
                    expert_parallel_size=expert_parallel_size,
                    pad_vocab_to_multiple_of=self.workload.pad_vocab_to_multiple_of, expert_tensor_parallel_size=key[2])
            except ValueError as error:  # what the strategy's parallelize raises at setup: the same sizes again fail
                self._inventories[key] = error
        inventory = self._inventories[key]
        if isinstance(inventory, ValueError):
            raise inventory
        return inventory

    def model_state_bytes(self, layout: Layout, *, pipeline_rank: int = 0, data_rank: int = 0,
                          context_rank: int = 0) -> dict[str, int]:
        """What ``strategy.model_state_bytes`` reports on that rank after the first step."""
        key = (layout.tensor_parallel_size, layout.expert_parallel_size, layout.expert_tensor_parallel,
               layout.pipeline_parallel_size,
               layout.virtual_pipeline_size, layout.pipeline_layers_per_stage, layout.data_parallel_size,
               layout.context_parallel_size, layout.zero_stage, layout.offload_optimizer != "none", pipeline_rank,
               data_rank, context_rank)
        if key not in self._model_states:  # recomputation, sequence parallelism and micro-batches do not change it
            self._model_states[key] = self._count_model_state(layout, pipeline_rank, data_rank, context_rank)
        return self._model_states[key]

    def _rank_parameters(self, layout: Layout, pipeline_rank: int) -> list:
        inventory = self.inventory(layout.tensor_parallel_size, layout.expert_parallel_size,
                                   layout.expert_tensor_parallel)
        return inventory.rank_parameters(
            pipeline_parallel_size=layout.pipeline_parallel_size, virtual_pipeline_size=layout.virtual_pipeline_size,
            pipeline_layers_per_stage=layout.pipeline_layers_per_stage, pipeline_rank=pipeline_rank)

    def quantized_base_bytes(self, layout: Layout, pipeline_rank: int = 0) -> int:
        """Bytes of that rank's QLoRA base (NF4, ``peft.nf4``): part of its parameters, on the device whatever the
        offload tier."""
        return sum(p.entry.stored_bytes or 0 for p in self._rank_parameters(layout, pipeline_rank))

    def _count_model_state(self, layout: Layout, pipeline_rank: int, data_rank: int, context_rank: int) -> dict[str, int]:
        parameters = self._rank_parameters(layout, pipeline_rank)
        return rank_model_state_bytes(parameters, layout, self.workload, state_bytes_per_element=self.state_bytes_per_element,
                                      data_rank=data_rank, context_rank=context_rank)

    # ------------------------------------------------------------------ one layout
    def rank_memory(self, layout: Layout) -> list[RankMemory]:
        """Each pipeline rank's predicted memory (its replica rank 0, which holds the most: ZeRO's padding and
        FSDP's shorter chunks fall on the last ranks)."""
        ranks = []
        for pipeline_rank in range(layout.pipeline_parallel_size):
            state = self.model_state_bytes(layout, pipeline_rank=pipeline_rank)
            activations = activation_bytes(self.shape, layout, self.workload, pipeline_rank=pipeline_rank)
            buffers = buffer_bytes(self.shape, layout, self.workload, state)
            where = placement(state, layout, state_bytes_per_element=self.state_bytes_per_element,
                              buffer_mb=self.workload.offload_buffer_mb,
                              gradient_bytes_per_element=self.workload.parameter_bytes,
                              resident=self.quantized_base_bytes(layout, pipeline_rank))
            ranks.append(RankMemory(pipeline_rank, state, activations, buffers, where.device + activations + buffers,
                                    where.host + HOST_PROCESS_BYTES, where.disk))
        return ranks

    def evaluate(self, layout: Layout) -> LayoutPlan:
        """Predictions for one layout (``check_layout`` it first)."""
        workload, hardware = self.workload, self.hardware
        ranks = self.rank_memory(layout)
        fullest = max(ranks, key=lambda rank: rank.total)
        host, disk = max(rank.host for rank in ranks), max(rank.disk for rank in ranks)
        per_node = min(self.world_size, hardware.gpus_per_node)
        time = step_time(self.shape, layout, workload, hardware, self.model_state_bytes(layout),
                         state_bytes_per_element=self.state_bytes_per_element)
        tokens = workload.global_batch_size * workload.seq_length
        model_flops = flops_per_batch(self.shape.config, workload.global_batch_size, workload.seq_length)
        mfu = model_flops / (time.total * self.world_size * hardware.peak(workload.sixteen_bit_compute))
        limits = _limits(fullest.total, host * per_node, disk * per_node, hardware)
        return LayoutPlan(layout, fullest.model_state_bytes, fullest.activation_bytes, fullest.buffer_bytes,
                          fullest.total, not limits, time, tokens / time.total, mfu, host, disk, per_node, limits)

    # ------------------------------------------------------------------ the search
    def candidates(self) -> Iterator[dict[str, Any]]:
        """Every combination of the searched fields (those in ``fixed`` kept), as ``Layout`` arguments, unchecked."""
        world, shape, fixed = self.world_size, self.shape, self.fixed
        batch, seq = self.workload.global_batch_size, self.workload.seq_length

        def choices(name: str, values: Iterable) -> list:
            return [fixed[name]] if name in fixed else list(values)

        node = self.hardware.gpus_per_node
        for tp in choices("tensor_parallel_size", (d for d in _divisors(world) if d <= node)):
            # Context parallelism is for long sequences: searched while each rank keeps >= MIN_CONTEXT_TOKENS of one.
            contexts = (d for d in _divisors(world // tp) if _pow2(d) and (d == 1 or seq // d >= MIN_CONTEXT_TOKENS))
            for cp in choices("context_parallel_size", contexts):
                for pp in choices("pipeline_parallel_size", (d for d in _divisors(world // (tp * cp))
                                                             if d <= shape.num_layers)):
                    dp = world // (tp * cp * pp)
                    if tp * cp * pp * dp != world or fixed.get("data_parallel_size", dp) != dp:
                        continue
                    vpps = [v for v in _divisors(shape.num_layers // pp) if v <= 8] if pp > 1 else [1]
                    for vpp in choices("virtual_pipeline_size", vpps):
                        # Experts split over tp (etp None), or whole on each tp rank (etp 1: ep spans tp x dp).
                        etps = (None, 1) if shape.num_experts and tp > 1 else (None,)
                        for etp in choices("expert_tensor_parallel_size", etps):
                            slots = dp * tp if etp == 1 else dp
                            eps = ([e for e in _divisors(slots) if shape.num_experts % e == 0 and (etp is None or e > 1)]
                                   if shape.num_experts else [1])
                            for ep in choices("expert_parallel_size", eps):
                                yield from self._with_options(tp, pp, vpp, cp, dp, ep, batch, choices, etp)

    def _with_options(self, tp, pp, vpp, cp, dp, ep, batch, choices, etp=None) -> Iterator[dict[str, Any]]:
        if batch % dp:  # one candidate, for check_layout to say why
            yield dict(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                       virtual_pipeline_size=vpp, context_parallel_size=cp, expert_parallel_size=ep,
                       expert_tensor_parallel_size=etp)
            return
        per_rank = batch // dp
        micro = [m for m in (1, 2, 4, 8, 16) if per_rank % m == 0 and (pp == 1 or per_rank // m >= pp)]
        if "accumulate_grad_batches" in self.fixed:  # the Trainer's: it fixes the batch of a pipeline-free pass
            accumulate = self.fixed["accumulate_grad_batches"]
            if pp == 1:
                micro = [per_rank // accumulate] if per_rank % accumulate == 0 else []
            elif accumulate != 1:
                return
        schedule = self.fixed.get("pipeline_schedule", "interleaved_1f1b" if vpp > 1 else "1f1b")
        tiers = {name: [tier_of(self.fixed[name], option=name)] if name in self.fixed else list(searched)
                 for name, searched in (("offload_optimizer", TIERS), ("offload_parameters", PARAMETER_TIERS))}
        for sp, zero, optimizer_tier, parameter_tier, recompute, mbs in itertools.product(
                choices("sequence_parallel", (False, True) if tp > 1 else (False,)), choices("zero_stage", range(4)),
                tiers["offload_optimizer"], tiers["offload_parameters"],
                choices("activation_checkpointing", RECOMPUTE_MODES),
                micro if pp == 1 and "accumulate_grad_batches" in self.fixed else choices("micro_batch_size", micro)):
            # The optimizer's tiers are ZeRO 0-2's, the parameters' ZeRO-3's: searched where they apply (a fixed one
            # that does not apply is left to check_layout, which says why).
            if (zero == 3 and optimizer_tier != "none" and "offload_optimizer" not in self.fixed) or (
                    zero != 3 and parameter_tier != "none" and "offload_parameters" not in self.fixed):
                continue
            yield dict(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp, sequence_parallel=sp,
                       zero_stage=zero, virtual_pipeline_size=vpp, context_parallel_size=cp, expert_parallel_size=ep,
                       expert_tensor_parallel_size=etp,
                       pipeline_schedule=schedule, micro_batch_size=mbs, activation_checkpointing=recompute,
                       offload_optimizer=optimizer_tier, offload_parameters=parameter_tier,
                       pipeline_layers_per_stage=self.fixed.get("pipeline_layers_per_stage"),
                       overlap_param_gather=self.fixed.get("overlap_param_gather", False) and zero in (1, 2),
                       accumulate_grad_batches=1 if pp > 1 else per_rank // mbs)

    def plan(self) -> PlanResult:
        """Evaluate every valid layout; fitting ones first, fastest first; then the rest, smallest first."""
        plans, refused = [], {}
        for fields in self.candidates():
            try:
                layout = Layout(**fields)  # ParallelConfig's checks
                check_layout(layout, self.workload, self.module, self.shape.num_layers)
                plans.append(self.evaluate(layout))  # its shards are built as parallelize builds them, or refused
            except ValueError as error:
                refused.setdefault(str(error)[:60], str(error))  # one message per kind of refusal
                continue
        plans.sort(key=lambda p: (not p.fits, -p.tokens_per_second if p.fits else p.memory_per_gpu_bytes))
        return PlanResult(plans, refused)

    def with_layout(self, **changes: Any) -> Layout:
        """A layout of this world from a few sizes (``data_parallel_size`` taking what is left)."""
        model_parallel = (changes.get("tensor_parallel_size", 1) * changes.get("pipeline_parallel_size", 1)
                          * changes.get("context_parallel_size", 1))
        return Layout(**{"data_parallel_size": self.world_size // model_parallel, **changes})


def _limits(gpu: int, host_per_node: int, disk_per_node: int, hardware: Hardware) -> tuple[str, ...]:
    """The limits a layout's bytes exceed, in words (empty: it fits)."""
    limits = []
    if gpu > hardware.memory_bytes:
        limits.append(f"GPU memory: {gpu / GIB:.1f} of {hardware.memory_bytes / GIB:.1f} GiB")
    if host_per_node > hardware.host_memory_bytes:
        limits.append(f"host memory: {host_per_node / GIB:.1f} GiB per node of {hardware.host_memory_bytes / GIB:.1f} "
                      f"GiB (--host-memory)")
    if disk_per_node > hardware.disk_bytes:
        limits.append(f"disk: {disk_per_node / GIB:.1f} GiB per node of {hardware.disk_bytes / GIB:.1f} GiB (--disk)")
    return tuple(limits)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pow2(n: int) -> bool:
    return n & (n - 1) == 0
