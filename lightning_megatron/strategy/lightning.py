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

This class holds the hooks and their wiring only. What they do is in the package's other modules, composed here:
its settings (``options.StrategyOptions``), the set-up steps (``preparation``), one optimizer step
(``step.StepDriver``), checkpoints (``checkpointer.Checkpointer``) and the collectives (``collectives``).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Callable, Generator, Optional, Sequence, Union

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

from lightning_megatron.context_parallel.apply import BatchSplitter
from lightning_megatron.offload.settings import DEFAULT_BUFFER_MB
from lightning_megatron.optim.grad_sync import DEFAULT_BUCKET_SIZE_MB
from lightning_megatron.optim.zero3 import ZeRO3
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.random import TensorParallelRNG
from lightning_megatron.parallel.state import ParallelState
from lightning_megatron.pipeline.timeline import TimelineRecorder
from lightning_megatron.strategy import collectives
from lightning_megatron.strategy.auto import AUTO_SIZES, choose_for_options
from lightning_megatron.strategy.checkpointer import Checkpointer, TrainingParts
from lightning_megatron.strategy.diagnostics import (DEFAULT_TIMEOUT, PhaseRecord, argument, check_process_count,
                                                     cleanup_after_failure, explain_collective_failure,
                                                     meta_model_left_in_place, records_phase)
from lightning_megatron.strategy.launcher import (InPlaceLauncher, SubprocessLauncher, check_directories_shared,
                                                  die_with_launcher)
from lightning_megatron.strategy.lightning_features import check_trainer_features, evaluation_mode, prepare_metrics
from lightning_megatron.strategy.options import StrategyOptions, arguments_doc
from lightning_megatron.strategy.preparation import PreparedModel, prepare_model, start_pipeline
from lightning_megatron.strategy.processes import exit_before_native_teardown, init_processes
from lightning_megatron.strategy.requeue import add_stop_on_signal
from lightning_megatron.strategy.step import StepDriver
from lightning_megatron.strategy.summary import install_global_summary, layout_line, report_model_state
from lightning_megatron.tensor_parallel.fp8_plan import describe_fp8
from lightning_megatron.tensor_parallel.mappings import full_sequences


class Megatron3DStrategy(ParallelStrategy):
    # The arguments' documentation is StrategyOptions' field metadata; LightningCLI's help and help() read it here.
    __doc__ = ("Tensor, pipeline and data parallelism in the style of Megatron-LM.\n\n" + arguments_doc() +
               "\nExample::\n\n"
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
        expert_tensor_parallel_size: Optional[int] = None,
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
        given = locals()  # the arguments, before any other name is bound here
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        # Every check, before any process exists; the same names as this signature (tests/test_strategy_options.py).
        self.options = StrategyOptions(**{name: given[name] for name in StrategyOptions.__dataclass_fields__
                                          if name in given})
        self.auto_choice = None  # what the planner chose for "auto" sizes (strategy.auto.AutoChoice)
        self.driver = StepDriver(self.options)
        self.checkpointer = Checkpointer(self.options.async_checkpoint)
        self._phases = PhaseRecord()  # what this rank is doing: named when a collective times out
        self.num_nodes = 1
        self._parallel_state: Optional[ParallelState] = None
        self._rng: Optional[TensorParallelRNG] = None
        self._seed = 0
        self._batch_splitter: Optional[BatchSplitter] = None
        self._zero3: Optional[ZeRO3] = None
        self._failed = False
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
        if any(self.options.requested[name] == "auto" for name in AUTO_SIZES):  # alike on every rank, before any group
            self.auto_choice = choose_for_options(self.lightning_module, self.options, world_size=self.world_size,
                                                  device=self.root_device, gpus_per_node=self.num_processes,
                                                  precision=self._precision())
            self.options = self.options.resolved(self.auto_choice.sizes, self.auto_choice.pipeline_schedule)
            rank_zero_info(self.auto_choice.message)
        config = ParallelConfig.for_world(self.world_size, **self.options.requested)
        validate = getattr(self.lightning_module, "validate_parallel_config", None)
        if validate is not None:
            validate(config)  # every rank raises the same error before any collective
        validate_schedule = getattr(self.lightning_module, "validate_pipeline_schedule", None)
        if validate_schedule is not None and config.pipeline_parallel_size > 1:
            validate_schedule(self.options.pipeline_schedule)
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
        rank_zero_info(layout_line(config, self.options.pipeline_schedule, self.options.micro_batch_size, self.world_size))

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
            self._rng = prepared.rng  # the model's dropout stream, not a new one
        self._zero3, self._batch_splitter = prepared.zero3, prepared.batch_splitter
        if self._zero3 is None:
            self.model = self.precision_plugin.convert_module(module)
            self.model_to_device()
        else:
            self.model = module  # fp32 shards stay: the FSDP policy casts for compute
        if prepared.split is not None:  # a runner bound to this strategy and its groups
            self.pipeline_recorder = TimelineRecorder(self.parallel_state.pipeline_parallel_rank)
            self.driver.pipeline = start_pipeline(prepared.split, self.parallel_state, self.options,
                                                  device=self.root_device, recorder=self.pipeline_recorder,
                                                  before_backward=self._before_pipeline_backward)
            trainer.fit_loop._skip_backward = True  # the schedule already ran every backward
        state = self.parallel_state
        # Over dp x cp (each of those ranks saw other tokens), also when that is this rank alone: not the world.
        prepare_metrics(module, state.replica_mesh.get_group() if state.replica_mesh is not None else None)
        install_global_summary(trainer.callbacks, state.pipeline_parallel_group,
                               state.expert_parallel_group if state.config.expert_parallel_size > 1 else None)
        self.barrier()
        self.setup_precision_plugin()
        self.driver.bind(self.precision_plugin, self.root_device, self.options)  # also Lightning's clip seam (step.py)
        if trainer.state.fn == TrainerFn.FITTING:
            add_stop_on_signal(trainer)  # SIGTERM, Ctrl-C: save last.ckpt at an agreed step, exit 143 / 130
            self.setup_optimizers(trainer)
            self.driver.start(module, state, self.optimizers, self.options, zero3=self._zero3, device=self.root_device,
                              ranks_sharing_host=max(self.num_processes, 1))
            if self.driver.main_params is not None and self.driver.main_params.nvme is not None:
                rank_zero_info(self.driver.main_params.nvme.describe())

    def _prepare_model(self, module) -> PreparedModel:
        """Split the model for this layout, once (``preparation.prepare_model``)."""
        prepared = prepare_model(module, self.parallel_state, self.options, rng=self._rng, seed=self._seed,
                                 device=self.root_device, precision=self._precision())
        if self.options.fp8_recipe is not None:
            rank_zero_info(describe_fp8(module, self.options.fp8_recipe))
        return prepared

    def _precision(self) -> str:
        return str(getattr(self.precision_plugin, "precision", "32-true"))

    def _before_pipeline_backward(self, micro_batches: int, num_tokens: Tensor) -> None:
        self.driver.before_pipeline_backward(micro_batches, num_tokens, self.lightning_module.trainer.accumulate_grad_batches)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ training step (step.StepDriver)
    def block_backward_sync(self):
        """Lightning wraps every micro-batch but the last of an accumulation window in this."""
        return self.driver.block_backward_sync()

    @records_phase("training step")
    def training_step(self, *args: Any, **kwargs: Any):
        self.checkpointer.restore_rng(self._rng)
        self.driver.start_micro_batch()
        output = super().training_step(*self._rank_part(args), **kwargs)
        self.driver.record(output)
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
        """Backward on the micro-batch's token sum, times the step's normaliser (``StepDriver.backward_factor``).
        ``16-mixed``: Lightning's GradScaler scales in pre_backward."""
        factor = self.driver.backward_factor(self.lightning_module.trainer.accumulate_grad_batches)
        factor = factor.to(torch.promote_types(closure_loss.dtype, torch.float32))  # a float32 product, as before
        return super().backward(closure_loss * factor, optimizer, *args, **kwargs)

    @records_phase("optimizer step")
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        """finish -> non-finite check -> Lightning's hooks and clip -> the optimizer (``step.StepDriver.step``)."""
        output = self.driver.step(optimizer, closure, lambda wrapped: super(Megatron3DStrategy, self).optimizer_step(
            optimizer, wrapped, model, **kwargs), self.lightning_module.trainer)
        if self.model_state_bytes is None:  # after the first step, when the optimizer state exists
            self.model_state_bytes = report_model_state(self.lightning_module, optimizer, self.driver.gradients,
                                                        self._zero3, device=self.root_device)
        return output

    def wait_for_parameters(self) -> None:
        """Complete ZeRO 1/2's parameter all-gathers still in flight after a step (``overlap_param_gather``).

        The next forward (module by module), checkpoint saves and loads, evaluation and teardown do so
        themselves; call it before reading parameter values anywhere else between a step and the next forward
        (a callback's ``on_train_batch_end``)."""
        self.driver.wait_for_parameters()

    # ------------------------------------------------------------------ collectives (collectives.py)
    @records_phase("barrier", argument(0, "name"))
    def barrier(self, name: Optional[str] = None) -> None:
        collectives.barrier()

    @records_phase("broadcast")
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return collectives.broadcast(obj, src)

    @records_phase("metric reduction")
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[dist.ReduceOp, str]] = "mean") -> Any:
        return collectives.reduce(tensor, self.parallel_state, group, reduce_op)

    @records_phase("decision")
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return collectives.reduce_boolean_decision(decision, all, self.root_device, self.world_size)

    # ------------------------------------------------------------------ checkpoints (checkpointer.py)
    def _parts(self) -> TrainingParts:
        return TrainingParts(self.options, self.lightning_module, self.optimizers, self.parallel_state, self._zero3,
                             self.driver, self._rng, self.is_global_zero, self._precision())

    def on_train_start(self) -> None:
        super().on_train_start()
        self.checkpointer.lock_directories(self.lightning_module.trainer, self.is_global_zero)

    def release_checkpoint_directories(self) -> None:
        """Release the run's locks: at teardown, before the ranks leave together (a script's next fit on the same
        folder, on any rank, then finds it free), and by the launcher when the Trainer's call raises."""
        self.checkpointer.release()

    def full_state_dict(self, *, rank_zero_only: bool = False) -> dict[str, Any]:
        """Full tensors under global names (unpadded), gathered over tp, pp and ZeRO-3 onto every rank's CPU, or
        with ``rank_zero_only=True`` onto global rank 0's alone (``{}`` elsewhere; the other ranks send their
        pieces tensor by tensor and hold nothing more: what ``checkpoint_format="full"`` saves).

        A collective: call it on every rank. Example (export from a parallel run)::

            state_dict = trainer.strategy.full_state_dict(rank_zero_only=True)
            if trainer.is_global_zero:
                model.to_hf("exported", state_dict=state_dict)
        """
        return self.checkpointer.full_state_dict(self._parts(), rank_zero_only=rank_zero_only)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.checkpointer.module_state_dict(self._parts())

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self.checkpointer.optimizer_state(self._parts(), optimizer, super().optimizer_state)

    @records_phase("saving checkpoint", argument(1, "filepath"))
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        self.checkpointer.save(self._parts(), checkpoint, filepath, storage_options, checkpoint_io=self.checkpoint_io,
                               lightning_save=super().save_checkpoint)

    def remove_checkpoint(self, filepath) -> None:
        self.checkpointer.before_remove(filepath)
        super().remove_checkpoint(filepath)

    @records_phase("loading checkpoint", argument(0, "checkpoint_path"))
    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        return self.checkpointer.load(self._parts(), checkpoint_path, fitting=fitting, lightning_load=lambda: super(
            Megatron3DStrategy, self).load_checkpoint(checkpoint_path, weights_only=weights_only))

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        self.checkpointer.load_model_state_dict(self._parts(), checkpoint, strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        self.checkpointer.load_optimizer_state_dict(self._parts(), checkpoint, super().load_optimizer_state_dict)

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
        failed = self._failed
        with cleanup_after_failure(failed, self.global_rank, "waiting for the background checkpoint"):
            if self.checkpointer.background_saver is not None:  # the last checkpoint must be complete before the end
                self.checkpointer.background_saver.wait(together=not failed)
        if dist.is_initialized() and not failed:
            self.wait_for_parameters()  # Lightning's teardown moves the parameters
            # Before the barrier: no rank leaves this run (and starts the script's next fit on the same folder,
            # whose start checks the lock in every process) while global rank zero still holds the folder.
            self.release_checkpoint_directories()
            # Leave together: a process exiting while a peer's gloo threads still talk to it can abort.
            dist.barrier()
        self.driver.remove()
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
