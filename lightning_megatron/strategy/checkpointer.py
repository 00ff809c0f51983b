"""The checkpoint hooks of ``Megatron3DStrategy`` (a mixin; ``strategy.py`` holds the rest of the wiring).

Sharded checkpoints (the default) are written by every rank from its own shards and read back into them
in place at any layout (``training_state.py``); ``checkpoint_format="full"`` gathers the weights into one
file through Lightning's own path. The mixin reads the strategy's layout (``parallel_state``), its ZeRO-3
sharding, fp32 main parameters (whose overlapped all-gathers it waits for: ``wait_for_parameters``), RNG
streams, loss scaler and background saver.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping, Optional

from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
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
from lightning_megatron.checkpoint.sharded import is_sharded_checkpoint, write_atomically
from lightning_megatron.checkpoint.training_state import (
    LAYOUT_KEY,
    RankTraining,
    check_full_checkpoint,
    load_model_state,
    load_optimizer_state,
    saved_rng_state,
    save_training_state,
)
from lightning_megatron.optim.zero3 import load_full_state_dict as load_zero3_state_dict
from lightning_megatron.parallel.agree import on_every_rank
from lightning_megatron.strategy.diagnostics import argument, records_phase

LOSS_SCALER_KEY = "megatron_3d_loss_scaler"


class CheckpointHooks:
    """Lightning's checkpoint hooks for the strategy: save, load, the state dicts they exchange."""

    _run_locks: list[RunLock] = []

    def on_train_start(self) -> None:
        """Before the first step global rank zero locks the checkpoint folders for this run (``run_lock``): a
        second run saving there, or a folder this run cannot write, stops every rank now, not at a save."""
        super().on_train_start()
        trainer = self.lightning_module.trainer
        directories = [Path(callback.dirpath) for callback in trainer.checkpoint_callbacks
                       if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None
                       and _is_local_file_protocol(callback.dirpath)]
        self.release_checkpoint_directories()
        self._run_locks = on_every_rank(lambda: take_all(directories) if self.is_global_zero else [],
                                        doing="lock the checkpoint directories", undo=release_all)

    def release_checkpoint_directories(self) -> None:
        """Release the run's locks (the launcher does when the Trainer's call returns or raises)."""
        release_all(self._run_locks)
        self._run_locks = []

    def full_state_dict(self, *, rank_zero_only: bool = False) -> dict[str, Any]:
        """Full tensors under global names (unpadded), gathered over tp, pp and ZeRO-3 onto every rank's CPU, or
        with ``rank_zero_only=True`` onto global rank 0's alone (``{}`` elsewhere; the other ranks send their
        pieces tensor by tensor and hold nothing more: what ``checkpoint_format="full"`` saves).

        A collective: call it on every rank. Example (export from a parallel run)::

            state_dict = trainer.strategy.full_state_dict(rank_zero_only=True)
            if trainer.is_global_zero:
                model.to_hf("exported", state_dict=state_dict)
        """
        state = self.parallel_state
        self.wait_for_parameters()  # ZeRO 1/2 with overlap_param_gather: the step's gathers may be in flight
        if self._zero3 is not None:
            self._zero3.retag()  # Lightning's teardown moves the module to the CPU, and FSDP drops our tags
        if rank_zero_only:
            return gather_full_state_dict_on_rank_zero(self.lightning_module, state.device)
        full = gather_full_state_dict(self.lightning_module, state.tensor_parallel_group)
        full = merge_pipeline_stages(full, state.pipeline_parallel_group)
        return merge_pipeline_stages(full, state.expert_parallel_group if state.config.expert_parallel_size > 1 else None)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """What Lightning puts under ``"state_dict"``: the gathered weights for ``checkpoint_format="full"``;
        nothing for sharded checkpoints, whose tensors ``save_checkpoint`` writes from each rank's shards."""
        if self.options.checkpoint_format != "full":
            return {}
        full = self.full_state_dict(rank_zero_only=True)
        return trained_only(full) if stores_adapters_only(self.lightning_module) else full  # see checkpoint.base

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self.options.checkpoint_format == "full":
            return super().optimizer_state(optimizer)
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return optimizer_hyperparameters(optimizer, self._rank_training().placements())

    def _rank_training(self) -> RankTraining:
        """This rank's part of a checkpoint (saved or loaded), its parameters whole (no gather in flight)."""
        self.wait_for_parameters()
        if self._zero3 is not None:
            self._zero3.retag()
        return RankTraining(self.lightning_module, [getattr(o, "_optimizer", o) for o in self.optimizers],
                            self.parallel_state, self._main_params, self._rng)

    @records_phase("saving checkpoint", argument(1, "filepath"))
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        if self.loss_scaler is not None:
            checkpoint[LOSS_SCALER_KEY] = self.loss_scaler.state_dict()
        if self.options.checkpoint_format == "full":
            # Rank 0 alone holds the gathered weights: its verdict (and every rank's on the path) reaches every rank.
            on_every_rank(lambda: check_full_checkpoint(checkpoint, filepath), doing=f"save checkpoint {filepath}")
            checkpoint[LAYOUT_KEY] = asdict(self.parallel_config)
            reference = base_reference(self.lightning_module)
            if reference is not None:
                checkpoint[BASE_KEY] = reference
            if self.is_global_zero and _is_local_file_protocol(filepath):  # atomic: written aside, then renamed
                write_atomically(filepath, lambda partial: self.checkpoint_io.save_checkpoint(
                    checkpoint, partial, storage_options=storage_options))
            else:
                super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        module = self.lightning_module
        info = {"model": f"{type(module).__module__}.{type(module).__qualname__}",
                "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch"),
                "precision": str(getattr(self.precision_plugin, "precision", "32-true"))}
        save_training_state(filepath, checkpoint, self._rank_training(), info, saver=self._background_saver,
                            checksums=self.options.checkpoint_checksums)

    def remove_checkpoint(self, filepath) -> None:
        if self._background_saver is not None and self._background_saver.pending == Path(filepath):
            self._background_saver.wait()  # else the rename would bring it back after its removal
        super().remove_checkpoint(filepath)

    @records_phase("loading checkpoint", argument(0, "checkpoint_path"))
    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A sharded checkpoint directory is read straight into this rank's shards (any saving layout);
        a single file goes through Lightning's loader and ``load_model_state_dict``."""
        self._sharded_checkpoint = None
        if self._background_saver is not None:
            self._background_saver.wait()
        check_visible_everywhere(checkpoint_path)  # else the ranks that see it would wait for those that do not
        if not is_sharded_checkpoint(checkpoint_path):
            if self.options.verify_checkpoint != "off" and _is_local_file_protocol(checkpoint_path):
                # Every rank reads the same file: rank zero compares the archive's CRC-32s for all of them.
                on_every_rank(lambda: verify_full(checkpoint_path) if self.is_global_zero else None,
                              doing=f"load checkpoint {checkpoint_path}")
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        training = self._rank_training()
        saved, checkpoint = load_model_state(checkpoint_path, training, verify=self.options.verify_checkpoint)
        self._sharded_checkpoint = saved
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:  # streams continue in training only
            self._rng_state_to_restore = saved_rng_state(checkpoint, training)
        if self.loss_scaler is not None and LOSS_SCALER_KEY in checkpoint:
            self.loss_scaler.load_state_dict(checkpoint[LOSS_SCALER_KEY])
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._sharded_checkpoint is not None:
            return  # read in place by load_checkpoint
        self.wait_for_parameters()  # a gather in flight would overwrite what is loaded
        reference = checkpoint.get(BASE_KEY)
        check_module_base(reference, self.lightning_module, where="This checkpoint")  # before any tensor is loaded
        if self._zero3 is not None:
            load_zero3_state_dict(self.lightning_module, checkpoint["state_dict"], self.parallel_state)
        else:
            local = local_state_dict_from_full(self.lightning_module, checkpoint["state_dict"])
            if reference is None:
                self.lightning_module.load_state_dict(local, strict=strict)
            else:  # adapters only: the base is the module's own, from the same pretrained weights
                load_adapters(self.lightning_module, local, strict=strict)
        if self._main_params is not None:
            self._main_params.copy_from_model()
        if self.loss_scaler is not None and LOSS_SCALER_KEY in checkpoint:
            self.loss_scaler.load_state_dict(checkpoint[LOSS_SCALER_KEY])

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Sharded checkpoints restore the optimizer state at any layout. Full (single-file) ones only
        where rank 0's copy is every rank's: tp=1, no ZeRO, no fp32 main parameters."""
        saved = self._sharded_checkpoint
        if saved is not None:
            load_optimizer_state(saved, checkpoint, self._rank_training())
            return
        why_not = full_optimizer_state_unusable(checkpoint.get(LAYOUT_KEY, {}), self.parallel_config,
                                                has_main_params=self._main_params is not None)
        if why_not:
            rank_zero_warn(why_not)
            return
        super().load_optimizer_state_dict(checkpoint)
