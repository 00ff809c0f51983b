"""Save and restore one rank's training state as a layout-free sharded checkpoint.

``Megatron3DStrategy`` calls these from Lightning's checkpoint hooks: the tensors go to
``checkpoint.sharded`` as ``ShardedEntry`` views of what this rank holds (nothing is
gathered), the rest of Lightning's checkpoint dict goes to ``trainer_state.pt``. Restoring
builds the entries of the *current* layout and lets DCP read the overlapping boxes, so
tp, pp, virtual pp, dp and the ZeRO stage may all differ from the saving run.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_megatron.checkpoint import entries as E
from lightning_megatron.checkpoint.base import BASE_KEY, base_reference, check_module_base, trained_only
from lightning_megatron.checkpoint.sharded import (
    BackgroundSaver,
    SavedCheckpoint,
    check_compatible,
    open_sharded,
    read_tensors,
    save_sharded,
    verify_checksums,
)
from lightning_megatron.checkpoint.pieces import ShardedEntry
from lightning_megatron.checkpoint.replacement import check_replaceable, finish_interrupted, report
from lightning_megatron.optim.main_params import MainParamOptimizer
from lightning_megatron.parallel.agree import all_gather_objects
from lightning_megatron.parallel.agree import on_every_rank
from lightning_megatron.parallel.random import TensorParallelRNG
from lightning_megatron.parallel.state import ParallelState

LAYOUT_KEY = "megatron_3d_layout"
RNG_KEY = "megatron_3d_rng_states"


@dataclass
class RankTraining:
    """What one rank trains: its part of the module, the optimizers, the layout and the fp32 main pieces."""

    module: nn.Module
    optimizers: list[Optimizer]
    state: ParallelState
    main_params: Optional[MainParamOptimizer] = None
    rng: Optional[TensorParallelRNG] = None

    def placements(self) -> E.Placements:
        return E.parameter_placements(self.module, self.main_params)

    def model_entries(self) -> dict:
        return E.model_entries(self.module)

    def state_entries(self) -> dict:
        """What a checkpoint holds beyond the model: the fp32 main pieces and every optimizer's state."""
        placements = self.placements()
        entries = E.main_param_entries(self.main_params, placements)
        for index, optimizer in enumerate(self.optimizers):
            entries.update(E.optimizer_entries(optimizer, index, placements))
        return entries


def _rng_state(rng: Optional[TensorParallelRNG]) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if rng is not None:
        state["tensor_parallel"] = rng.get_state()
    return state


def set_rng_state(state: dict[str, Any], rng: Optional[TensorParallelRNG]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if rng is not None and "tensor_parallel" in state:
        rng.set_state(state["tensor_parallel"])


def save_training_state(path, checkpoint: dict[str, Any], training: RankTraining, info: dict[str, Any], *,
                        saver: Optional[BackgroundSaver] = None, checksums: bool = False) -> None:
    """Collective. ``checkpoint`` is Lightning's dict (its ``state_dict`` and ``optimizer_states`` as the
    strategy returned them: empty and hyper-parameters only); the tensors come from ``training`` itself.
    With a ``saver`` the files are written in the background.

    Before anything is written every rank learns, in the one gather the save needs anyway, whether
    any rank holds non-finite values or finds ``path`` taken by something that is not a checkpoint;
    then all of them raise the same error and nothing on disk changes."""
    checkpoint.pop("state_dict", None)
    tensors = training.model_entries()
    reference = base_reference(training.module)
    if reference is not None:  # adapter-only: the frozen base is read back from the reference (checkpoint.base)
        tensors = trained_only(tensors)
        checkpoint[BASE_KEY] = info["base"] = reference
    if "optimizer_states" in checkpoint:  # not for weights-only saves
        tensors.update(training.state_entries())
    optimizers = checkpoint.get("optimizer_states", [])
    problem = _save_problem(path, tensors)
    mine = (_rng_state(training.rng), [hyper["param_names"] for hyper in optimizers], problem)
    per_rank = all_gather_objects(mine)
    target_taken = per_rank[0][2] if isinstance(per_rank[0][2], FileExistsError) else None
    if target_taken is not None:
        raise FileExistsError(str(target_taken))
    diverged = [f"Rank {rank}: {problem}" for rank, (_, _, problem) in enumerate(per_rank) if problem is not None]
    if diverged:
        raise RuntimeError("\n".join(diverged[:4]))
    rng_states = [rng for rng, _, _ in per_rank]
    for index, hyper in enumerate(optimizers):  # each pipeline stage knows only its own parameters
        hyper["param_names"] = [sorted({name for _, names, _ in per_rank for name in names[index][group]})
                                for group in range(len(hyper["param_names"]))]
    layout = asdict(training.state.config)
    trainer_state = {**checkpoint, LAYOUT_KEY: layout, RNG_KEY: rng_states}
    save = saver.save if saver is not None else save_sharded
    save(path, tensors, trainer_state, {**info, "layout": layout, "world_size": len(rng_states)}, checksums=checksums)


def nonfinite_names(tensors: Mapping[str, Any]) -> list[str]:
    """Names of the tensors (or ``ShardedEntry`` pieces) holding a NaN or an infinity: one device sync in all."""
    named = [(name, piece) for name, value in tensors.items()
             for piece in (value.pieces.values() if isinstance(value, ShardedEntry) else [value])
             if isinstance(piece, Tensor) and piece.is_floating_point() and piece.numel()]
    if not named:
        return []
    # A sum is one cheap pass and is non-finite whenever an element is; a finite tensor whose sum overflows
    # (values near 1e38) is told apart by the exact test, run only for the tensors whose sum is not finite.
    sums = torch.stack([piece.sum(dtype=torch.float32) for _, piece in named]).isfinite().cpu()
    return list(dict.fromkeys(name for (name, piece), ok in zip(named, sums.tolist())
                              if not ok and not torch.isfinite(piece).all()))


def nonfinite_message(names: list[str], *, doing: str) -> str:
    shown = ", ".join(repr(name) for name in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"{doing}: {shown} hold NaN or infinite values."


def check_full_checkpoint(checkpoint: Mapping[str, Any], path) -> None:
    """A full (single-file) checkpoint's gathered weights, the same on every rank, must be finite, and the
    path must be free or a checkpoint: then every rank reaches the same verdict without a collective."""
    if _is_local(path):
        check_replaceable(path)
    bad = nonfinite_names(checkpoint.get("state_dict", {}))
    if bad:
        raise RuntimeError(_diverged(bad, path))


def _is_local(path) -> bool:
    return "://" not in str(path)


def _save_problem(path, tensors: Mapping[str, Any]) -> Union[None, str, FileExistsError]:
    """Why this rank must not save (None if it may): rank zero finds the target is not ours to replace
    (a ``FileExistsError``), or this rank's state diverged (a message)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            check_replaceable(path)
        except FileExistsError as error:
            return error
    bad = nonfinite_names(tensors)
    return _diverged(bad, path) if bad else None


def _diverged(names: list[str], path) -> str:
    return nonfinite_message(names, doing=f"Refusing to save checkpoint {path}") + (
        " Training diverged before this save; the checkpoints already on disk were left as they are.")


def _agree(check: Callable[[], Any]) -> Any:
    """Run a check that may fail on some ranks only, then fail on all of them (or none) before the next
    collective, so that no rank waits forever for one that gave up."""
    return on_every_rank(check, doing="load the checkpoint")


def load_model_state(path, training: RankTraining, *,
                     verify: str = "recorded") -> tuple[SavedCheckpoint, dict[str, Any]]:
    """Collective: read this rank's model tensors (and fp32 main pieces) in place; return the checkpoint and
    Lightning's part of it. Every check that can fail runs before the first collective, among them the
    comparison of the files with their recorded checksums as ``verify`` says (``check_content``). A save this
    path's name was in the middle of is finished first (``finish_interrupted``), and the loaded tensors
    must be finite."""
    _agree(lambda: _finish_interrupted_on_rank_zero(path))
    strict = getattr(training.module, "strict_loading", True)  # LightningModule.strict_loading
    saved, trainer_state, wanted, model_keys = _agree(lambda: _plan_model_load(path, training, strict, verify))
    available = saved.tensors()
    expected = {key for keys in all_gather_objects(model_keys) for key in keys}  # every stage's, the same on every rank
    unexpected = sorted(key for key in available if key.startswith(f"{E.MODEL}/") and key not in expected)
    if unexpected and strict:
        shown = ", ".join(repr(key) for key in unexpected[:5]) + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
        raise RuntimeError(f"Checkpoint {saved.path} holds model tensors this model does not have: {shown}. It was "
                           f"saved from another model ({saved.info.get('model')}); to load the matching part only, "
                           f"set strict_loading = False on the LightningModule.")
    read_tensors(saved, wanted)
    if training.main_params is not None:
        training.main_params.copy_from_model()
        mains = E.main_param_entries(training.main_params, training.placements())
        mains = {key: entry for key, entry in mains.items() if key in available}
        read_tensors(saved, mains)
        wanted = {**wanted, **mains}
    _agree(lambda: _check_finite_after_load(saved, wanted))
    return saved, trainer_state


def _finish_interrupted_on_rank_zero(path) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        report(finish_interrupted(path))


def _check_finite_after_load(saved: SavedCheckpoint, entries: Mapping[str, Any]) -> None:
    bad = nonfinite_names(entries)
    if bad:
        raise RuntimeError(nonfinite_message(bad, doing=f"Checkpoint {saved.path} is unusable") + (
            f" Its files were damaged (`lightning-megatron checkpoint verify {saved.path}` compares them with the "
            f"checksums its save recorded, if it did), or it was saved after training diverged. Load an earlier "
            f"checkpoint."))


def _plan_model_load(path, training: RankTraining, strict: bool,
                     verify: str) -> tuple[SavedCheckpoint, dict[str, Any], dict, list]:
    saved = open_sharded(path)
    check_content(saved, verify)
    trainer_state = saved.trainer_state()
    available = saved.tensors()
    wanted = {}
    model_entries = training.model_entries()
    reference = trainer_state.get(BASE_KEY)
    check_module_base(reference, training.module, where=f"Checkpoint {saved.path}")
    if reference is not None:  # the base is this module's own, loaded from the same pretrained weights
        model_entries = trained_only(model_entries)
    for key, entry in model_entries.items():
        if not strict and key not in available:
            continue  # strict_loading=False: this tensor keeps its initial value
        # fp32 parameters take the fp32 main copy when a 16-bit run saved one: exact, not rounded.
        main_key = f"{E.MAIN_PARAMS}/{key[len(E.MODEL) + 1:]}"
        exact = next(iter(entry.pieces.values()), None)
        use_main = main_key in available and exact is not None and exact.dtype == torch.float32
        wanted[main_key if use_main else key] = entry
    check_compatible(saved, wanted, what="model tensor")
    return saved, trainer_state, wanted, sorted(model_entries)


def check_content(saved: SavedCheckpoint, verify: str) -> None:
    """This rank's share of the files compared with their recorded checksums (``verify`` is one of
    ``strategy.options.VERIFY_MODES``): ``"recorded"`` loads a checkpoint that has none unchecked, saying so
    once; ``"strict"`` refuses it; ``"off"`` compares nothing. Raises naming a damaged file."""
    if verify == "off":
        return
    if verify == "recorded" and not saved.info.get("checksums"):
        rank_zero_info(f"Checkpoint {saved.path} records no checksums (saved with checkpoint_checksums=False or by "
                       f"an earlier lightning-megatron): its files are loaded without comparing their content.")
        return
    verify_checksums(saved, rank=dist.get_rank() if dist.is_initialized() else 0,
                     world_size=dist.get_world_size() if dist.is_initialized() else 1)


def saved_rng_state(trainer_state: dict[str, Any], training: RankTraining) -> Optional[dict[str, Any]]:
    """This rank's random streams as saved, if the checkpoint was saved at this layout (dropout masks are
    drawn per tp shard, so another layout cannot continue them)."""
    states = trainer_state.get(RNG_KEY)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if states and trainer_state.get(LAYOUT_KEY) == asdict(training.state.config) and len(states) == world_size:
        return states[dist.get_rank() if dist.is_initialized() else 0]
    return None


def load_optimizer_state(saved: SavedCheckpoint, trainer_state: dict[str, Any], training: RankTraining) -> None:
    """Collective: hyper-parameters from ``trainer_state``, state tensors read in place into fresh tensors."""
    placements = training.placements()
    for entries in _agree(lambda: _plan_optimizer_load(saved, trainer_state, training, placements)):
        read_tensors(saved, entries)


def _plan_optimizer_load(saved: SavedCheckpoint, trainer_state: dict[str, Any], training: RankTraining,
                         placements: E.Placements) -> list[dict]:
    saved_optimizers = trainer_state.get("optimizer_states") or []
    if len(saved_optimizers) != len(training.optimizers):
        raise RuntimeError(f"Checkpoint {saved.path} holds {len(saved_optimizers)} optimizer(s); configure_optimizers "
                           f"returned {len(training.optimizers)}.")
    available = saved.tensors()
    plans = []
    for index, (optimizer, hyper) in enumerate(zip(training.optimizers, saved_optimizers)):
        E.restore_hyperparameters(optimizer, hyper, placements, where=f"Checkpoint {saved.path}")
        E.allocate_optimizer_state(optimizer, index, placements, available,
                                   home=training.main_params.state_home if training.main_params is not None else None)
        entries = E.optimizer_entries(optimizer, index, placements)
        check_compatible(saved, entries, what="optimizer state")
        plans.append(entries)
    return plans
