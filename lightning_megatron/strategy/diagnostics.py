"""Nothing lost, nothing silent: what a failing or wasteful run says about itself.

* ``PhaseRecord`` keeps a cheap record of what the strategy is doing (a stack of hook names
  and the global step), set by the ``records_phase`` decorator on the strategy's hooks.
  When a collective times out, ``explain_collective_failure`` attaches a note to the
  exception (printed as its last lines): which rank, what it was waiting in, at which
  step, after how long, the likely cause and the fix. The backend's own message names a
  gloo/NCCL operation, never what was waiting.
* ``check_process_count``: under torchrun (or any launcher that starts the processes),
  ``devices`` and ``num_nodes`` must match what the launcher started (SLURM's tasks: read from
  its own variables); raised on every rank before any collective.
* ``warn_if_replicated``: a model without a tensor-parallel plan at tp > 1 is fully replicated.
* ``cleanup_after_failure`` and ``meta_model_left_in_place``: teardown after an error never
  raises over that error (Lightning's teardown moves a model still on the meta device to
  the CPU, which fails with "Cannot copy out of meta tensor").
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Generator, Iterator, Mapping, Optional

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

log = logging.getLogger(__name__)

# Megatron-LM's default; torch's default for gloo is 30 minutes, which a stalled rank costs every other rank.
DEFAULT_TIMEOUT = timedelta(minutes=10)

# What each recorded phase waits on, in the words a user needs to find the culprit.
PHASES = {
    "setup": "setting up the model: seed broadcast, pipeline stages, ZeRO-3 sharding, barriers",
    "training step": "forward/backward: tensor-parallel and pipeline collectives, gradient buckets over dp",
    "optimizer step": "gradient reduction over dp / global-norm clipping / ZeRO all-gather",
    "validation step": "forward only: tensor-parallel and pipeline collectives",
    "test step": "forward only: tensor-parallel and pipeline collectives",
    "predict step": "forward only: tensor-parallel and pipeline collectives",
    "saving checkpoint": "every rank writes its shards, then the ranks agree before the rename",
    "loading checkpoint": "the ranks agree on the files, then every rank reads its shards",
    "barrier": "Lightning's barrier: waiting for every rank to arrive",
    "metric reduction": "self.log(..., sync_dist=True): a value reduced over the data-parallel group",
    "decision": "the ranks agreeing on a decision (checkpointing, early stopping)",
    "broadcast": "an object broadcast from rank 0",
    "teardown": "barrier at teardown: every rank leaves together",
}


@dataclass(frozen=True)
class Phase:
    kind: str
    step: Optional[int]
    detail: Optional[str] = None

    def describe(self) -> str:
        numbered = self.step is not None and self.kind in ("training step", "optimizer step")
        name = f"{self.kind} {self.step}" if numbered else self.kind
        if self.detail:
            name += f" {self.detail}"
        if self.step is not None and not numbered:
            name += f" at global step {self.step}"
        return f"{name} ({PHASES[self.kind]})" if self.kind in PHASES else name


class PhaseRecord:
    """The strategy's current phases (innermost last), the one an error left, and the last one left normally."""

    def __init__(self) -> None:
        self._stack: list[Phase] = []
        self._failed_in: Optional[list[Phase]] = None
        self._last: Optional[Phase] = None

    def enter(self, phase: Phase) -> None:
        if not self._stack:
            self._failed_in = None  # an error caught by the user earlier: this is a fresh start
        self._stack.append(phase)

    def leave(self, failed: bool) -> None:
        if not failed:
            self._failed_in = None  # an error inside was handled
        elif self._failed_in is None:
            self._failed_in = list(self._stack)  # the innermost phase sees the error first
        self._last = self._stack.pop() if self._stack else None

    def describe(self) -> str:
        """Where the error struck, in words: the innermost phase, and the phases around it."""
        stack = self._failed_in or self._stack
        if not stack:
            if self._last is None:
                return "the Lightning loop, before any of the strategy's hooks ran"
            return (f"the Lightning loop after {self._last.describe()}, outside the strategy's hooks "
                    f"(a callback, torchmetrics' sync, or a collective in the user's code)")
        inner, outer = stack[-1], stack[:-1]
        return inner.describe() + (f", inside {' > '.join(p.kind for p in outer)}" if outer else "")


def _global_step(strategy) -> Optional[int]:
    module = getattr(strategy, "lightning_module", None)
    trainer = getattr(module, "_trainer", None) if module is not None else None
    return trainer.global_step if trainer is not None else None


def records_phase(kind: str, detail: Optional[Callable[..., Any]] = None) -> Callable:
    """Decorate a strategy hook: while it runs, ``strategy._phases`` says ``kind`` (and the global step).

    ``detail(*args, **kwargs)`` names what the hook works on (a checkpoint path, a barrier's name).
    """

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def wrapper(strategy, *args: Any, **kwargs: Any) -> Any:
            phases: Optional[PhaseRecord] = getattr(strategy, "_phases", None)
            if phases is None:  # a subclass whose __init__ skipped ours
                return method(strategy, *args, **kwargs)
            about = detail(*args, **kwargs) if detail is not None else None
            phases.enter(Phase(kind, _global_step(strategy), None if about is None else str(about)))
            failed = True
            try:
                result = method(strategy, *args, **kwargs)
                failed = False
                return result
            finally:
                phases.leave(failed)

        return wrapper

    return decorate


def argument(index: int, name: str) -> Callable[..., Optional[str]]:
    """``detail=`` naming a hook's argument (a checkpoint path, a barrier's name), quoted; ``None`` if absent."""

    def detail(*args: Any, **kwargs: Any) -> Optional[str]:
        value = args[index] if len(args) > index else kwargs.get(name)
        return None if value is None else repr(str(value))

    return detail


# ------------------------------------------------------------------ collective failures
_TIMEOUT = re.compile(r"timed out|timeout|watchdog", re.IGNORECASE)
# NCCL's "communicator was aborted": its watchdog (``processes.surface_nccl_timeouts``) aborted the group after a
# timeout (then named in the message's "Original reason") or an asynchronous NCCL error (a peer that went away).
_LOST = re.compile(r"connection (closed|reset) by peer|broken pipe|socket closed|communicator was aborted",
                   re.IGNORECASE)
_BACKEND = re.compile(r"gloo|nccl|c10d|processgroup|collective|operation to complete|pair closure", re.IGNORECASE)


def _chain(exception: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exception is not None and id(exception) not in seen:
        seen.add(id(exception))
        yield exception
        exception = exception.__cause__ or exception.__context__


def collective_failure(exception: BaseException) -> Optional[str]:
    """``"timeout"`` for a distributed timeout (gloo, NCCL watchdog, c10d store), ``"lost"`` for a peer
    that went away, else ``None``. A DataLoader's or the user's own timeout is not one."""
    for error in _chain(exception):
        if not isinstance(error, RuntimeError):
            continue
        message = str(error)
        from_backend = isinstance(error, getattr(dist, "DistError", ())) or _BACKEND.search(message)
        if not from_backend:
            continue
        if _TIMEOUT.search(message):  # gloo: "Timed out waiting ...", "Application timeout caused pair closure"
            return "timeout"
        if _LOST.search(message):
            return "lost"
    return None


def explain_collective_failure(exception: BaseException, phases: PhaseRecord, *, rank: int, world_size: int,
                               timeout: Optional[timedelta]) -> Optional[str]:
    """Attach what was waiting to a distributed timeout (or a lost peer); returns the note, or ``None``."""
    kind = collective_failure(exception)
    if kind is None or getattr(exception, "_megatron_3d_explained", False):
        return None
    where = phases.describe()
    limit = timeout if timeout is not None else "the torch default"
    if kind == "timeout":
        note = (
            f"Megatron3DStrategy: rank {rank} of {world_size} timed out after waiting {limit} (the strategy's "
            f"timeout=) in {where}.\n"
            f"The error above names the backend operation, not the cause: another rank never joined this "
            f"collective. It stalled (alive but stuck: data loading, a slow filesystem, a deadlock, a branch "
            f"only some ranks take) or died.\n"
            f"Fix: find the stalled rank (the rank whose log does not end with this message; "
            f"`py-spy dump --pid <pid>` shows where it is stuck). If the wait is legitimate (checkpoints on a slow "
            f"filesystem, a long first step), raise Megatron3DStrategy(timeout=timedelta(minutes=...))."
        )
    else:
        note = (
            f"Megatron3DStrategy: rank {rank} of {world_size} lost its connection to another rank in {where}.\n"
            f"That rank exited first: it crashed, was killed, or timed out (timeout={limit}) and closed its "
            f"connections. Its own log holds the first error; this one is a consequence."
        )
    if hasattr(exception, "add_note"):  # Python 3.11: printed as the traceback's last lines
        exception.add_note(note)
    else:
        log.error(note)
    exception._megatron_3d_explained = True
    return note


# ------------------------------------------------------------------ launch and plan checks
def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    return int(value) if value is not None and value.isdigit() else None


def _slurm_job(environment) -> bool:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return isinstance(environment, SLURMEnvironment)


def check_process_count(environment, devices: int, num_nodes: int) -> None:
    """Under a launcher that starts the processes (torchrun, SLURM, ...), ``devices`` and ``num_nodes`` must
    describe them: one process per device. Raised on every rank before any collective (Lightning's DDP
    raises too; a process beyond ``devices`` would otherwise index a device that does not exist)."""
    if environment is None or not environment.creates_processes_externally:
        return  # the strategy starts one process per device itself
    if _slurm_job(environment):
        _check_slurm_tasks(devices, num_nodes)
    world, local = _env_int("WORLD_SIZE"), _env_int("LOCAL_WORLD_SIZE")
    expected = devices * num_nodes
    if (world is not None and world != expected) or (local is not None and local != devices):
        started = f"{world} processes" + (f" ({local} on this node)" if local is not None else "")
        nodes = world // local if world and local else num_nodes
        name = type(environment).__name__
        launcher = "torchrun" if name == "TorchElasticEnvironment" else f"the launcher ({name})"
        raise ValueError(
            f"Megatron3DStrategy: {launcher} started {started}, but the Trainer was given devices={devices} and "
            f"num_nodes={num_nodes}, i.e. {expected} process{'es' if expected != 1 else ''}. Each process "
            f"drives one device, so these must agree: pass Trainer(devices={local or devices}, num_nodes={nodes}), "
            f"or start `torchrun --nproc-per-node={devices} --nnodes={num_nodes}`."
        )
    environment.validate_settings(num_devices=devices, num_nodes=num_nodes)  # SLURM's own checks, and others'


def _check_slurm_tasks(devices: int, num_nodes: int) -> None:
    """SLURM's tasks (``SLURM_NTASKS`` over ``SLURM_NNODES`` nodes, ``SLURM_NTASKS_PER_NODE`` on each) must be
    ``num_nodes`` x ``devices`` (Lightning's own check compares per-node counts only, and says nothing of an
    uneven ``--ntasks``). ``WORLD_SIZE`` is no guide here: a first fit in this process sets it."""
    tasks, per_node, nodes = _env_int("SLURM_NTASKS"), _env_int("SLURM_NTASKS_PER_NODE"), _env_int("SLURM_NNODES")
    expected = devices * num_nodes
    if (tasks is None or tasks == expected) and per_node in (None, devices) and nodes in (None, num_nodes):
        return
    layout = ", ".join(f"{name}={value}" for name, value in (("SLURM_NTASKS", tasks), ("SLURM_NNODES", nodes),
                                                              ("SLURM_NTASKS_PER_NODE", per_node)) if value is not None)
    fix_devices = per_node if per_node is not None else devices
    fix_nodes = nodes if nodes is not None else num_nodes
    raise ValueError(
        f"Megatron3DStrategy: SLURM started {tasks} tasks ({layout}), but the Trainer was given devices={devices} "
        f"and num_nodes={num_nodes}, i.e. {expected} process{'es' if expected != 1 else ''}. Each task drives one "
        f"device, so these must agree: pass Trainer(devices={fix_devices}, num_nodes={fix_nodes}) "
        f"(`--trainer.devices $SLURM_NTASKS_PER_NODE --trainer.num_nodes $SLURM_NNODES` on the command line), or "
        f"submit with `#SBATCH --nodes={num_nodes} --ntasks-per-node={devices}` (and no --ntasks)."
    )


def warn_if_replicated(module: nn.Module, plan: Mapping[str, object], tensor_parallel_size: int,
                       data_parallel_size: int) -> Optional[str]:
    """At tp > 1, a model whose plan splits no layer is replicated on every tp rank: say so, once, on rank 0."""
    from lightning_megatron.tensor_parallel.plan import SWAP_STYLES

    splits = [style for style in plan.values() if not isinstance(style, str) or style in SWAP_STYLES]  # style objects split
    if tensor_parallel_size == 1 or splits:
        return None
    declared = ("declares no tensor_parallel_plan()" if not hasattr(module, "tensor_parallel_plan")
                else "has a tensor_parallel_plan() that splits no layer" + (f" ({dict(plan)})" if plan else " (empty)"))
    tp = tensor_parallel_size
    message = (
        f"Megatron3DStrategy: {type(module).__name__} {declared}, so at tensor_parallel_size={tp} it is fully "
        f"replicated: each of the {tp} tensor-parallel ranks holds and computes the whole model, {tp}x the memory "
        f"and compute for no speed-up. Declare tensor_parallel_plan() (module-name patterns -> 'column' / 'row' / "
        f"'vocab'), or use tensor_parallel_size=1 and {tp}x more data parallelism "
        f"(data_parallel_size={data_parallel_size * tp})."
    )
    rank_zero_warn(message)
    return message


# ------------------------------------------------------------------ teardown after a failure
@contextlib.contextmanager
def cleanup_after_failure(failed: bool, rank: int, what: str) -> Generator[None, None, None]:
    """After a failure, an error while cleaning up is logged, never raised over the error being handled."""
    try:
        yield
    except Exception as error:
        if not failed:
            raise
        log.warning(f"[rank {rank}] Megatron3DStrategy: {what} failed too, after the run's error "
                    f"({type(error).__name__}: {error}); that error follows and is the one to fix.")


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


@contextlib.contextmanager
def meta_model_left_in_place(strategy) -> Generator[None, None, None]:
    """Around Lightning's ``Strategy.teardown``, which moves the model to the CPU: a model still (partly) on the
    meta device (set-up failed before materialisation) has nothing to copy, so only its real tensors move and
    Lightning is shown no module."""
    module = strategy.lightning_module
    if module is None or not has_meta_tensors(module):
        yield
        return
    module._apply(lambda t: t if t.is_meta else t.cpu())
    strategy._lightning_module = None
    try:
        yield
    finally:
        strategy._lightning_module = module
