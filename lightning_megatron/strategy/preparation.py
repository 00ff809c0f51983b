"""The steps that turn a LightningModule into this rank's part of the parallel model.

``Megatron3DStrategy.setup`` composes them once per module, in this order (each step relies
on the one before):

1. ``parallelize(module, tensor_parallel_plan_of(module, ...), ...)``: swap Linear/Embedding for the
   column/row/vocab-parallel layers; their parameters are still on the meta device. The plan is the model's
   ``tensor_parallel_plan()`` with entries for its LoRA adapters (``peft.plan``; attached by ``configure_model``,
   before this step, they are split with the layers they adapt and ride along the swaps). ``tp_comm_overlap``:
   their sequence-parallel collectives overlap their GEMMs (``tensor_parallel.overlap``).
   :func:`~lightning_megatron.tensor_parallel.fp8_plan.convert_to_fp8` (``fp8``): those layers' GEMMs in FP8, their
   scales reduced over the groups that split their tensors; right after the swaps (the layers it converts), before
   the pipeline split (every rank checks every layer).
2. :func:`compile_blocks` (``compile``): ``torch.compile`` of each transformer layer's forward (regional
   compilation, ``transforms.regional_compile``). After the swaps, before recomputation: the checkpoint then
   wraps the compiled forward (dynamo cannot compile through our checkpoint, which replays the per-rank
   dropout stream in Python), and before ZeRO-3's ``fully_shard`` and the pipeline split (FSDP's hooks stay
   eager around it; every rank checks every layer).
   :func:`apply_recompute`: wrap the transformer layers for activation recomputation. After the
   swaps (a swapped layer would lose the wrapper), before the pipeline split (so that every
   rank checks every layer and fails alike).
3. :func:`apply_expert_parallel` (``expert_parallel_size > 1``): keep this rank's experts of every
   MoE layer and dispatch tokens to the others with all-to-alls; after the swaps (the experts'
   tensor-parallel layers are the ones tagged), before the split (every rank checks every layer).
   :func:`wire_auxiliary_losses`: the MoE statistics are summed over the model-parallel ranks.
   :func:`prepare_context_parallel` (``context_parallel_size > 1``): ring (or all-gather) attention over the
   context-parallel group in every attention core, and the batch splitter the strategy applies to each
   batch; before the split, so that every rank checks every layer and the model's declaration.
4. :func:`split_pipeline`: delete the layers, embedding and head this rank's stages do not run.
   ``quantize_bases`` (QLoRA, ``LoRAConfig.quantize_base``): each remaining adapted layer's frozen weight becomes
   this rank's part of torchao's NF4 of the whole weight, which ``hold_global_weights`` kept from before step 1
   (``peft.nf4``: the same base at every layout).
5. :func:`shard_zero3` (``zero_stage=3``, its shards in host memory under ``offload_parameters="cpu"``) or
   ``initialize_parameters``: materialise only the local shards, with the layout-invariant initial values.
6. :func:`start_pipeline` (``pp > 1``): the schedule behind the root model's ``loss()``; MoE layers
   then attach their auxiliary losses to their outputs (a stage may not hold the loss).

The model declares *what* can be split (``tensor_parallel_plan()``, ``pipeline_blocks()``);
these functions decide *how*, from the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_megatron.context_parallel.apply import BatchSplitter, apply_context_parallel
from lightning_megatron.expert_parallel.apply import auxiliary_losses, prepare_experts
from lightning_megatron.offload.settings import OffloadSettings
from lightning_megatron.optim.zero3 import ZERO3_PRECISIONS, ZeRO3, apply_zero3
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.strategy.diagnostics import warn_if_replicated
from lightning_megatron.strategy.options import StrategyOptions
from lightning_megatron.parallel.initialize import initialize_parameters
from lightning_megatron.parallel.random import TensorParallelRNG
from lightning_megatron.parallel.state import ParallelState
from lightning_megatron.peft.nf4 import check_nf4_options, hold_global_weights, quantize_bases
from lightning_megatron.peft.plan import tensor_parallel_plan_of
from lightning_megatron.pipeline.blocks import PipelineBlocks
from lightning_megatron.pipeline.inference import PipelineInference
from lightning_megatron.pipeline.layout import SCHEDULE_SPECS, PipelineLayout
from lightning_megatron.pipeline.runner import PipelineRunner
from lightning_megatron.pipeline.stage import StageModule, split_for_pipeline
from lightning_megatron.pipeline.timeline import TimelineRecorder
from lightning_megatron.tensor_parallel.fp8_plan import convert_to_fp8
from lightning_megatron.tensor_parallel.overlap import overlapped_linear_for
from lightning_megatron.tensor_parallel.plan import parallelize
from lightning_megatron.transforms.recompute import apply_activation_checkpointing
from lightning_megatron.transforms.regional_compile import check_compile_layout, compile_layers

# The fp32 shards are the main parameters; FSDP gathers them in the compute dtype and reduces in fp32.
COMPUTE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}


def _blocks(module: nn.Module, needed_for: str) -> PipelineBlocks:
    if not hasattr(module, "pipeline_blocks"):
        raise TypeError(f"{needed_for} needs {type(module).__name__} to define pipeline_blocks(), which names its "
                        f"transformer layers (see lightning_megatron.pipeline.PipelineBlocks).")
    return module.pipeline_blocks()


def _layers_pattern(module: nn.Module, needed_for: str) -> str:
    """The plan pattern (``model.blocks.*``) of the ``pipeline_blocks()`` layers, relative to ``module``."""
    blocks = _blocks(module, needed_for)
    return f"{blocks.root}.{blocks.layers}.*" if blocks.root else f"{blocks.layers}.*"


def apply_recompute(module: nn.Module, mode: str, rng: Optional[TensorParallelRNG]) -> None:
    """Recompute each ``pipeline_blocks()`` layer (``"full"``) or its attention core (``"selective"``)."""
    if mode == "none":
        return
    pattern = _layers_pattern(module, f"activation_checkpointing={mode!r}")
    apply_activation_checkpointing(module, mode=mode, layer_pattern=pattern, rng=rng)


def compile_blocks(module: nn.Module, options: Optional[dict], config: ParallelConfig,
                   activation_checkpointing: str, pipeline_schedule: str = "1f1b") -> None:
    """Compile each ``pipeline_blocks()`` layer's forward with ``torch.compile(**options)`` (``None``: off)."""
    if options is None:
        return
    check_compile_layout(config, activation_checkpointing, pipeline_schedule)
    compile_layers(module, _layers_pattern(module, "compile"), options)


def prepare_context_parallel(module: nn.Module, state: ParallelState, attention: str) -> Optional[BatchSplitter]:
    """Split attention over the sequence (``context_parallel_size > 1``); returns what cuts each batch."""
    if state.config.context_parallel_size == 1:
        return None
    splitter = BatchSplitter(module, state)  # first: a module without the declaration is told before anything
    apply_context_parallel(module, state, attention)
    return splitter


@dataclass
class PreparedModel:
    """What the strategy that split a module leaves on it (``module._megatron_3d_prepared``) for the next
    ``fit``/``validate``/``test``, which may come with another strategy object: this rank's pipeline split
    (to start a runner on), the ZeRO-3 sharding, the dropout stream the layers fork to and what cuts each batch
    under context parallelism."""

    split: Optional["PipelineSplit"]  # None without pipelining
    zero3: Optional[ZeRO3]  # under zero_stage=3
    rng: Optional[TensorParallelRNG]
    batch_splitter: Optional[BatchSplitter] = None  # under context parallelism


@dataclass
class PipelineSplit:
    """This rank's stages: their modules (in schedule order), the layout and the model's blocks."""

    stage_modules: list[StageModule]
    local_stages: list[int]
    layout: PipelineLayout
    root: nn.Module


def split_pipeline(module: nn.Module, state: ParallelState, schedule: str = "1f1b") -> Optional[PipelineSplit]:
    """Keep only this rank's pipeline stages of the model (before anything is materialised); the schedule decides
    which stages a rank runs (``PipelineLayout``)."""
    config = state.config
    if config.pipeline_parallel_size == 1:
        return None
    blocks = _blocks(module, f"pipeline_parallel_size={config.pipeline_parallel_size}")
    root = blocks.root_of(module)
    layout = PipelineLayout(
        num_layers=len(root.get_submodule(blocks.layers)),
        pipeline_parallel_size=config.pipeline_parallel_size,
        virtual_pipeline_size=config.virtual_pipeline_size,
        layers_per_stage=config.pipeline_layers_per_stage,
        schedule=schedule,
    )
    local_stages = layout.stages_of_rank(state.pipeline_parallel_rank)
    stage_modules = split_for_pipeline(root, blocks, layout.stage_layers(), local_stages)
    return PipelineSplit(stage_modules, local_stages, layout, root)


def start_pipeline(split: PipelineSplit, state: ParallelState, options: StrategyOptions, *, device: torch.device,
                   recorder: Optional[TimelineRecorder], before_backward: Callable[[int, torch.Tensor], None]
                   ) -> PipelineRunner:
    """The schedule behind the root model's ``loss()``; its ``forward()`` now says why it cannot run alone."""
    layout, root, schedule = split.layout, split.root, options.pipeline_schedule
    if SCHEDULE_SPECS[schedule].placement != SCHEDULE_SPECS[layout.schedule].placement:
        raise ValueError(
            f"This model was split for pipeline_schedule={layout.schedule!r}, which places the stages on the ranks "
            f"differently from {schedule!r}. Build a new module (or load a checkpoint into one) for {schedule!r}.")
    runner = PipelineRunner(split.stage_modules, split.local_stages, num_stages=layout.num_stages,
                            group=state.pipeline_parallel_group, device=device, schedule=schedule,
                            micro_batch_size=options.micro_batch_size, root=root, recorder=recorder,
                            before_backward=before_backward, overlap_p2p_comm=options.overlap_p2p_comm)
    root.loss = runner.loss  # the model's loss() now runs the schedule
    for aux in auxiliary_losses(root):  # their gradient scaled as the schedule scales the loss sum's
        aux.attach_with(lambda: runner.loss_scale)
    # Generation and predict walk the stages themselves (one batch, shapes that change, a key/value cache).
    root.pipeline_inference = PipelineInference(split.stage_modules, split.local_stages, num_stages=layout.num_stages,
                                                group=state.pipeline_parallel_group, device=device,
                                                schedule=layout.schedule)

    def forward_needs_the_whole_model(*args, **kwargs):
        raise RuntimeError(
            f"Under pipeline_parallel_size={layout.pipeline_parallel_size} each rank holds only some stages of "
            f"{type(root).__name__}, so forward() cannot run on one rank; call the model's loss(...), which "
            f"runs the pipeline schedule, root.pipeline_inference(...) for logits on the last stage, or the "
            f"LightningModule's predict_step / generate, which work at every layout."
        )

    root.forward = forward_needs_the_whole_model
    return runner


def prepare_model(module: nn.Module, state: ParallelState, options: StrategyOptions, *,
                  rng: Optional[TensorParallelRNG], seed: int, device: Union[torch.device, str],
                  precision: str) -> PreparedModel:
    """Steps 1-5 above, in their order, for ``Megatron3DStrategy.setup`` (once per module): this rank's part of the
    model, materialised, as ``options`` say (the "auto" sizes resolved). The pipeline schedule (step 6) is bound to
    the strategy afterwards."""
    sequence_linear = overlapped_linear_for(state.config, options.tp_comm_overlap)  # refused first, on every rank alike
    plan = tensor_parallel_plan_of(module, state.config)
    held = hold_global_weights(module)  # QLoRA: the whole weights, quantised once the layout has cut them
    if held:
        check_nf4_options(fp8=options.fp8_recipe is not None, tp_comm_overlap=options.tp_comm_overlap)
    warn_if_replicated(module, plan, state.config.tensor_parallel_size, state.config.data_parallel_size)
    parallelize(module, plan, state, rng=rng, pad_vocab_to_multiple_of=options.pad_vocab_to_multiple_of,
                sequence_linear=sequence_linear)
    convert_to_fp8(module, options.fp8_recipe, state, options.fp8_exclude)
    compile_blocks(module, options.compile_options, state.config, options.activation_checkpointing,
                   options.pipeline_schedule)
    apply_recompute(module, options.activation_checkpointing, rng)
    prepare_experts(module, state)
    splitter = prepare_context_parallel(module, state, options.context_parallel_attention)
    split = split_pipeline(module, state, options.pipeline_schedule)
    quantize_bases(module, held, device)  # this rank's layers only
    del held
    zero3 = None
    if state.config.zero_stage == 3:
        # Already on the device; no .to(): FSDP would replace the sharded parameters and drop their tags.
        zero3 = shard_zero3(module, state, precision=precision, seed=seed, device=device, offload=options.offload)
    elif any(p.is_meta for p in module.parameters()):
        initialize_parameters(module, seed, device=device, only_meta=True)
    return PreparedModel(split=split, zero3=zero3, rng=rng, batch_splitter=splitter)


def shard_zero3(module: nn.Module, state: ParallelState, *, precision: str, seed: int,
                device: Union[torch.device, str], offload: OffloadSettings = OffloadSettings()) -> ZeRO3:
    """ZeRO-3: FSDP2 over dp, one group per transformer layer; materialises this rank's dp chunks (in host
    memory with ``offload_parameters="cpu"``, where the optimizer then steps; ``"nvme"`` is refused, see
    ``optim.zero3.offload_policy``). The trained parameters' shards are fp32 (the main parameters); frozen ones
    (a LoRA base) keep the 16-bit dtype of ``bf16-true``/``16-true`` (FSDP2 asks one dtype of the trained ones only)."""
    if precision not in ZERO3_PRECISIONS:
        raise ValueError(f"zero_stage=3 supports precision {', '.join(map(repr, ZERO3_PRECISIONS))}, not {precision!r}; "
                         f"use '16-true' for fp16 (dynamic loss scaling by the strategy).")
    blocks = _blocks(module, "zero_stage=3")
    root = blocks.root_of(module)
    other_groups = None
    if state.config.pipeline_parallel_size > 1:  # stages call root.embed/head: no root forward hook
        other_groups = [name for name in (*blocks.first, *blocks.last)
                        if getattr(root, name.split(".")[-1], None) is not None]
    mixed = None
    if precision in COMPUTE_DTYPES:
        mixed = MixedPrecisionPolicy(param_dtype=COMPUTE_DTYPES[precision], reduce_dtype=torch.float32)
    root.to(torch.float32)
    if mixed is not None:  # a frozen base (LoRA) steps nowhere: no fp32 main shards, its 16-bit ones are what is gathered
        for param in root.parameters():
            if not param.requires_grad:
                param.data = param.data.to(mixed.param_dtype)
    zero3 = apply_zero3(root, state, layers_pattern=f"{blocks.layers}.*", other_groups=other_groups,
                        mixed_precision=mixed, offload=offload)
    zero3.initialize(seed, device)
    return zero3
