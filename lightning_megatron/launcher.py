"""How the strategy's processes start: before the Trainer runs, and so that none outlives its launcher.

Two jobs happen here because this is the only seam Lightning offers before it resolves
``fit(ckpt_path="last")`` (in ``Trainer._fit_impl``, before the strategy sets anything up):

* **Interrupted saves are finished first.** A crash between the two renames of a checkpoint
  replacement leaves only ``.last.ckpt.replaced`` and a complete ``.last.ckpt.partial``; left
  so, Lightning finds no ``last.ckpt`` and starts from step 0. Every process, one at a time
  under a lock file in each checkpoint directory, brings those directories to where their
  saves were going (``replacement.finish_interrupted``) and reports what it did and what
  unfinished saves it removed, before Lightning looks for checkpoints there.
* **Workers die with their launcher.** ``python train.py`` with ``devices=N`` starts N-1 copies
  of the script (Lightning's ``_SubprocessScriptLauncher``); if the launcher is killed, a copy
  busy outside a collective would run on for good. Each copy asks the kernel to kill it when
  its parent goes (``PR_SET_PDEATHSIG``, Linux).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.launcher import _Launcher

from lightning_megatron.checkpoint.replacement import finish_interrupted_saves, report
from lightning_megatron.checkpoint.shared_storage import check_directories_agree

PARENT_PID_VARIABLE = "LIGHTNING_MEGATRON_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def checkpoint_directories(trainer: Any) -> list[Path]:
    """Where the trainer's ``ModelCheckpoint`` callbacks save (those given a ``dirpath``; the default one
    is a new logger version's directory, empty at the start)."""
    return [Path(callback.dirpath) for callback in getattr(trainer, "checkpoint_callbacks", [])
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None
            and "://" not in str(callback.dirpath)]


def prepare_checkpoint_directories(trainer: Any) -> None:
    for directory in checkpoint_directories(trainer):
        report(finish_interrupted_saves(directory))


def check_directories_shared(trainer: Any) -> None:
    """Collective, once the process group exists: every rank sees the same checkpoints in the trainer's
    checkpoint directories (``checkpoint.shared_storage``). Else ``ckpt_path="last"``, resolved by each
    process on its own, would resume on the nodes that see a checkpoint and start afresh on the others."""
    check_directories_agree(checkpoint_directories(trainer))


def die_with_launcher() -> None:
    """In a copy of the script that our launcher started: be killed when the launcher dies."""
    parent = os.environ.pop(PARENT_PID_VARIABLE, None)
    if parent is None or not sys.platform.startswith("linux") or os.getppid() != int(parent):
        return  # not our child (or the launcher is gone already: the rendezvous then fails on its own)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(parent):  # the launcher died before the request took effect
        os._exit(1)


class InPlaceLauncher(_Launcher):
    """For processes something else started (torchrun, SLURM, our own launcher's copies): run the function
    here, after the checkpoint directories are in order."""

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        prepare_checkpoint_directories(trainer)
        return function(*args, **kwargs)

    def kill(self, signum) -> None:
        """Nothing to kill: this process started no others."""


class SubprocessLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher of script copies; the copies die with it, and they start after the checkpoint
    directories are in order."""

    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        prepare_checkpoint_directories(trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def _call_children_scripts(self) -> None:
        os.environ[PARENT_PID_VARIABLE] = str(os.getpid())
        try:
            super()._call_children_scripts()
        finally:
            del os.environ[PARENT_PID_VARIABLE]
