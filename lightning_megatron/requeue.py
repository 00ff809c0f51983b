"""Before a cluster's time limit: save at a step every rank agrees on, stop, requeue the job.

SLURM warns a job before its time limit with a signal to every task (``#SBATCH --signal=USR1@90``).
Lightning's own answer (``SLURMEnvironment(auto_requeue=True)``) saves the checkpoint inside the signal
handler, which runs on each rank wherever that rank happens to be in its step. A sharded checkpoint is
written by every rank together (collectives before the rename), so ranks caught at different collectives
would hang or exchange the wrong tensors, and each rank numbers its own ``hpc_ckpt_<n>.ckpt`` from what it
sees on the filesystem. Here the handler only notes the signal; after each optimizer step the ranks agree
(one all-reduce of a flag) whether any of them got it, and if so all save ``last.ckpt`` in the
``ModelCheckpoint``'s folder, at the same step, and stop. Once every rank has finished its writes (after
the strategy's teardown), global rank 0 requeues the job, whose next run resumes from ``ckpt_path="last"``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn


def slurm_job_id() -> Optional[str]:
    """The id ``scontrol requeue`` takes: an array task's ``<array job>_<task>``, else ``SLURM_JOB_ID``."""
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job is not None and task is not None:
        return f"{array_job}_{task}"
    return os.environ.get("SLURM_JOB_ID")


class SaveAndRequeue(L.Callback):
    """On ``signum`` (any rank): save ``last.ckpt`` at the next optimizer step on every rank, stop, requeue.

    Args:
        signum: the signal the cluster sends before the time limit (name or number; SLURM: ``--signal=USR1@90``).
        requeue: after the save, global rank 0 runs ``scontrol requeue <job id>``; ``False``: save and stop only
            (the batch script requeues, or a person does).

    Needs a ``ModelCheckpoint`` (its ``dirpath`` receives ``last.ckpt``; a later ``fit(ckpt_path="last")`` finds
    it there). It installs its handler before Lightning's, so Lightning's own SLURM requeue handler stays out.
    """

    def __init__(self, signum: int | str = "SIGUSR1", requeue: bool = True) -> None:
        self.signum = signal.Signals[signum] if isinstance(signum, str) else signal.Signals(signum)
        self.requeue = requeue
        self.received = False
        self.saved: Optional[Path] = None  # where the signal's checkpoint went, once saved
        self._previous: Any = None
        self._checked_step = -1

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not any(isinstance(callback, ModelCheckpoint) for callback in trainer.checkpoint_callbacks):
            raise ValueError("SaveAndRequeue saves last.ckpt in a ModelCheckpoint's folder, and the Trainer has none: "
                             "add ModelCheckpoint(dirpath=..., save_last=True) to its callbacks (and enable_checkpointing).")
        self.received, self.saved = False, None
        # Before Lightning's signal connector looks (so it adds no SIGUSR1 handler of its own) and before the
        # DataLoader workers are forked (they inherit this handler, so a signal sent to them too does not kill them).
        self._previous = signal.signal(self.signum, self._note)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._checked_step = trainer.global_step  # after a resume: the restored step

    def _note(self, signum: int, frame: Any) -> None:
        self.received = True  # only this: the save is collective and must happen where every rank is

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._checked_step:
            return  # inside gradient accumulation: no optimizer step since the last check
        self._checked_step = trainer.global_step
        if self.saved is not None or not trainer.strategy.reduce_boolean_decision(self.received, all=False):
            return
        checkpoint = next(c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint))
        self.saved = Path(checkpoint.dirpath) / f"{checkpoint.CHECKPOINT_NAME_LAST}{checkpoint.FILE_EXTENSION}"
        rank_zero_info(f"SaveAndRequeue: {self.signum.name} received; saving {self.saved} at step "
                       f"{trainer.global_step} and stopping.")
        trainer.save_checkpoint(self.saved)
        trainer.should_stop = True

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After the strategy's teardown: every rank's writes (a background save too) are complete."""
        if self.saved is None or not self.requeue or not trainer.is_global_zero:
            return
        job = slurm_job_id()
        if job is None:
            rank_zero_warn("SaveAndRequeue: not a SLURM job (no SLURM_JOB_ID), so nothing to requeue; "
                           f"resume with fit(ckpt_path='last') from {self.saved}.")
            return
        try:
            result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
            failure = None if result.returncode == 0 else f"exit code {result.returncode}: {result.stderr.strip()}"
        except OSError as error:  # no scontrol on this node
            failure = str(error)
        if failure is not None:
            rank_zero_warn(f"SaveAndRequeue: `scontrol requeue {job}` failed ({failure}); the checkpoint {self.saved} "
                           f"is complete: resubmit the job with ckpt_path='last'. Is the job requeueable "
                           f"(#SBATCH --requeue)?")
        else:
            rank_zero_info(f"SaveAndRequeue: requeued SLURM job {job}.")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None
