"""How the strategy's processes start: before the Trainer runs, and so that none outlives its launcher.

These jobs happen here because this is the only seam Lightning offers before it resolves
``fit(ckpt_path="last")`` (in ``Trainer._fit_impl``, before the strategy sets anything up):

* **Interrupted saves are finished first.** A crash between the two renames of a checkpoint
  replacement leaves only ``.last.ckpt.replaced`` and a complete ``.last.ckpt.partial``; left
  so, Lightning finds no ``last.ckpt`` and starts from step 0. Every process, one at a time
  under a lock file in each checkpoint directory, brings those directories to where their
  saves were going (``replacement.finish_interrupted``) and reports what it did and what
  unfinished saves it removed, before Lightning looks for checkpoints there. A directory another run
  holds (``checkpoint.run_lock``) is left alone: a fit stops there, in every process alike, naming that run.
* **``ckpt_path="last"`` is the last run's checkpoint.** Lightning looks only in this run's checkpoint
  directory, which for a ``ModelCheckpoint`` without ``dirpath`` (every shipped config's) is a new logger
  version's, empty: a run stopped and started again with ``--ckpt_path last`` began at step 0. Here "last" is
  resolved over every version of the logger's directory (``last_checkpoint``) and the choice is logged.
* **Each process gets its share of the node's cores.** Under torchrun (which sets ``OMP_NUM_THREADS=1`` for
  several processes per node) torch would run its host work (``CPUAdamW``'s step under ``offload_optimizer``)
  on one thread; under ``srun`` (no variable) every process would use every core and they would oversubscribe
  the node. So each process sets torch's intra-op threads to the node's cores / its processes on the node
  (at least 1) once, and logs it; an ``OMP_NUM_THREADS`` the user set is respected (``intra_op_threads``).
* **Workers die with their launcher.** ``python train.py`` with ``devices=N`` starts N-1 copies
  of the script (Lightning's ``_SubprocessScriptLauncher``); if the launcher is killed, a copy
  busy outside a collective would run on for good. Each copy asks the kernel to kill it when
  its parent goes (``PR_SET_PDEATHSIG``, Linux).
"""

from __future__ import annotations

import ctypes
import inspect
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.states import TrainerFn

from lightning_megatron.checkpoint.replacement import finish_interrupted_saves, report
from lightning_megatron.checkpoint.run_lock import check_not_in_use
from lightning_megatron.checkpoint.shared_storage import check_directories_agree

PARENT_PID_VARIABLE = "LIGHTNING_MEGATRON_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1
_threads_chosen = False  # once per process


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity: a SLURM or container limit), else the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def launcher_environment(pid: int) -> Optional[dict[str, str]]:
    """The environment process ``pid`` was started with (Linux's ``/proc/<pid>/environ``: what it later set
    itself is not in there); None where it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def set_by_torchrun(value: str) -> bool:
    """Whether ``OMP_NUM_THREADS=value`` is torchrun's own default for several processes per node ("1", set in
    its process when the user set nothing) rather than the user's choice."""
    if value != "1" or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    started_with = launcher_environment(os.getppid())  # torchrun is the parent of its workers
    return started_with is not None and "OMP_NUM_THREADS" not in started_with


def intra_op_threads(local_world_size: int) -> Optional[int]:
    """torch's intra-op threads for one of ``local_world_size`` processes on this node: the cores it may use
    shared out evenly, at least 1. None: ``OMP_NUM_THREADS`` holds the user's choice (torch read it at start)."""
    explicit = os.environ.get("OMP_NUM_THREADS", "").strip()
    if explicit and not set_by_torchrun(explicit):
        return None
    return max(1, available_cores() // max(1, local_world_size))


def set_intra_op_threads(local_world_size: int) -> None:
    """Once per process: set torch's intra-op threads as :func:`intra_op_threads` says, and log it."""
    global _threads_chosen
    if _threads_chosen:
        return
    _threads_chosen = True
    threads = intra_op_threads(local_world_size)
    if threads is None:
        rank_zero_info(f"torch intra-op threads: {torch.get_num_threads()} (OMP_NUM_THREADS="
                       f"{os.environ['OMP_NUM_THREADS']} as set)")
        return
    torch.set_num_threads(threads)
    rank_zero_info(f"torch intra-op threads: {threads} ({available_cores()} cores / {local_world_size} processes on "
                   f"this node; set OMP_NUM_THREADS to choose)")


def checkpoint_directories(trainer: Any) -> list[Path]:
    """Where the trainer's ``ModelCheckpoint`` callbacks save (those given a ``dirpath``; the default one
    is a new logger version's directory, empty at the start)."""
    return [Path(callback.dirpath) for callback in getattr(trainer, "checkpoint_callbacks", [])
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None
            and "://" not in str(callback.dirpath)]


def prepare_checkpoint_directories(trainer: Any) -> None:
    """In every process, before anything is read or written there: a fit refuses a checkpoint directory that
    another run holds (``run_lock``); where none does, interrupted saves are finished."""
    fitting = getattr(getattr(trainer, "state", None), "fn", None) == TrainerFn.FITTING
    for directory in checkpoint_directories(trainer):
        try:
            check_not_in_use(directory)
        except RuntimeError:
            if fitting:
                raise
            continue  # validate/test read only; another run's saves in flight are that run's to finish
        report(finish_interrupted_saves(directory))


def run_holding_directories(function: Callable, trainer: Any) -> Callable:
    """``function`` that releases the checkpoint directories' locks its run took, however it ends."""
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        finally:
            release = getattr(getattr(trainer, "strategy", None), "release_checkpoint_directories", None)
            if release is not None:
                release()
    return run


def check_directories_shared(trainer: Any) -> None:
    """Collective, once the process group exists: every rank sees the same checkpoints in the trainer's
    checkpoint directories (``checkpoint.shared_storage``). Else ``ckpt_path="last"``, resolved by each
    process on its own, would resume on the nodes that see a checkpoint and start afresh on the others."""
    check_directories_agree(checkpoint_directories(trainer))


def run_checkpoint_directories(trainer: Any) -> list[Path]:
    """Every directory a run of this trainer's root directory has saved checkpoints in: each ``ModelCheckpoint``'s
    ``dirpath``, or for one without (Lightning's default: ``<logger save_dir>/<name>/version_N/checkpoints``, a new
    version each run) the ``checkpoints`` folder of every version; ``<default_root_dir>/checkpoints`` without a
    logger."""
    directories = []
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        if not isinstance(callback, ModelCheckpoint):
            continue
        if callback.dirpath is not None:
            directories.append(Path(callback.dirpath))
        elif trainer.loggers:
            logger = trainer.loggers[0]
            runs = Path(logger.save_dir or trainer.default_root_dir) / str(logger.name or "")
            directories += sorted(runs.glob("*/checkpoints"))
        else:
            directories.append(Path(trainer.default_root_dir) / "checkpoints")
    return [directory for directory in dict.fromkeys(directories) if "://" not in str(directory)]


def last_checkpoint(trainer: Any) -> Optional[Path]:
    """What ``ckpt_path="last"`` resumes: the newest checkpoint in :func:`run_checkpoint_directories` (or an
    ``OnExceptionCheckpoint``'s file), a ``last*.ckpt`` where one was saved as late as another (``save_last``
    writes it after the step's other checkpoint); the default ``ModelCheckpoint`` keeps no ``last.ckpt``, only
    its newest ``epoch=..-step=..ckpt``. Interrupted saves in those directories are finished first, except in
    one a live run holds (``run_lock``): a fit refuses to resume that run's checkpoint while it trains (two runs
    would continue one), validate/test read its complete checkpoints. None when no run saved a checkpoint."""
    fitting = getattr(getattr(trainer, "state", None), "fn", None) == TrainerFn.FITTING
    found: list[Path] = []
    for directory in run_checkpoint_directories(trainer):
        try:
            check_not_in_use(directory)
        except RuntimeError as error:
            if fitting:
                raise RuntimeError(f'ckpt_path="last" would resume a run that is still training. {error}') from error
        else:
            report(finish_interrupted_saves(directory))
        if directory.is_dir():
            found += [path for path in directory.iterdir() if path.suffix == ".ckpt" and not path.name.startswith(".")]
    found += [Path(callback.ckpt_path) for callback in getattr(trainer, "callbacks", [])
              if isinstance(callback, OnExceptionCheckpoint) and Path(callback.ckpt_path).exists()]
    if not found:
        return None
    return max(found, key=lambda path: (path.stat().st_mtime, path.stem.startswith(ModelCheckpoint.CHECKPOINT_NAME_LAST),
                                        str(path)))


def resolve_last(function: Callable, args: tuple, kwargs: dict, trainer: Any) -> tuple[tuple, dict]:
    """``function``'s arguments with ``ckpt_path="last"`` replaced by :func:`last_checkpoint` (logged); unchanged
    when nothing was saved yet (Lightning then says so and starts afresh) or another path was given."""
    try:
        bound = inspect.signature(function).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    if trainer is None or bound.arguments.get("ckpt_path") != "last":
        return args, kwargs
    found = last_checkpoint(trainer)
    if found is None:
        return args, kwargs
    rank_zero_info(f'ckpt_path="last": resuming from {found} (the newest checkpoint this root directory\'s runs saved)')
    bound.arguments["ckpt_path"] = str(found)
    return bound.args, bound.kwargs


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
        set_intra_op_threads(getattr(getattr(trainer, "strategy", None), "num_processes", 0) or 1)
        prepare_checkpoint_directories(trainer)
        args, kwargs = resolve_last(function, args, kwargs, trainer)
        return run_holding_directories(function, trainer)(*args, **kwargs)

    def kill(self, signum) -> None:
        """Nothing to kill: this process started no others."""


class SubprocessLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher of script copies; the copies die with it, and they start after the checkpoint
    directories are in order."""

    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        prepare_checkpoint_directories(trainer)
        args, kwargs = resolve_last(function, args, kwargs, trainer)
        return super().launch(run_holding_directories(function, trainer), *args, trainer=trainer, **kwargs)

    def _call_children_scripts(self) -> None:
        os.environ[PARENT_PID_VARIABLE] = str(os.getpid())
        try:
            super()._call_children_scripts()
        finally:
            del os.environ[PARENT_PID_VARIABLE]
