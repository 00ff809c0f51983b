"""One rank's training step, simulated: the strategy's own set-up and step, on fake tensors in a fake world.

:func:`simulate_rank` does for one rank what ``Megatron3DStrategy.setup`` and Lightning's loop do in a real job,
with the same functions: ``preparation.prepare_model`` (the tp swaps, recomputation, experts, context
parallelism, the pipeline split, ZeRO-3's sharding, the materialisation), Lightning's precision plugin,
``preparation.start_pipeline``, the model's ``configure_optimizers`` and ``step.StepDriver`` (the gradient
buckets and their reduction, the fp32 main parameters, the non-finite check, the global-norm clip, the optimizer).
Each optimizer step runs as Lightning's automatic optimisation runs it: ``accumulate_grad_batches`` loader batches,
every one but the last under ``block_backward_sync`` with its backward, the last one inside the optimizer's
closure; then the clip, the optimizer and the driver's ``after_step``. The checkpoint's shard plan (the entries
this rank would write: its parameters, main parameters and optimizer state) is built after the last step.

Two steps run: a warm-up step of one loader batch, which makes the optimizer state (and, pipelined, the schedule,
whose first step infers the stages' shapes), then the measured step, the config's whole batch: a step of the steady
state, whose peak every later step repeats. See ``fake_world`` for what is fake and how host reads are answered.
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_megatron.checkpoint.sharded import entry_bytes
from lightning_megatron.checkpoint.training_state import RankTraining
from lightning_megatron.models.rotary import forget_tables
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.initialize import uninitialised_build
from lightning_megatron.parallel.random import TensorParallelRNG
from lightning_megatron.parallel.state import ParallelState
from lightning_megatron.plan.inventory import fake_world
from lightning_megatron.plan.probes import LiveStorages
from lightning_megatron.simulate.fake_world import KnownValues, StageMailbox, fake_tensors, gpu_attention
from lightning_megatron.simulate.records import (CollectiveLog, Observed, SavedForBackward, group_names,
                                                 peak_by_category)
from lightning_megatron.strategy.options import StrategyOptions
from lightning_megatron.strategy.preparation import prepare_model, start_pipeline
from lightning_megatron.strategy.step import StepDriver
from lightning_megatron.strategy.summary import model_state_sizes

SEED = 1234
CATEGORIES = ("parameters", "gradients", "main_parameters", "optimizer_state")
#: The precisions a simulation runs (Lightning's precision plugins, as the Trainer would make them).
PRECISIONS = ("32-true", "bf16-true", "16-true")


@dataclass(frozen=True)
class Job:
    """What a config trains, as a simulation needs it. ``loader_batch_size``: the data module's ``global_batch_size``
    (sequences in one loader batch over all data-parallel ranks); an optimizer step takes
    ``accumulate_grad_batches`` of them."""

    make_module: Callable[[], nn.Module]
    options: StrategyOptions
    world_size: int
    precision: str
    loader_batch_size: int
    seq_length: int
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    device: torch.device = torch.device("cpu")

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"lightning-megatron simulate runs precision {', '.join(map(repr, PRECISIONS))}, not "
                             f"{self.precision!r} (Lightning's mixed-precision plugins need its Trainer around the "
                             f"optimizer); simulate the layout at 'bf16-true', which holds the same model state.")
        if self.options.zero_stage == 3:
            raise ValueError("lightning-megatron simulate does not run zero_stage=3 yet: FSDP2 swaps parameters for "
                             "new ones, which torch refuses for fake tensors; `lightning-megatron plan "
                             "--as-configured` predicts its memory.")

    @property
    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig.for_world(self.world_size, **self.options.requested)

    def rows_per_rank(self) -> int:
        """Sequences in this rank's loader batch (the data module splits the loader batch over data parallelism)."""
        dp = self.parallel_config.data_parallel_size
        if self.loader_batch_size % dp:
            raise ValueError(f"The data module's global_batch_size={self.loader_batch_size} does not split over "
                             f"data_parallel_size={dp}; make it a multiple of {dp}.")
        return self.loader_batch_size // dp


@dataclass
class RankResult:
    """One simulated rank: its coordinates in the layout, its peak and what holds it, its model state as the strategy
    reports it, its collectives (per optimizer step), its checkpoint shard plan and the simulation's own figures."""

    rank: int
    coordinates: dict[str, int]
    simulated_peak_bytes: int
    peak_by_category: dict[str, int]
    largest_at_peak: dict[str, int]  # the activations and temporaries at the peak, by the op that allocated them
    model_state_bytes: dict[str, int]
    collectives: list[dict]
    checkpoint_entries: int
    checkpoint_bytes: int
    host_reads: int
    stand_ins: int
    seconds: float
    planned: dict[str, Any] = field(default_factory=dict)  # filled by report.compare_with_plan


def _precision_plugin(precision: str):
    from lightning.pytorch.plugins.precision import HalfPrecision, Precision

    return HalfPrecision(precision) if precision in ("bf16-true", "16-true") else Precision()


def _convert_module(plugin, module: nn.Module) -> None:
    """The precision plugin's ``convert_module``: ``HalfPrecision`` casts the parameters and buffers to its dtype
    (``module.to(dtype)``), done here by assigning ``.data``: ``nn.Module.to`` swaps fake parameters for new ones,
    which torch refuses for a tensor something holds a weak reference to (the fake tensors' own bookkeeping)."""
    dtype = getattr(plugin, "_desired_input_dtype", None)
    if dtype is None:
        plugin.convert_module(module)
        return
    with torch.no_grad():
        for tensor in (*module.parameters(), *module.buffers()):
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype)


def _coordinates(state: ParallelState) -> dict[str, int]:
    config = state.config
    coordinates = {"pp": state.pipeline_parallel_rank, "dp": state.data_parallel_rank,
                   "tp": state.tensor_parallel_rank}
    if config.context_parallel_size > 1:
        coordinates["cp"] = state.context_parallel_rank
    if config.expert_parallel_size > 1:
        coordinates["ep"] = state.expert_parallel_rank
    return coordinates


def _batch(job: Job, rows: int) -> dict[str, Tensor]:
    """A loader batch of ``rows`` sequences (token ids: their values do not change what a step allocates)."""
    return {"input_ids": torch.randint(0, 2, (rows, job.seq_length), device=job.device),
            "labels": torch.randint(0, 2, (rows, job.seq_length), device=job.device)}


class _LoopState:
    """The little of Lightning's Trainer that the strategy's step reads."""

    def __init__(self, accumulate_grad_batches: int) -> None:
        self.accumulate_grad_batches = accumulate_grad_batches
        self.global_step = 0
        self.current_epoch = 0


def simulate_rank(job: Job, rank: int, mailbox: StageMailbox) -> RankResult:
    """Rank ``rank`` of ``job``: set-up, a warm-up step and the measured optimizer step; see the module docstring. ``mailbox``: shared by the ranks one simulation runs (pipeline stages in order)."""
    started = time.perf_counter()
    options, device = job.options, job.device
    module = job.make_module()
    if not hasattr(module, "model") or not hasattr(module, "pipeline_blocks"):
        raise ValueError(f"lightning-megatron simulate trains lightning_megatron.models.GPT and its subclasses "
                         f"(token batches of input_ids and labels), not {type(module).__name__}.")
    with fake_world(job.world_size, rank):
        state = ParallelState.create(job.parallel_config, device)
        validate = getattr(module, "validate_parallel_config", None)
        if validate is not None:
            validate(state.config)
        with torch.device("meta"), uninitialised_build():
            module.configure_model()
        log = CollectiveLog(group_names(state))
        values = KnownValues()
        live = LiveStorages()
        attention = gpu_attention() if device.type == "cpu" else contextlib.nullcontext()
        with warnings.catch_warnings(), mailbox.delivering(), fake_tensors(), attention, Observed(values, log, live):
            warnings.simplefilter("ignore")  # Lightning's "self.log() without a Trainer", once per micro-batch
            forget_tables()  # the rotary tables an earlier rank's simulation cached
            rng = TensorParallelRNG(SEED, state.tensor_parallel_rank, device)
            prepared = prepare_model(module, state, options, rng=rng, seed=SEED, device=device,
                                     precision=job.precision)
            plugin = _precision_plugin(job.precision)
            if prepared.zero3 is None:
                _convert_module(plugin, module)  # already on the device: materialised there
            driver = StepDriver(options)
            driver.bind(plugin, device, options)
            loop = _LoopState(job.accumulate_grad_batches)
            if prepared.split is not None:
                driver.pipeline = start_pipeline(
                    prepared.split, state, options, device=device, recorder=None,
                    before_backward=lambda count, tokens: driver.before_pipeline_backward(
                        count, tokens, loop.accumulate_grad_batches))
            configured = module.configure_optimizers()
            optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
            driver.start(module, state, [optimizer], options, zero3=prepared.zero3, device=device,
                         ranks_sharing_host=1)
            module.train()
            # The warm-up step makes the optimizer state and, pipelined, the schedule of the measured step's
            # micro-batch count (whose first step infers the stages' shapes): one loader batch, not accumulated.
            batch = _batch(job, job.rows_per_rank())
            loop.accumulate_grad_batches = 1
            _optimizer_step(module, optimizer, driver, plugin, batch, loop, job.gradient_clip_val)
            loop.global_step, loop.accumulate_grad_batches = 1, job.accumulate_grad_batches
            gc.collect()  # what the warm-up left in reference cycles dies before the measured step
            measured_from = len(live.events)
            log.totals.clear()
            gradients: list[Tensor] = []  # before the step ends: without data parallelism it drops them
            with SavedForBackward(live) as saved:
                _optimizer_step(module, optimizer, driver, plugin, batch, loop, job.gradient_clip_val, gradients)
            training = RankTraining(module, [optimizer], state, driver.main_params)
            entries = {**training.model_entries(), **training.state_entries()}  # what this rank's checkpoint holds
            categories = _category_tensors(module, optimizer, driver, gradients)
            peak, split, largest = peak_by_category(live, categories, saved=saved.ids, start=measured_from)
            model_state = model_state_sizes(module, optimizer, driver.gradients, prepared.zero3)
            driver.remove()
        return RankResult(rank, _coordinates(state), peak, split, largest, model_state, log.rows(), len(entries),
                          entry_bytes(entries), values.host_reads, values.stand_ins, time.perf_counter() - started)


def _optimizer_step(module, optimizer, driver: StepDriver, plugin, batch, loop: _LoopState,
                    clip: Optional[float], gradients: Optional[list] = None) -> None:
    """One optimizer step as Lightning's automatic optimisation runs it (see the module docstring); ``gradients``
    receives the parameters' ``.grad`` as the optimizer saw them."""
    accumulation = loop.accumulate_grad_batches

    def micro_batch(index: int) -> Tensor:
        driver.start_micro_batch()
        with plugin.train_step_context():
            output = module.training_step(batch, index)
        driver.record(output)
        if driver.pipeline is None:  # under pipelining the schedule ran every backward
            closure_loss = output["loss"] / accumulation  # Lightning's normalisation, then the strategy's factor
            factor = driver.backward_factor(accumulation)
            (closure_loss * factor.to(torch.promote_types(closure_loss.dtype, torch.float32))).backward()
        return output["loss"]

    optimizer.zero_grad(set_to_none=True)
    for index in range(accumulation - 1):
        with driver.block_backward_sync():
            micro_batch(index)

    def run(closure: Callable[[], Any]) -> Any:
        result = closure()
        if clip:
            plugin.clip_gradients(optimizer, clip)
        optimizer.step()
        if gradients is not None:
            gradients.extend(p.grad for p in module.parameters() if p.grad is not None)
        return result

    driver.step(optimizer, lambda: micro_batch(accumulation - 1), run, loop)


def _category_tensors(module: nn.Module, optimizer, driver: StepDriver, gradients: list[Tensor]
                      ) -> dict[str, list[Tensor]]:
    """The tensors of each model-state category, as the strategy's ``model_state_sizes`` counts them
    (``gradients``: the parameters' ``.grad`` during the step)."""
    params = list(dict.fromkeys(module.parameters()))
    grads = list(gradients)
    sync = driver.gradients.sync if driver.gradients is not None else None
    for bucket in getattr(sync, "buckets", ()):
        grads += [t for t in (getattr(bucket, "buffer", None), getattr(bucket, "shard", None)) if t is not None]
    main = [piece for _, piece in driver.main_params.pieces] if driver.main_params is not None else []
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor) and v.dim() > 0]
    return {"parameters": params, "gradients": grads, "main_parameters": main, "optimizer_state": state}
