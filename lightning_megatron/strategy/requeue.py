"""Stop on a signal at a step every rank agrees on: save ``last.ckpt``, stop, and say so with the exit code.

A signal reaches the ranks wherever each happens to be in its step. A sharded checkpoint is written by every rank
together (collectives before the rename), so saving inside a signal handler would leave ranks caught at different
collectives hanging or exchanging the wrong tensors (Lightning's own SIGTERM handler even broadcasts from inside the
handler; its SLURM requeue handler saves there). Here a handler only notes the signal; after each optimizer step the
ranks agree (one all-reduce of a few flags over the world) whether any of them got one, and if so all save
``last.ckpt`` in the ``ModelCheckpoint``'s folder at the same step, and stop:

* **SIGTERM, Ctrl-C (SIGINT)** (:class:`StopOnSignal`, which the strategy adds to every fit): after the save every
  rank raises :class:`StoppedBySignal`, Lightning's ``SIGTERMException`` (a ``SystemExit``) carrying the shell's code
  for a process ended by that signal, 128 + signum: **143** for SIGTERM, **130** for Ctrl-C. Lightning alone ends a
  SIGTERM'd run with code 0, so a scheduler (or a script's ``&&``) took a stopped job for a finished one. A second
  Ctrl-C (one second or more after the first: torchrun passes the terminal's one press on to its workers, which so
  get it twice) stops at once without saving, through Lightning's ``KeyboardInterrupt`` path.
* **a cluster's time-limit warning** (:class:`SaveAndRequeue`, ``#SBATCH --signal=USR1@90``): save, stop, and once
  every rank has finished its writes (after the strategy's teardown) global rank 0 requeues the job, whose next run
  resumes from ``ckpt_path="last"``; ``fit`` returns normally.

Where a launcher stands between the scheduler and the ranks: Lightning's (``python train.py`` with ``devices=N``)
leaves the signal to the ranks it reaches (one is enough: the agreement spreads it); torchrun passes SIGTERM and
SIGINT on to every worker, waits 30 s for them and then kills them (its ``shutdown_timeout``), and exits with 1 when a
worker exits non-zero. The handlers are installed at ``on_train_start`` (after Lightning's own, which they replace for
the fit; Lightning puts its originals back at the end): a signal before the first step ends the process as usual.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
AGAIN_AFTER_SECONDS = 1.0  # a second Ctrl-C sooner than this is the first one passed on by torchrun


def exit_code(signum: int) -> int:
    """The shell's exit status of a process ended by ``signum``: 128 + signum (143 for SIGTERM, 130 for SIGINT)."""
    return 128 + int(signum)


class StoppedBySignal(SIGTERMException):
    """Raised on every rank once the signal's checkpoint is saved: a ``SystemExit`` whose code is
    :func:`exit_code` of the signal, so the process ends with it unless the script catches it."""

    def __init__(self, signum: int, saved: Optional[Path]) -> None:
        super().__init__(exit_code(signum))
        self.signum, self.saved = signal.Signals(signum), saved


def slurm_job_id() -> Optional[str]:
    """The id ``scontrol requeue`` takes: an array task's ``<array job>_<task>``, else ``SLURM_JOB_ID``."""
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job is not None and task is not None:
        return f"{array_job}_{task}"
    return os.environ.get("SLURM_JOB_ID")


def _say(message: str) -> None:
    """One line on stderr from inside a signal handler (``os.write``: a buffered stream may be mid-write)."""
    os.write(2, f"lightning-megatron: {message}\n".encode())


class StopOnSignal(L.Callback):
    """On SIGTERM or Ctrl-C (any rank): at the next optimizer step every rank saves ``last.ckpt`` and the run ends
    with exit code 128 + signum (:class:`StoppedBySignal`). The strategy adds one to every fit that has none.

    ``signals``: the signals that stop the run this way. Without a ``ModelCheckpoint`` (``enable_checkpointing=False``)
    the run stops without a checkpoint, and says so.
    """

    def __init__(self, signals: Iterable[int | str] = STOP_SIGNALS) -> None:
        self.stop_signals = [_signal(s) for s in signals]
        self.received: dict[signal.Signals, float] = {}  # signal -> when it first came (time.monotonic)
        self.saved: Optional[Path] = None  # where the signal's checkpoint went, once saved
        self._previous: dict[signal.Signals, Any] = {}
        self._checked_step = -1

    @property
    def watched(self) -> list[signal.Signals]:
        """Every signal this callback notes, in the order that decides which one a stop is for."""
        return self.stop_signals

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._checked_step = trainer.global_step  # after a resume: the restored step
        self.received, self.saved = {}, None
        # After Lightning's signal connector (it registers just before training): its SIGTERM handler broadcasts.
        self._install(self.stop_signals)

    def _install(self, signals: Iterable[signal.Signals]) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers (a fit run from a thread keeps the usual behaviour)
        for signum in signals:
            self._previous[signum] = signal.signal(signum, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        """Only note it: the save is collective and must happen where every rank is."""
        signum = signal.Signals(signum)
        first = self.received.get(signum)
        if first is None:
            self.received[signum] = time.monotonic()
            self._announce(signum)
        elif signum == signal.SIGINT and signum in self.stop_signals and \
                time.monotonic() - first >= AGAIN_AFTER_SECONDS:
            _say("Ctrl-C again: stopping now, without saving.")
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt

    def _announce(self, signum: signal.Signals) -> None:
        what = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signum.name
        again = "; Ctrl-C again to stop now, without saving" if signum == signal.SIGINT else ""
        _say(f"{what} received (pid {os.getpid()}): the ranks will save last.ckpt at the next optimizer step and "
             f"stop{again}.")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._checked_step:
            return  # inside gradient accumulation: no optimizer step since the last check
        self._checked_step = trainer.global_step
        if self.saved is not None:
            return
        signum = self._agreed_signal(trainer)
        if signum is not None:
            self._stop(trainer, signum)

    def _agreed_signal(self, trainer: L.Trainer) -> Optional[signal.Signals]:
        """The first watched signal any rank has received (the same on every rank), else None."""
        flags = torch.tensor([signum in self.received for signum in self.watched], dtype=torch.int32,
                             device=trainer.strategy.root_device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return next((signum for signum, flag in zip(self.watched, flags.tolist()) if flag), None)

    def _save_last(self, trainer: L.Trainer, signum: signal.Signals) -> Optional[Path]:
        checkpoint = next((c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)
                           and c.dirpath is not None), None)
        if checkpoint is None:
            rank_zero_warn(f"{signum.name}: stopping at step {trainer.global_step} without a checkpoint: the Trainer "
                           f"has no ModelCheckpoint (enable_checkpointing=False).")
            return None
        path = Path(checkpoint.dirpath) / f"{checkpoint.CHECKPOINT_NAME_LAST}{checkpoint.FILE_EXTENSION}"
        rank_zero_info(f"{signum.name}: saving {path} at step {trainer.global_step} on every rank.")
        trainer.save_checkpoint(path)
        return path

    def _stop(self, trainer: L.Trainer, signum: signal.Signals) -> None:
        self.saved = self._save_last(trainer, signum)
        resume = f"resume with fit(ckpt_path='last') (or --ckpt_path last) from {self.saved}" if self.saved else \
            "nothing was saved"
        rank_zero_info(f"{signum.name}: stopped at step {trainer.global_step}; {resume}. Exit code "
                       f"{exit_code(signum)} (128 + {signum.name}).")
        raise StoppedBySignal(signum, self.saved)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Put back what this replaced, where it is still in place (Lightning's teardown restores its originals)."""
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._note and previous is not None:
                signal.signal(signum, previous)
        self._previous = {}


class SaveAndRequeue(StopOnSignal):
    """On ``signum`` (any rank): save ``last.ckpt`` at the next optimizer step on every rank, stop, requeue.
    SIGTERM and Ctrl-C stop as :class:`StopOnSignal` says.

    Args:
        signum: the signal the cluster sends before the time limit (name or number; SLURM: ``--signal=USR1@90``).
        requeue: after the save, global rank 0 runs ``scontrol requeue <job id>``; ``False``: save and stop only
            (the batch script requeues, or a person does).

    Needs a ``ModelCheckpoint`` (its ``dirpath`` receives ``last.ckpt``; a later ``fit(ckpt_path="last")`` finds
    it there). It installs its handler before Lightning's, so Lightning's own SLURM requeue handler stays out.
    """

    def __init__(self, signum: int | str = "SIGUSR1", requeue: bool = True) -> None:
        self.signum = _signal(signum)
        super().__init__([s for s in STOP_SIGNALS if s != self.signum])
        self.requeue = requeue
        self.requeued = False

    @property
    def watched(self) -> list[signal.Signals]:
        return [self.signum, *self.stop_signals]  # the time limit first: a requeue outranks a plain stop

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not any(isinstance(callback, ModelCheckpoint) for callback in trainer.checkpoint_callbacks):
            raise ValueError("SaveAndRequeue saves last.ckpt in a ModelCheckpoint's folder, and the Trainer has none: "
                             "add ModelCheckpoint(dirpath=..., save_last=True) to its callbacks (and enable_checkpointing).")
        self.received, self.saved = {}, None
        # Before Lightning's signal connector looks (so it adds no SIGUSR1 handler of its own) and before the
        # DataLoader workers are forked (they inherit this handler, so a signal sent to them too does not kill them).
        self._install([self.signum])

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        received = self.received.copy()  # a time-limit signal during set-up still counts
        super().on_train_start(trainer, pl_module)
        self.received = received

    def _stop(self, trainer: L.Trainer, signum: signal.Signals) -> None:
        if signum != self.signum:
            return super()._stop(trainer, signum)
        self.saved = self._save_last(trainer, signum)
        rank_zero_info(f"SaveAndRequeue: {signum.name}: saved at step {trainer.global_step}; stopping.")
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


def _signal(value: int | str) -> signal.Signals:
    return signal.Signals[value] if isinstance(value, str) else signal.Signals(value)


def add_stop_on_signal(trainer: L.Trainer) -> None:
    """Give a fit the SIGTERM/Ctrl-C stop (:class:`StopOnSignal`) unless one of its callbacks is one already."""
    if not any(isinstance(callback, StopOnSignal) for callback in trainer.callbacks):
        trainer.callbacks.append(StopOnSignal())
