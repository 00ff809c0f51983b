"""``Megatron3DStrategy``: Megatron-LM's tensor, pipeline and data parallelism in Lightning's Trainer.

The strategy owns the layout (a ``ParallelState`` over a ("pp", "dp", "cp", "tp") DeviceMesh),
applies the model's ``tensor_parallel_plan()``, keeps this rank's pipeline stages of the
model's ``pipeline_blocks()``, materialises only this rank's shards, cuts each batch's sequence
over the context-parallel ranks (the model's ``sequence_inputs()``), reduces gradients over
dp x cp (bucketed, overlapped with backward), and clips by the global norm.
Importing ``lightning_megatron`` registers it as ``"megatron_3d"``.

Under pipeline parallelism the root model's ``loss(*inputs, labels)`` runs the pipeline
schedule (forward and backward of every micro-batch), so the LightningModule's
``training_step`` is unchanged and Lightning's own backward is skipped
(``fit_loop._skip_backward``, as NeMo does).

Lightning contracts honoured here (lightning 2.6): ``is_distributed`` (else ``sync_dist``
and sampler injection switch off), ``distributed_sampler_kwargs`` over dp only,
``reduce`` over dp x cp by default, ``reduce_boolean_decision`` over the world, gradient
clipping replaced by the global-norm version.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Callable, Generator, Mapping, Optional, Sequence, Union

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection, _sync_ddp_if_available
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor
from torch.optim import Optimizer

from lightning_megatron.checkpoint.strategy_hooks import CheckpointHooks
from lightning_megatron.context_parallel import VARIANTS as CONTEXT_PARALLEL_ATTENTION
from lightning_megatron.context_parallel.apply import BatchSplitter
from lightning_megatron.launcher import InPlaceLauncher, SubprocessLauncher, check_directories_shared, die_with_launcher
from lightning_megatron.offload.settings import DEFAULT_BUFFER_MB, OffloadSettings
from lightning_megatron.optim.grad_sync import DEFAULT_BUCKET_SIZE_MB
from lightning_megatron.optim.loss_scaler import DynamicLossScaler
from lightning_megatron.optim.nonfinite import NonFiniteCheck
from lightning_megatron.optim.strategy_hooks import StepHooks
from lightning_megatron.optim.step import StepGradients, build_step_gradients
from lightning_megatron.optim.zero3 import ZeRO3
from lightning_megatron.optim.main_params import MainParamOptimizer
from lightning_megatron.optim.param_gather import check_overlap_param_gather
from lightning_megatron.parallel.config import ParallelConfig, requested_layout
from lightning_megatron.parallel.diagnostics import (
    DEFAULT_TIMEOUT,
    PhaseRecord,
    argument,
    check_process_count,
    cleanup_after_failure,
    explain_collective_failure,
    meta_model_left_in_place,
    records_phase,
)
from lightning_megatron.parallel.lightning_features import (
    PreparedModel,
    check_trainer_features,
    evaluation_mode,
    prepare_metrics,
)
from lightning_megatron.parallel.random import TensorParallelRNG
from lightning_megatron.parallel.recompute import MODES as RECOMPUTE_MODES
from lightning_megatron.parallel.regional_compile import compile_options
from lightning_megatron.parallel.state import ParallelState
from lightning_megatron.parallel.summary import install_global_summary, layout_line, model_state_line, model_state_sizes
from lightning_megatron.checkpoint.sharded import BackgroundSaver, SavedCheckpoint
from lightning_megatron.checkpoint.training_state import (
    set_rng_state,
)
from lightning_megatron.pipeline.layout import check_schedule
from lightning_megatron.plan.auto import AUTO_SIZES, choose_sizes
from lightning_megatron.pipeline.runner import PipelineRunner
from lightning_megatron.pipeline.timeline import TimelineRecorder
from lightning_megatron.preparation import PipelineSplit, prepare_model, start_pipeline
from lightning_megatron.tensor_parallel.fp8_plan import check_fp8_options, describe_fp8
from lightning_megatron.tensor_parallel.mappings import full_sequences

CHECKPOINT_FORMATS = ("sharded", "full")


class Megatron3DStrategy(CheckpointHooks, StepHooks, ParallelStrategy):
    """Tensor, pipeline and data parallelism in the style of Megatron-LM.

    Args:
        tensor_parallel_size: ranks that split each layer (Megatron's column/row split); keep it within a node.
            Any of the sizes (tensor, pipeline, virtual pipeline, context, expert parallel) may be ``"auto"``:
            the layout planner (``lightning_megatron.plan``) then chooses them, on every rank alike, as the
            layout that fits the devices with the most predicted tokens/s, keeping the other arguments, and logs
            its choice (``strategy.auto_choice``).
        pipeline_parallel_size: pipeline ranks; the model needs ``pipeline_blocks()``.
        data_parallel_size: model replicas; ``"auto"`` takes ``world_size / (tp * cp * pp)``.
        sequence_parallel: also split LayerNorm/dropout activations along the sequence over tp.
        tp_comm_overlap: overlap the sequence-parallel forward collectives with the linears' GEMMs too
            (``tensor_parallel.overlap``); needs ``sequence_parallel=True`` and tp > 1.
        fp8: ``"tensorwise"`` or ``"rowwise"``: the GEMMs of the plan's column and row linears (attention, MLP,
            experts; not the output head) in FP8, their amaxes reduced over the groups that split each tensor, so
            the numbers do not depend on tp or cp (``tensor_parallel.fp8``); needs torchao (``[fp8]`` extra).
            Master weights, gradients, optimizer state and checkpoints stay as they are. ``None``: off.
        fp8_exclude: module-name patterns (``fnmatch``) kept in high precision, e.g. the first and last layers.
        context_parallel_size: ranks that split every sample's sequence (long context): each holds two of
            ``2 * cp`` chunks (Megatron's causal load balancing), attention is exact over the whole sequence
            (``context_parallel_attention``), and the weights are replicated over them, so gradients are reduced
            and ZeRO shards over dp x cp. The model declares its batch's sequence entries (``sequence_inputs()``).
        context_parallel_attention: ``"ring"`` (default: keys and values passed round the ranks with send/recv,
            overlapped with each block's compute) or ``"all_gather"`` (one all-gather of keys and values per
            layer and one SDPA call; suits grouped-query attention with few key/value heads).
        expert_parallel_size: ranks that split the experts of Mixture-of-Experts layers, carved out of dp
            (it must divide ``data_parallel_size``); tokens reach their experts by all-to-all, and the experts'
            gradients are reduced over the ranks holding the same experts (ZeRO 1/2 shards them there).
        zero_stage: ZeRO over dp: 1 shards fp32 main params and optimizer state, 2 also gradients,
            3 also the parameters (FSDP2 per transformer layer; gathered for forward and backward).
        virtual_pipeline_size: stages per pipeline rank (interleaved 1F1B when > 1).
        pipeline_schedule: ``"1f1b"``, ``"interleaved_1f1b"`` or ``"gpipe"`` (torch.distributed.pipelining), or a
            zero-bubble schedule, whose backward is an input-gradient pass and a weight-gradient pass run in what
            would be bubbles (Qi et al. 2024): ``"interleaved_zero_bubble"`` (any ``virtual_pipeline_size``),
            ``"zbv"`` and ``"dualpipev"`` (``virtual_pipeline_size=2``, stages placed in a V: rank ``r`` runs
            stages ``r`` and ``2 pp - 1 - r``). Not with ``zero_stage=3``.
        micro_batch_size: samples per pipeline micro-batch; the per-rank batch is cut into micro-batches.
        pipeline_layers_per_stage: layers of each of the ``pp * vpp`` stages (default: even).
        activation_checkpointing: ``"none"``, ``"full"`` (recompute each transformer layer in
            backward) or ``"selective"`` (recompute only attention's core, Korthikanti et al. 2022);
            the layers are the model's ``pipeline_blocks()`` layers. Dropout masks are replayed exactly.
        compile: regional compilation: ``torch.compile`` of each ``pipeline_blocks()`` layer's forward, once for
            all identical layers (``parallel.regional_compile``); the embedding, head, loss and schedule stay
            eager. ``True``, or a dict of ``torch.compile`` arguments (``{"backend": "aot_eager"}``,
            ``{"mode": "max-autotune"}``). With dropout off the model computes the same function (compiled
            dropout draws other masks than eager). Not with ``activation_checkpointing="selective"``,
            context or expert parallelism.
        loss_scaler: settings of the fp16 dynamic loss scaler for ``precision="16-true"``
            (``initial_scale``, ``min_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
            ``hysteresis``; Megatron-LM's scheme). A step with an inf/NaN gradient on any rank is
            skipped on every rank.
        on_nonfinite: what a NaN/Inf loss (of any micro-batch, on any rank) or global gradient norm does
            under ``32-true``, ``bf16-true`` and ``bf16-mixed``; checked every step right after the
            gradients are reduced, before Lightning's hooks, clipping (which reuses the norm) and the
            optimizer see them, so no checkpoint of a broken state is ever written. ``"error"`` (default,
            as Megatron-LM): raise ``NonFiniteError`` on every rank, naming the step and the ranks.
            ``"skip"``: skip the step on every rank (logged as ``skipped_steps``). ``"ignore"``: no check.
            fp16 (``16-true``, ``16-mixed``) keeps its loss scaler's overflow handling instead.
        max_consecutive_skips: under ``on_nonfinite="skip"``, the most steps in a row that may be skipped;
            the next non-finite one raises.
        offload_optimizer: where the fp32 main parameters and the optimizer state live (ZeRO 0-2): ``"cpu"`` (or
            ``True``): host memory, the optimizer steps there (ZeRO-Offload); ``"nvme"``: files under
            ``offload_path``, stepped tile by tile through a pool of three host buffers per state stream (reads and
            writes overlapped with the update), so host memory stays bounded by the pool (ZeRO-Infinity's
            optimizer tier); ``False``: the device. The disk space and host memory it needs are checked on every
            rank before training; the files are deleted at teardown. Checkpoints hold the same tensors on every
            tier, so a checkpoint made with one tier loads with any other.
        offload_parameters: ZeRO-3 only: ``"cpu"`` keeps the sharded parameters, their gradients and the optimizer
            state in host memory (FSDP2's ``CPUOffloadPolicy``); each layer's parameters are gathered to the device
            for its forward and backward.
        offload_path: the folder of the ``"nvme"`` tier (a fast local disk); each rank makes its own subfolder.
        offload_buffer_mb: the size of each of the ``"nvme"`` tier's host buffers (one tile of one stream).
        overlap_param_gather: ZeRO 1/2 only: start the all-gathers of the updated parameters after the step, one per
            bucket in forward order, each waited for by the first module of the next forward that owns its
            parameters (Megatron-Core's option). Checkpoints, evaluation and teardown wait first; so must a callback
            reading parameters between the step and the next forward (``strategy.wait_for_parameters()``).
        overlap_p2p_comm: the multi-stage pipeline schedules post each receive as early as they can, so it completes
            under compute (Megatron-LM's ``--overlap-p2p-communication``); ``False`` posts it just before its use.
        bucket_size_mb: size of the gradient buckets reduced over dp while backward runs.
        pad_vocab_to_multiple_of: the vocabulary is padded to a multiple of ``tp * this`` (Megatron: 128).
        checkpoint_format: ``"sharded"`` (default): a checkpoint is a directory in which every rank writes
            its own shards of the weights and of the optimizer state (torch.distributed.checkpoint), keyed
            by global names, so it loads at any other layout; saved atomically. ``"full"``: one file
            with the weights gathered on rank 0 (optimizer state only where it is not sharded).
            Both kinds load whatever this is set to.
        async_checkpoint: write sharded checkpoints in a background thread; training pauses only to
            copy this rank's shards to CPU memory. The checkpoint appears under its name when complete.
        checkpoint_checksums: record a CRC-32 of every file of a sharded checkpoint in its
            ``megatron_3d.json`` (each rank sums the files it wrote), so that ``verify_checkpoint`` and
            ``lightning-megatron checkpoint verify`` can tell a file whose bytes changed. Off by default:
            summing reads every file back, about 1.5 s per GB per rank on a CPU core
            (``benchmarks/checkpoint_checks.py``); the finite check on load, which is always on and
            costs ~0.05 s/GB, already refuses bytes damaged into NaN/Inf.
        verify_checkpoint: compare a sharded checkpoint's files with their checksums before loading it
            (the files are shared out over the ranks). Loaded tensors are always checked to be finite.
        timeout: how long a rank waits in a collective (every group of the layout) before it gives up:
            10 minutes by default (Megatron-LM's; torch's gloo default is 30). A rank that stalls blocks
            every other rank this long; the error then names the phase and step that were waiting (training
            step, optimizer step, checkpoint save, ...). Raise it for slow filesystems or long first steps.

    Example::

        trainer = L.Trainer(devices=8, strategy=Megatron3DStrategy(tensor_parallel_size=4))
    """

    strategy_name = "megatron_3d"

    def __init__(
        self,
        tensor_parallel_size: Union[int, str] = 1,
        pipeline_parallel_size: Union[int, str] = 1,
        data_parallel_size: Union[int, str] = "auto",
        sequence_parallel: bool = False,
        zero_stage: int = 0,
        *,
        virtual_pipeline_size: Union[int, str] = 1,
        expert_parallel_size: Union[int, str] = 1,
        context_parallel_size: Union[int, str] = 1,
        context_parallel_attention: str = "ring",
        pipeline_schedule: str = "1f1b",
        micro_batch_size: int = 1,
        pipeline_layers_per_stage: Optional[list[int]] = None,
        activation_checkpointing: str = "none",
        tp_comm_overlap: bool = False,
        fp8: Optional[str] = None,
        fp8_exclude: Sequence[str] = (),
        compile: Union[bool, dict] = False,
        loss_scaler: Optional[dict] = None,
        on_nonfinite: str = "error",
        max_consecutive_skips: int = 10,
        offload_optimizer: Union[bool, str] = False,
        offload_parameters: Union[bool, str] = False,
        offload_path: Optional[str] = None,
        offload_buffer_mb: float = DEFAULT_BUFFER_MB,
        overlap_param_gather: bool = False,
        overlap_p2p_comm: bool = True,
        bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB,
        pad_vocab_to_multiple_of: int = 128,
        checkpoint_format: str = "sharded",
        async_checkpoint: bool = False,
        checkpoint_checksums: bool = False,
        verify_checkpoint: bool = False,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = DEFAULT_TIMEOUT,
        accelerator=None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if activation_checkpointing not in RECOMPUTE_MODES:
            raise ValueError(
                f"activation_checkpointing={activation_checkpointing!r} is not one of {RECOMPUTE_MODES}."
            )
        self.activation_checkpointing = activation_checkpointing
        self.tp_comm_overlap = tp_comm_overlap
        self.fp8, self.fp8_exclude = check_fp8_options(fp8, fp8_exclude, tp_comm_overlap), tuple(fp8_exclude)
        self.compile = compile_options(compile)
        if context_parallel_attention not in CONTEXT_PARALLEL_ATTENTION:
            raise ValueError(f"context_parallel_attention={context_parallel_attention!r} is not one of "
                             f"{sorted(CONTEXT_PARALLEL_ATTENTION)}.")
        self.context_parallel_attention = context_parallel_attention
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}.")
        check_schedule(pipeline_schedule, virtual_pipeline_size, zero_stage=zero_stage)
        if pad_vocab_to_multiple_of < 1:
            raise ValueError(f"pad_vocab_to_multiple_of must be >= 1, got {pad_vocab_to_multiple_of}.")
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format={checkpoint_format!r} is not one of {CHECKPOINT_FORMATS}.")
        if async_checkpoint and checkpoint_format != "sharded":
            raise ValueError("async_checkpoint=True needs checkpoint_format='sharded'.")
        self.offload = OffloadSettings.from_options(
            offload_optimizer=offload_optimizer, offload_parameters=offload_parameters, offload_path=offload_path,
            offload_buffer_mb=offload_buffer_mb, zero_stage=zero_stage)
        if async_checkpoint and self.offload.optimizer == "nvme":
            raise ValueError("async_checkpoint=True copies this rank's optimizer state into host memory before writing "
                             "it, which the 'nvme' offload tier exists to avoid; use async_checkpoint=False with it.")
        self.checkpoint_format = checkpoint_format
        self.checkpoint_checksums, self.verify_checkpoint = checkpoint_checksums, verify_checkpoint
        self._background_saver = BackgroundSaver() if async_checkpoint else None
        self._requested = requested_layout(  # checked as far as it can be before any process exists
            tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size, sequence_parallel=sequence_parallel, zero_stage=zero_stage,
            virtual_pipeline_size=virtual_pipeline_size, pipeline_layers_per_stage=pipeline_layers_per_stage,
            expert_parallel_size=expert_parallel_size, context_parallel_size=context_parallel_size)
        self.pipeline_schedule = pipeline_schedule
        self.micro_batch_size = micro_batch_size
        self.bucket_size_mb = bucket_size_mb
        self.pad_vocab_to_multiple_of = pad_vocab_to_multiple_of
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._phases = PhaseRecord()  # what this rank is doing: named when a collective times out
        self.num_nodes = 1
        self._parallel_state: Optional[ParallelState] = None
        self._rng: Optional[TensorParallelRNG] = None
        self._step: Optional[StepGradients] = None
        self._sharded_checkpoint: Optional[SavedCheckpoint] = None  # the one being restored
        self._main_params: Optional[MainParamOptimizer] = None
        self._rng_state_to_restore: Optional[dict] = None
        self._zero3: Optional[ZeRO3] = None
        check_overlap_param_gather(overlap_param_gather, zero_stage)
        self.overlap_param_gather = overlap_param_gather
        self.overlap_p2p_comm = overlap_p2p_comm
        self._loss_scaler_settings = dict(loss_scaler or {})
        DynamicLossScaler(**self._loss_scaler_settings)  # validate the settings now, not after the launch
        self.loss_scaler: Optional[DynamicLossScaler] = None
        self.nonfinite = NonFiniteCheck(on_nonfinite, max_consecutive_skips)  # validates both
        self._step_grad_norm: Optional[Tensor] = None  # this step's norm, measured by the check, reused by the clip
        self._reported_bytes = False
        self._pipeline: Optional[PipelineRunner] = None
        self.pipeline_recorder: Optional[TimelineRecorder] = None
        self._seed = 0
        self._blocking_sync = False
        self._micro_batch_weight: Tensor | float = 1.0
        self._batch_splitter: Optional[BatchSplitter] = None
        self.auto_choice = None  # what the planner chose for "auto" sizes (lightning_megatron.plan.auto.AutoChoice)

    # ------------------------------------------------------------------ layout
    @property
    def parallel_state(self) -> ParallelState:
        if self._parallel_state is None:
            raise RuntimeError("The parallel layout exists only after the Trainer has set up the processes.")
        return self._parallel_state

    @property
    def parallel_config(self) -> ParallelConfig:
        return self.parallel_state.config

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Load checkpoints into the materialised shards: before ``setup`` the model is still on meta."""
        return True

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        state = self.parallel_state
        return {"num_replicas": state.config.data_parallel_size, "rank": state.data_parallel_rank}

    def _configure_launcher(self) -> None:
        """Our launchers finish interrupted checkpoint saves before Lightning looks for checkpoints, and the
        script copies they start die with them (``launcher.py``)."""
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            die_with_launcher()
            self._launcher = InPlaceLauncher()
        else:
            self._launcher = SubprocessLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @records_phase("setup")
    def setup_environment(self) -> None:
        # Under torchrun, devices x num_nodes must be the processes it started (before root_device indexes them).
        check_process_count(self.cluster_environment, self.num_processes, self.num_nodes)
        super().setup_environment()
        self.set_world_ranks()
        if any(self._requested[name] == "auto" for name in AUTO_SIZES):
            self._choose_auto_sizes()  # the same on every rank, before any process group
        config = ParallelConfig.for_world(self.world_size, **self._requested)
        validate = getattr(self.lightning_module, "validate_parallel_config", None)
        if validate is not None:
            validate(config)  # every rank raises the same error before any collective
        check_trainer_features(getattr(self.lightning_module, "_trainer", None), config)  # SWA, detect_anomaly
        reset_seed()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        check_directories_shared(getattr(self.lightning_module, "_trainer", None))  # node-local disks: refuse
        self._parallel_state = ParallelState.create(config, self.root_device, timeout=self._timeout)
        # One seed for the whole job: replicated weights and replicated dropout must agree across ranks.
        self._seed = self.broadcast(torch.initial_seed() % (2**63 - 1))
        # Dropout in different pipeline stages must not repeat the same masks (Megatron: +100 per stage).
        torch.manual_seed(self._seed + 100 * self._parallel_state.pipeline_parallel_rank)
        self._rng = TensorParallelRNG(self._seed, self._parallel_state.tensor_parallel_rank, self.root_device)
        rank_zero_info(layout_line(config, self.pipeline_schedule, self.micro_batch_size, self.world_size))

    def _choose_auto_sizes(self) -> None:
        """The layout planner fills the ``"auto"`` sizes (``lightning_megatron.plan.auto``) and says why."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)
        datamodule = getattr(trainer, "datamodule", None)
        settings = dict(zero_stage=self._requested["zero_stage"], sequence_parallel=self._requested["sequence_parallel"],
                        activation_checkpointing=self.activation_checkpointing, offload_optimizer=self.offload.optimizer,
                        offload_parameters=self.offload.parameters,
                        micro_batch_size=self.micro_batch_size, overlap_param_gather=self.overlap_param_gather)
        if self.pipeline_schedule != "1f1b":  # 1F1B (the default) may become interleaved 1F1B for virtual stages
            settings["pipeline_schedule"] = self.pipeline_schedule
        choice = choose_sizes(module, self._requested, world_size=self.world_size, device=self.root_device,
                              gpus_per_node=self.num_processes, global_batch_size=getattr(datamodule, "global_batch_size", None),
                              seq_length=getattr(datamodule, "seq_length", None),
                              precision=str(getattr(self.precision_plugin, "precision", "32-true")), settings=settings,
                              accumulate_grad_batches=getattr(trainer, "accumulate_grad_batches", 1),
                              bucket_size_mb=self.bucket_size_mb, pad_vocab_to_multiple_of=self.pad_vocab_to_multiple_of)
        self._requested.update(choice.sizes)
        if self.pipeline_schedule == "1f1b" and choice.pipeline_schedule != "1f1b":
            self.pipeline_schedule = choice.pipeline_schedule  # interleaving for the virtual stages it chose
        self.auto_choice = choice
        rank_zero_info(choice.message)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device: no rank ever holds the full model."""
        with torch.device("meta"):
            yield

    @records_phase("setup")
    def setup(self, trainer: "L.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        layout = getattr(module, "_megatron_3d_layout", None)
        if layout is None:
            prepared = self._prepare_model(module)
            module._megatron_3d_layout, module._megatron_3d_prepared = self.parallel_config, prepared
        elif layout != self.parallel_config:
            raise ValueError(
                f"This LightningModule was already split for {layout}; it cannot be re-split for "
                f"{self.parallel_config}. Build a new module (or load a checkpoint into one)."
            )
        else:  # a second fit, or test/validate after fit: split already, maybe by another strategy object
            prepared = module._megatron_3d_prepared
            self._zero3, self._rng = prepared.zero3, prepared.rng  # the model's dropout stream, not a new one
        self._batch_splitter = prepared.batch_splitter
        if self._zero3 is None:
            self.model = self.precision_plugin.convert_module(module)
            self.model_to_device()
        else:
            self.model = module  # fp32 shards stay: the FSDP policy casts for compute
        if prepared.split is not None:
            self._start_pipeline(prepared.split, trainer)  # a runner bound to this strategy and its groups
        state = self.parallel_state
        # Over dp x cp (each of those ranks saw other tokens), also when that is this rank alone: not the world.
        prepare_metrics(module, state.replica_mesh.get_group() if state.replica_mesh is not None else None)
        install_global_summary(trainer.callbacks, state.pipeline_parallel_group,
                               state.expert_parallel_group if state.config.expert_parallel_size > 1 else None)
        self.barrier()
        self.setup_precision_plugin()
        # Lightning's clip_grad_norm_ would clip each rank by its own shards' norm.
        self.precision_plugin.clip_grad_by_norm = self.clip_grad_by_global_norm
        self._setup_loss_scaling()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._step = self._build_step_gradients(module)
            self._main_params = self._step.main_params  # outlives teardown: a checkpoint after fit needs it
            if self._main_params is not None and self._main_params.nvme is not None:
                rank_zero_info(self._main_params.nvme.describe())

    def _prepare_model(self, module) -> PreparedModel:
        """Split the model for this layout, once (``preparation.prepare_model``)."""
        prepared = prepare_model(module, self.parallel_state, rng=self._rng, seed=self._seed, device=self.root_device,
                                 pad_vocab_to_multiple_of=self.pad_vocab_to_multiple_of,
                                 activation_checkpointing=self.activation_checkpointing,
                                 context_parallel_attention=self.context_parallel_attention,
                                 tp_comm_overlap=self.tp_comm_overlap,
                                 precision=getattr(self.precision_plugin, "precision", "32-true"),
                                 pipeline_schedule=self.pipeline_schedule,
                                 compile=self.compile, offload_parameters=self.offload.parameters,
                                 fp8=self.fp8, fp8_exclude=self.fp8_exclude)
        if self.fp8 is not None:
            rank_zero_info(describe_fp8(module, self.fp8))
        self._zero3 = prepared.zero3
        return prepared

    def _build_step_gradients(self, module) -> StepGradients:
        return build_step_gradients(module, self.parallel_state, self.optimizers, zero3=self._zero3,
                                    loss_scaler=self.loss_scaler, nonfinite=self._nonfinite_check(),
                                    bucket_size_mb=self.bucket_size_mb, offload=self.offload,
                                    device=self.root_device, overlap_param_gather=self.overlap_param_gather,
                                    ranks_sharing_host=max(self.num_processes, 1))

    def _start_pipeline(self, split: PipelineSplit, trainer: "L.Trainer") -> None:
        self.pipeline_recorder = TimelineRecorder(self.parallel_state.pipeline_parallel_rank)
        self._pipeline = start_pipeline(split, self.parallel_state, device=self.root_device,
                                        schedule=self.pipeline_schedule, micro_batch_size=self.micro_batch_size,
                                        recorder=self.pipeline_recorder, overlap_p2p_comm=self.overlap_p2p_comm,
                                        before_backward=self._before_pipeline_backward)
        trainer.fit_loop._skip_backward = True  # the schedule already ran every backward

    def _before_pipeline_backward(self, micro_batches: int, num_tokens: Tensor) -> None:
        if self._step is not None:
            self._step.sync.start_micro_batch(sync=not self._blocking_sync, backward_passes=micro_batches)
            self._pipeline.loss_scale = float(self._backward_scale(num_tokens))

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ training step
    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning wraps every micro-batch but the last of an accumulation window in this."""
        self._blocking_sync = True
        try:
            yield
        finally:
            self._blocking_sync = False

    @records_phase("training step")
    def training_step(self, *args: Any, **kwargs: Any):
        if self._rng_state_to_restore is not None:
            # Restored here, not at load time: Lightning draws from the global generator in between (a new
            # DataLoader iterator's base seed), which the saving run had done before it saved.
            set_rng_state(self._rng_state_to_restore, self._rng)
            self._rng_state_to_restore = None
        if self._step is not None:
            # ZeRO-3 reduce-scatters every micro-batch: accumulating unsharded gradients would break its memory bound.
            self._step.sync.start_micro_batch(sync=not self._blocking_sync or self._zero3 is not None)
        output = super().training_step(*self._rank_part(args), **kwargs)
        tokens = output.get("num_tokens") if isinstance(output, Mapping) else None
        self._micro_batch_weight = tokens.detach() if isinstance(tokens, Tensor) else 1.0
        if self._step is not None:
            self._step.add_tokens(self._micro_batch_weight)
            loss = output.get("loss") if isinstance(output, Mapping) else output
            if isinstance(loss, Tensor):  # under pipelining every stage has it: the runner broadcasts it over pp
                self._step.add_loss(loss)
        return output

    @records_phase("validation step")
    def validation_step(self, *args: Any, **kwargs: Any):
        with self._evaluation_mode():
            return super().validation_step(*self._rank_part(args), **kwargs)

    @records_phase("test step")
    def test_step(self, *args: Any, **kwargs: Any):
        with self._evaluation_mode():
            return super().test_step(*self._rank_part(args), **kwargs)

    @records_phase("predict step")
    def predict_step(self, *args: Any, **kwargs: Any):
        # Whole sequences on every rank: context- and sequence-parallel attention step aside (as in generation).
        with self._evaluation_mode(), full_sequences():
            return super().predict_step(*args, **kwargs)

    def _evaluation_mode(self):
        self.wait_for_parameters()
        return evaluation_mode(zero3=self._zero3 is not None)

    def _rank_part(self, args: tuple) -> tuple:
        """``(batch, ...)`` with the batch cut to this context-parallel rank's part of each sequence."""
        if self._batch_splitter is None or not args:
            return args
        return (self._batch_splitter(args[0]), *args[1:])

    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """Backward on the micro-batch's token sum (times :meth:`_backward_scale`).

        Lightning divided the loss by accumulate_grad_batches and the module returned a
        per-token mean; undo both, in one factor (one operation on the graph; exactly 1 for one
        replica without accumulation). ``16-mixed``: Lightning's GradScaler scales in pre_backward.
        """
        accumulation = self.lightning_module.trainer.accumulate_grad_batches
        factor = self._micro_batch_weight * (accumulation * self._backward_scale(self._micro_batch_weight))
        factor = factor.to(torch.promote_types(closure_loss.dtype, torch.float32))  # a float32 product, as before
        return super().backward(closure_loss * factor, optimizer, *args, **kwargs)

    @records_phase("optimizer step")
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        def closure_then_reduce_grads() -> Any:
            result = closure()
            if self._step is not None:
                accumulation = self.lightning_module.trainer.accumulate_grad_batches
                loss_scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
                overflow = self._step.finish(accumulation=accumulation, loss_scale=loss_scale)
                self._log_loss_scale(overflow)
                self._step_grad_norm = self._check_nonfinite(optimizer)
            return result

        output = super().optimizer_step(optimizer, closure_then_reduce_grads, model, **kwargs)
        self._step_grad_norm = None
        if self._step is not None:
            self._step.after_step()
        if not self._reported_bytes:
            self._report_model_state_bytes(optimizer)
        return output

    def _report_model_state_bytes(self, optimizer: Optimizer) -> None:
        """After the first step (optimizer state exists): this rank's bytes in ``model_state_bytes``, and one
        line on rank 0 with every rank's extremes (one all-reduce)."""
        self._reported_bytes = True
        self.model_state_bytes = model_state_sizes(self.lightning_module, getattr(optimizer, "_optimizer", optimizer),
                                                   self._step, self._zero3)
        rank_zero_info(model_state_line(self.model_state_bytes, device=self.root_device, module=self.lightning_module))

    def clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> Tensor:
        norm = self._step_grad_norm  # measured by the non-finite check this step: no second all-reduce
        if self._zero3 is not None:
            return self._zero3.clip_grad_norm_(float(clip_val), norm=norm)
        return self._step.clip(optimizer.param_groups, float(clip_val), norm=norm)

    # ------------------------------------------------------------------ collectives
    @records_phase("barrier", argument(0, "name"))
    def barrier(self, name: Optional[str] = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @records_phase("broadcast")
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @records_phase("metric reduction")
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[dist.ReduceOp, str]] = "mean") -> Any:
        """Reduce over dp x cp by default: tp/pp ranks of one replica hold the same value, and context-parallel
        ranks each a value of their own tokens (equal shares of every sequence)."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None:
            group = self.parallel_state.replica_group
            if group is None:
                return tensor
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @records_phase("decision")
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not _distributed_is_initialized():
            return decision
        votes = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(votes)
        return bool(votes == self.world_size) if all else bool(votes)

    def on_exception(self, exception: BaseException) -> None:
        """A collective that timed out (or lost its peer) is told what was waiting: a note on the exception."""
        self._failed = True
        explain_collective_failure(exception, self._phases, rank=self.global_rank, world_size=self.world_size,
                                   timeout=self._timeout)
        super().on_exception(exception)

    @records_phase("teardown")
    def teardown(self) -> None:
        """After an error nothing here raises over it (a model still on meta stays there): it stays the last one."""
        failed = getattr(self, "_failed", False)
        with cleanup_after_failure(failed, self.global_rank, "waiting for the background checkpoint"):
            if self._background_saver is not None:  # the last checkpoint must be complete before the process ends
                self._background_saver.wait(together=not failed)
        if _distributed_is_initialized() and not failed:
            self.wait_for_parameters()  # Lightning's teardown moves the parameters
            # Leave together: a process exiting while a peer's gloo threads still talk to it can abort.
            dist.barrier()
        if self._step is not None:
            self._step.remove()
            self._step = None
        with cleanup_after_failure(failed, self.global_rank, "teardown"), meta_model_left_in_place(self):
            super().teardown()  # ParallelStrategy's: the cluster environment, then the model to the CPU


def register() -> None:
    """Register ``"megatron_3d"`` with Lightning's strategy registry (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    if Megatron3DStrategy.strategy_name not in StrategyRegistry:
        StrategyRegistry.register(
            Megatron3DStrategy.strategy_name,
            Megatron3DStrategy,
            description="Megatron-LM style tensor + data parallelism (lightning-megatron)",
        )
