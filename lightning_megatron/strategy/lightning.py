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
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor
from torch.optim import Optimizer

from lightning_megatron.checkpoint.sharded import BackgroundSaver, SavedCheckpoint
from lightning_megatron.strategy.checkpointer import CheckpointHooks
from lightning_megatron.checkpoint.training_state import set_rng_state
from lightning_megatron.context_parallel.apply import BatchSplitter
from lightning_megatron.strategy.launcher import InPlaceLauncher, SubprocessLauncher, check_directories_shared, die_with_launcher
from lightning_megatron.offload.settings import DEFAULT_BUFFER_MB
from lightning_megatron.optim.grad_sync import DEFAULT_BUCKET_SIZE_MB
from lightning_megatron.optim.loss_scaler import DynamicLossScaler
from lightning_megatron.optim.main_params import MainParamOptimizer
from lightning_megatron.optim.nonfinite import NonFiniteCheck
from lightning_megatron.optim.step import StepGradients, build_step_gradients
from lightning_megatron.strategy.step import StepHooks
from lightning_megatron.optim.zero3 import ZeRO3
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.strategy.diagnostics import (DEFAULT_TIMEOUT, PhaseRecord, check_process_count,
                                                     cleanup_after_failure, explain_collective_failure,
                                                     meta_model_left_in_place, records_phase)
from lightning_megatron.strategy.lightning_features import (PreparedModel, check_trainer_features, evaluation_mode,
                                                            prepare_metrics)
from lightning_megatron.strategy.processes import exit_before_native_teardown, init_processes
from lightning_megatron.parallel.random import TensorParallelRNG
from lightning_megatron.parallel.state import ParallelState
from lightning_megatron.strategy.collectives import CollectiveHooks
from lightning_megatron.strategy.summary import install_global_summary, layout_line, report_model_state
from lightning_megatron.pipeline.runner import PipelineRunner
from lightning_megatron.pipeline.timeline import TimelineRecorder
from lightning_megatron.strategy.auto import AUTO_SIZES, choose_for_options
from lightning_megatron.strategy.preparation import PipelineSplit, prepare_model, start_pipeline
from lightning_megatron.strategy.requeue import add_stop_on_signal
from lightning_megatron.strategy.options import ARGUMENTS, StrategyOptions
from lightning_megatron.tensor_parallel.fp8_plan import describe_fp8
from lightning_megatron.tensor_parallel.mappings import full_sequences


class Megatron3DStrategy(CheckpointHooks, StepHooks, CollectiveHooks, ParallelStrategy):
    # Documented beside their checks (strategy_options.ARGUMENTS); LightningCLI's help and help() read it from here.
    __doc__ = ("Tensor, pipeline and data parallelism in the style of Megatron-LM.\n\n" + ARGUMENTS + "\nExample::\n\n"
               "    trainer = L.Trainer(devices=8, strategy=Megatron3DStrategy(tensor_parallel_size=4))\n")

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
        checkpoint_checksums: bool = True,
        verify_checkpoint: Union[bool, str] = "recorded",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = DEFAULT_TIMEOUT,
        accelerator=None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.options = StrategyOptions.from_arguments(  # every check, before any process exists
            tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size, sequence_parallel=sequence_parallel, zero_stage=zero_stage,
            virtual_pipeline_size=virtual_pipeline_size, expert_parallel_size=expert_parallel_size,
            context_parallel_size=context_parallel_size, context_parallel_attention=context_parallel_attention,
            pipeline_schedule=pipeline_schedule, micro_batch_size=micro_batch_size,
            pipeline_layers_per_stage=pipeline_layers_per_stage, activation_checkpointing=activation_checkpointing,
            tp_comm_overlap=tp_comm_overlap, fp8=fp8, fp8_exclude=fp8_exclude, compile=compile, loss_scaler=loss_scaler,
            on_nonfinite=on_nonfinite, max_consecutive_skips=max_consecutive_skips, offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters, offload_path=offload_path, offload_buffer_mb=offload_buffer_mb,
            overlap_param_gather=overlap_param_gather, overlap_p2p_comm=overlap_p2p_comm, bucket_size_mb=bucket_size_mb,
            pad_vocab_to_multiple_of=pad_vocab_to_multiple_of, checkpoint_format=checkpoint_format,
            async_checkpoint=async_checkpoint, checkpoint_checksums=checkpoint_checksums,
            verify_checkpoint=verify_checkpoint, process_group_backend=process_group_backend, timeout=timeout)
        self.pipeline_schedule = self.options.pipeline_schedule  # the one that runs: "auto" sizes may interleave it
        self.auto_choice = None  # what the planner chose for "auto" sizes (lightning_megatron.strategy.auto.AutoChoice)
        self.nonfinite = NonFiniteCheck(self.options.on_nonfinite, self.options.max_consecutive_skips)
        self.loss_scaler: Optional[DynamicLossScaler] = None  # built at setup under precision="16-true"
        self._background_saver = BackgroundSaver() if self.options.async_checkpoint else None
        self._phases = PhaseRecord()  # what this rank is doing: named when a collective times out
        self.num_nodes = 1
        self._parallel_state: Optional[ParallelState] = None
        self._rng: Optional[TensorParallelRNG] = None
        self._seed = 0
        self._step: Optional[StepGradients] = None
        self._step_grad_norm: Optional[Tensor] = None  # this step's norm, measured by the check, reused by the clip
        self._blocking_sync = False
        self._micro_batch_weight: Tensor | float = 1.0
        self._batch_splitter: Optional[BatchSplitter] = None
        self._sharded_checkpoint: Optional[SavedCheckpoint] = None  # the one being restored
        self._main_params: Optional[MainParamOptimizer] = None
        self._rng_state_to_restore: Optional[dict] = None
        self._zero3: Optional[ZeRO3] = None
        self._pipeline: Optional[PipelineRunner] = None
        self.pipeline_recorder: Optional[TimelineRecorder] = None
        self.model_state_bytes: Optional[dict[str, int]] = None  # this rank's, after the first optimizer step

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
        requested = self.options.requested
        if any(requested[name] == "auto" for name in AUTO_SIZES):  # the same on every rank, before any process group
            self.auto_choice = choose_for_options(self.lightning_module, self.options, world_size=self.world_size,
                                                  device=self.root_device, gpus_per_node=self.num_processes,
                                                  precision=str(getattr(self.precision_plugin, "precision", "32-true")))
            requested = {**requested, **self.auto_choice.sizes}
            self.pipeline_schedule = self.auto_choice.pipeline_schedule
            rank_zero_info(self.auto_choice.message)
        config = ParallelConfig.for_world(self.world_size, **requested)
        validate = getattr(self.lightning_module, "validate_parallel_config", None)
        if validate is not None:
            validate(config)  # every rank raises the same error before any collective
        check_trainer_features(getattr(self.lightning_module, "_trainer", None), config)  # SWA, detect_anomaly
        reset_seed()
        self._parallel_state = init_processes(self.cluster_environment, config, self.root_device,
                                              backend=self.options.process_group_backend, timeout=self.options.timeout)
        check_directories_shared(getattr(self.lightning_module, "_trainer", None))  # node-local disks: refuse
        # One seed for the whole job: replicated weights and replicated dropout must agree across ranks.
        self._seed = self.broadcast(torch.initial_seed() % (2**63 - 1))
        # Dropout in different pipeline stages must not repeat the same masks (Megatron: +100 per stage).
        torch.manual_seed(self._seed + 100 * self._parallel_state.pipeline_parallel_rank)
        self._rng = TensorParallelRNG(self._seed, self._parallel_state.tensor_parallel_rank, self.root_device)
        rank_zero_info(layout_line(config, self.pipeline_schedule, self.options.micro_batch_size, self.world_size))

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
            add_stop_on_signal(trainer)  # SIGTERM, Ctrl-C: save last.ckpt at an agreed step, exit 143 / 130
            self.setup_optimizers(trainer)
            self._step = self._build_step_gradients(module)
            self._main_params = self._step.main_params  # outlives teardown: a checkpoint after fit needs it
            if self._main_params is not None and self._main_params.nvme is not None:
                rank_zero_info(self._main_params.nvme.describe())

    def _prepare_model(self, module) -> PreparedModel:
        """Split the model for this layout, once (``preparation.prepare_model``)."""
        options = self.options
        prepared = prepare_model(module, self.parallel_state, rng=self._rng, seed=self._seed, device=self.root_device,
                                 pad_vocab_to_multiple_of=options.pad_vocab_to_multiple_of,
                                 activation_checkpointing=options.activation_checkpointing,
                                 context_parallel_attention=options.context_parallel_attention,
                                 tp_comm_overlap=options.tp_comm_overlap,
                                 precision=getattr(self.precision_plugin, "precision", "32-true"),
                                 pipeline_schedule=self.pipeline_schedule, compile=options.compile,
                                 offload_parameters=options.offload.parameters, fp8=options.fp8,
                                 fp8_exclude=options.fp8_exclude)
        if options.fp8 is not None:
            rank_zero_info(describe_fp8(module, options.fp8))
        self._zero3 = prepared.zero3
        return prepared

    def _build_step_gradients(self, module) -> StepGradients:
        return build_step_gradients(module, self.parallel_state, self.optimizers, zero3=self._zero3,
                                    loss_scaler=self.loss_scaler, nonfinite=self._nonfinite_check(),
                                    bucket_size_mb=self.options.bucket_size_mb, offload=self.options.offload,
                                    device=self.root_device, overlap_param_gather=self.options.overlap_param_gather,
                                    ranks_sharing_host=max(self.num_processes, 1))

    def _start_pipeline(self, split: PipelineSplit, trainer: "L.Trainer") -> None:
        self.pipeline_recorder = TimelineRecorder(self.parallel_state.pipeline_parallel_rank)
        self._pipeline = start_pipeline(split, self.parallel_state, device=self.root_device,
                                        schedule=self.pipeline_schedule, micro_batch_size=self.options.micro_batch_size,
                                        recorder=self.pipeline_recorder, overlap_p2p_comm=self.options.overlap_p2p_comm,
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
        if self.model_state_bytes is None:  # after the first step, when the optimizer state exists
            self.model_state_bytes = report_model_state(self.lightning_module, optimizer, self._step, self._zero3,
                                                        device=self.root_device)
        return output

    def clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> Tensor:
        norm = self._step_grad_norm  # measured by the non-finite check this step: no second all-reduce
        if self._zero3 is not None:
            return self._zero3.clip_grad_norm_(float(clip_val), norm=norm)
        return self._step.clip(optimizer.param_groups, float(clip_val), norm=norm)

    # ------------------------------------------------------------------ failure and teardown
    def on_exception(self, exception: BaseException) -> None:
        """A collective that timed out (or lost its peer) is told what was waiting: a note on the exception.
        A stop by signal (``requeue.StoppedBySignal``, raised by every rank at one step) is no failure: the
        teardown still leaves together."""
        if isinstance(exception, SIGTERMException):
            super().on_exception(exception)
            return
        self._failed = True
        if dist.is_initialized():
            exit_before_native_teardown(exception)  # if it ends the process: its error stays the last line
        explain_collective_failure(exception, self._phases, rank=self.global_rank, world_size=self.world_size,
                                   timeout=self.options.timeout)
        super().on_exception(exception)

    @records_phase("teardown")
    def teardown(self) -> None:
        """After an error nothing here raises over it (a model still on meta stays there): it stays the last one."""
        failed = getattr(self, "_failed", False)
        with cleanup_after_failure(failed, self.global_rank, "waiting for the background checkpoint"):
            if self._background_saver is not None:  # the last checkpoint must be complete before the process ends
                self._background_saver.wait(together=not failed)
        if dist.is_initialized() and not failed:
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
