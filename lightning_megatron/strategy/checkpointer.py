"""Saving and loading the strategy's training state: :class:`Checkpointer`.

Sharded checkpoints (the default) are written by every rank from its own shards and read back into them in place at
any layout (``checkpoint.training_state``); ``checkpoint_format="full"`` gathers the weights into one file through
Lightning's own path (the ``lightning_*`` callables the strategy passes: its base class's methods). The checkpointer
keeps what lives between two hooks: the run's locks on its checkpoint folders, the background saver
(``async_checkpoint``), the sharded checkpoint being restored, and the RNG state to restore at the first training
step. What it reads of the running strategy comes in each call as :class:`TrainingParts`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from lightning_megatron.checkpoint.base import (
    BASE_KEY,
    base_reference,
    check_module_base,
    load_adapters,
    stores_adapters_only,
    trained_only,
)
from lightning_megatron.checkpoint.entries import optimizer_hyperparameters
from lightning_megatron.checkpoint.full import (
    full_optimizer_state_unusable,
    gather_full_state_dict,
    gather_full_state_dict_on_rank_zero,
    local_state_dict_from_full,
    merge_pipeline_stages,
    verify_full,
)
from lightning_megatron.checkpoint.run_lock import RunLock, release_all, take_all
from lightning_megatron.checkpoint.shared_storage import check_visible_everywhere
from lightning_megatron.checkpoint.sharded import BackgroundSaver, SavedCheckpoint, is_sharded_checkpoint, write_atomically
from lightning_megatron.checkpoint.training_state import (
    LAYOUT_KEY,
    RankTraining,
    check_full_checkpoint,
    load_model_state,
    load_optimizer_state,
    saved_rng_state,
    save_training_state,
    set_rng_state,
)
from lightning_megatron.optim.zero3 import load_full_state_dict as load_zero3_state_dict
from lightning_megatron.parallel.agree import on_every_rank

from lightning_megatron.parallel.random import TensorParallelRNG
from lightning_megatron.parallel.state import ParallelState
from lightning_megatron.strategy.options import StrategyOptions
from lightning_megatron.strategy.step import StepDriver

LOSS_SCALER_KEY = "megatron_3d_loss_scaler"


@dataclass
class TrainingParts:
    """What a checkpoint reads or writes of the running strategy: its options (a test may replace them between
    saves), the module, optimizers and layout, ZeRO-3's sharding, the step driver (fp32 main parameters, whose
    overlapped all-gathers it waits for, and the fp16 loss scaler), the RNG streams, and whether this is rank 0."""

    options: StrategyOptions
    module: nn.Module
    optimizers: list
    state: ParallelState
    zero3: Optional[Any]
    driver: StepDriver
    rng: Optional[TensorParallelRNG]
    is_global_zero: bool
    precision: str

    def rank_training(self) -> RankTraining:
        """This rank's part of a checkpoint (saved or loaded), its parameters whole (no gather in flight)."""
        self.driver.wait_for_parameters()
        if self.zero3 is not None:
            self.zero3.retag()  # Lightning's teardown moves the module to the CPU, and FSDP drops our tags
        return RankTraining(self.module, [getattr(o, "_optimizer", o) for o in self.optimizers], self.state,
                            self.driver.main_params, self.rng)


class Checkpointer:
    """The strategy's checkpoint hooks: save, load, remove, the state dicts they exchange, the run's locks."""

    def __init__(self, async_checkpoint: bool) -> None:
        self.background_saver = BackgroundSaver() if async_checkpoint else None
        self.run_locks: list[RunLock] = []
        self.loaded: Optional[SavedCheckpoint] = None  # the sharded checkpoint being restored
        self.rng_state_to_restore: Optional[dict] = None

    def lock_directories(self, trainer: Any, is_global_zero: bool) -> None:
        """Before the first step global rank zero locks the checkpoint folders for this run (``run_lock``): a
        second run saving there, or a folder this run cannot write, stops every rank now, not at a save."""
        directories = [Path(callback.dirpath) for callback in trainer.checkpoint_callbacks
                       if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None
                       and _is_local_file_protocol(callback.dirpath)]
        self.release()
        self.run_locks = on_every_rank(lambda: take_all(directories) if is_global_zero else [],
                                       doing="lock the checkpoint directories", undo=release_all)

    def release(self) -> None:
        release_all(self.run_locks)
        self.run_locks = []

    def restore_rng(self, rng: Optional[TensorParallelRNG]) -> None:
        """At the first training step after a load, not at load time: Lightning draws from the global generator in
        between (a new DataLoader iterator's base seed), which the saving run had done before it saved."""
        if self.rng_state_to_restore is not None:
            set_rng_state(self.rng_state_to_restore, rng)
            self.rng_state_to_restore = None

    def full_state_dict(self, parts: TrainingParts, *, rank_zero_only: bool = False) -> dict[str, Any]:
        """``Megatron3DStrategy.full_state_dict``: full tensors under global names, gathered."""
        state = parts.state
        parts.driver.wait_for_parameters()  # ZeRO 1/2 with overlap_param_gather: the step's gathers may be in flight
        if parts.zero3 is not None:
            parts.zero3.retag()  # Lightning's teardown moves the module to the CPU, and FSDP drops our tags
        if rank_zero_only:
            return gather_full_state_dict_on_rank_zero(parts.module, state.device)
        full = gather_full_state_dict(parts.module, state.tensor_parallel_group)
        full = merge_pipeline_stages(full, state.pipeline_parallel_group)
        return merge_pipeline_stages(full, state.expert_parallel_group if state.config.expert_parallel_size > 1 else None)

    def module_state_dict(self, parts: TrainingParts) -> dict[str, Any]:
        """What Lightning puts under ``"state_dict"``: the gathered weights for ``checkpoint_format="full"``;
        nothing for sharded checkpoints, whose tensors :meth:`save` writes from each rank's shards."""
        if parts.options.checkpoint_format != "full":
            return {}
        full = self.full_state_dict(parts, rank_zero_only=True)
        return trained_only(full) if stores_adapters_only(parts.module) else full  # see checkpoint.base

    def optimizer_state(self, parts: TrainingParts, optimizer: Optimizer,
                        lightning_state: Callable[[Optimizer], dict]) -> dict[str, Any]:
        if parts.options.checkpoint_format == "full":
            return lightning_state(optimizer)
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return optimizer_hyperparameters(optimizer, parts.rank_training().placements())

    def save(self, parts: TrainingParts, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any],
             *, checkpoint_io: Any, lightning_save: Callable[..., None]) -> None:
        loss_scaler = parts.driver.loss_scaler
        if loss_scaler is not None:
            checkpoint[LOSS_SCALER_KEY] = loss_scaler.state_dict()
        if parts.options.checkpoint_format == "full":
            # Rank 0 alone holds the gathered weights: its verdict (and every rank's on the path) reaches every rank.
            on_every_rank(lambda: check_full_checkpoint(checkpoint, filepath), doing=f"save checkpoint {filepath}")
            checkpoint[LAYOUT_KEY] = asdict(parts.state.config)
            reference = base_reference(parts.module)
            if reference is not None:
                checkpoint[BASE_KEY] = reference
            if parts.is_global_zero and _is_local_file_protocol(filepath):  # atomic: written aside, then renamed
                write_atomically(filepath, lambda partial: checkpoint_io.save_checkpoint(
                    checkpoint, partial, storage_options=storage_options))
            else:
                lightning_save(checkpoint, filepath, storage_options)
            return
        module = parts.module
        info = {"model": f"{type(module).__module__}.{type(module).__qualname__}",
                "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch"),
                "precision": parts.precision}
        save_training_state(filepath, checkpoint, parts.rank_training(), info, saver=self.background_saver,
                            checksums=parts.options.checkpoint_checksums)

    def before_remove(self, filepath) -> None:
        if self.background_saver is not None and self.background_saver.pending == Path(filepath):
            self.background_saver.wait()  # else the rename would bring it back after its removal

    def load(self, parts: TrainingParts, checkpoint_path, *, fitting: bool,
             lightning_load: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """A sharded checkpoint directory is read straight into this rank's shards (any saving layout);
        a single file goes through Lightning's loader (``lightning_load``) and :meth:`load_model_state_dict`."""
        self.loaded = None
        if self.background_saver is not None:
            self.background_saver.wait()
        check_visible_everywhere(checkpoint_path)  # else the ranks that see it would wait for those that do not
        if not is_sharded_checkpoint(checkpoint_path):
            if parts.options.verify_mode != "off" and _is_local_file_protocol(checkpoint_path):
                # Every rank reads the same file: rank zero compares the archive's CRC-32s for all of them.
                on_every_rank(lambda: verify_full(checkpoint_path) if parts.is_global_zero else None,
                              doing=f"load checkpoint {checkpoint_path}")
            return lightning_load()
        training = parts.rank_training()
        saved, checkpoint = load_model_state(checkpoint_path, training, verify=parts.options.verify_mode)
        self.loaded = saved
        if fitting:  # streams continue in training only
            self.rng_state_to_restore = saved_rng_state(checkpoint, training)
        loss_scaler = parts.driver.loss_scaler
        if loss_scaler is not None and LOSS_SCALER_KEY in checkpoint:
            loss_scaler.load_state_dict(checkpoint[LOSS_SCALER_KEY])
        return checkpoint

    def load_model_state_dict(self, parts: TrainingParts, checkpoint: Mapping[str, Any], strict: bool) -> None:
        if self.loaded is not None:
            return  # read in place by load()
        parts.driver.wait_for_parameters()  # a gather in flight would overwrite what is loaded
        module = parts.module
        reference = checkpoint.get(BASE_KEY)
        check_module_base(reference, module, where="This checkpoint")  # before any tensor is loaded
        if parts.zero3 is not None:
            load_zero3_state_dict(module, checkpoint["state_dict"])
        else:
            local = local_state_dict_from_full(module, checkpoint["state_dict"])
            if reference is None:
                module.load_state_dict(local, strict=strict)
            else:  # adapters only: the base is the module's own, from the same pretrained weights
                load_adapters(module, local, strict=strict)
        main_params, loss_scaler = parts.driver.main_params, parts.driver.loss_scaler
        if main_params is not None:
            main_params.copy_from_model()
        if loss_scaler is not None and LOSS_SCALER_KEY in checkpoint:
            loss_scaler.load_state_dict(checkpoint[LOSS_SCALER_KEY])

    def load_optimizer_state_dict(self, parts: TrainingParts, checkpoint: Mapping[str, Any],
                                  lightning_load: Callable[[Mapping[str, Any]], None]) -> None:
        """Sharded checkpoints restore the optimizer state at any layout. Full (single-file) ones only
        where rank 0's copy is every rank's: tp=1, no ZeRO, no fp32 main parameters."""
        if self.loaded is not None:
            load_optimizer_state(self.loaded, checkpoint, parts.rank_training())
            return
        why_not = full_optimizer_state_unusable(checkpoint.get(LAYOUT_KEY, {}), parts.state.config,
                                                has_main_params=parts.driver.main_params is not None)
        if why_not:
            rank_zero_warn(why_not)
            return
        lightning_load(checkpoint)
