"""What a rank writes to and reads from a sharded checkpoint, whatever its layout.

Keys are layout-free (global names, global shapes), values are ``ShardedEntry`` views of
what this rank holds:

    state_dict/<name>             the LightningModule's tensors (tp shard, ZeRO-3 rows)
    main_params/<name>            fp32 main parameters where they are copies (16-bit training)
    optimizer/<i>/<name>/<key>    optimizer state of parameter <name> (exp_avg, step, ...), shaped
                                  like the parameter, whichever rank's flat ZeRO piece holds it

Optimizer state is keyed by the *parameter's* global name, not its position in the
optimizer, so it follows the parameter to whichever rank, stage or ZeRO piece holds it at
load time. Scalars (Adam's ``step``) are the same on every rank and written once.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_megatron.checkpoint.pieces import Placement, ShardedEntry
from lightning_megatron.optim.main_params import MainParamOptimizer
from lightning_megatron.optim.zero3 import flat_chunk_start, local_tensor
from lightning_megatron.parallel.initialize import original_name
from lightning_megatron.parallel.shards import shard_of

MODEL, MAIN_PARAMS, OPTIMIZER = "state_dict", "main_params", "optimizer"
Placements = dict[int, tuple[str, Placement]]


def placement_of(tensor: Tensor, shard=None) -> Placement:
    """Where ``tensor`` (a parameter, a buffer or a ZeRO-3 DTensor over dp, or over the expert-data-parallel group
    for an expert) sits in its global tensor."""
    shard = shard if shard is not None else shard_of(tensor)
    global_shape = shard.global_shape if shard is not None else tuple(tensor.shape)
    if not isinstance(tensor, DTensor):
        return Placement(global_shape, shard)
    start = flat_chunk_start(tensor)  # ZeRO-3: FSDP2 gives each rank of its mesh a block of rows of the tp shard
    return Placement(global_shape, shard, start, start + tensor.to_local().numel())


def model_entries(module: nn.Module) -> dict[str, ShardedEntry]:
    """This rank's part of every tensor in ``module.state_dict()``, under ``state_dict/<name>``."""
    # Shard specs from the parameters themselves: FSDP's state-dict hooks may hand out other objects.
    shards = {name: shard_of(p) for name, p in module.named_parameters(remove_duplicate=False)}
    entries = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, Tensor):
            raise TypeError(f"{type(module).__name__}.state_dict() entry {name!r} is a {type(value).__name__}; "
                            f"sharded checkpoints hold tensors (keep other state in on_save_checkpoint).")
        placement = placement_of(value, shards.get(name))
        entries[f"{MODEL}/{name}"] = ShardedEntry(local_tensor(value), placement)
    return entries


def parameter_placements(module: nn.Module, main_params: Optional[MainParamOptimizer] = None) -> Placements:
    """Global name and placement of every tensor an optimizer may step: parameters and fp32 main pieces."""
    placements: Placements = {}
    for name, param in module.named_parameters():
        placements[id(param)] = (original_name(param, name), placement_of(param))
    for piece, main in main_params.pieces if main_params is not None else ():
        name, whole = placements[id(piece.param)]
        placements[id(main)] = (name, Placement(whole.global_shape, whole.shard, piece.start, piece.stop))
    return placements


def main_param_entries(main_params: Optional[MainParamOptimizer], placements: Placements) -> dict[str, ShardedEntry]:
    """fp32 main parameters that are copies (16-bit models); views of fp32 parameters are saved as those."""
    if main_params is None:
        return {}
    entries = {}
    for piece, main in main_params.pieces:
        if main.data_ptr() != piece.param.detach().reshape(-1)[piece.start : piece.stop].data_ptr():
            name, placement = placements[id(main)]
            entries[f"{MAIN_PARAMS}/{name}"] = ShardedEntry(main.detach(), placement)
    return entries


def optimizer_entries(optimizer: Optimizer, index: int, placements: Placements) -> dict[str, ShardedEntry]:
    """The optimizer's per-parameter state under ``optimizer/<index>/<parameter name>/<key>``."""
    entries = {}
    for param in (p for group in optimizer.param_groups for p in group["params"]):
        name, placement = placements[id(param)]
        for key, value in optimizer.state.get(param, {}).items():
            if not isinstance(value, Tensor):
                raise TypeError(f"{type(optimizer).__name__} state {key!r} of {name!r} is a {type(value).__name__}; "
                                f"sharded checkpoints hold tensors only.")
            local = local_tensor(value)
            if local.shape == local_tensor(param).shape:
                entries[f"{OPTIMIZER}/{index}/{name}/{key}"] = ShardedEntry(local, placement)
            elif local.dim() == 0:
                entries[f"{OPTIMIZER}/{index}/{name}/{key}"] = ShardedEntry(local, Placement(()))
            else:
                raise TypeError(f"{type(optimizer).__name__} state {key!r} of {name!r} has shape {tuple(local.shape)}, "
                                f"neither the parameter's {tuple(local_tensor(param).shape)} nor a scalar.")
    return entries


def optimizer_hyperparameters(optimizer: Optimizer, placements: Placements) -> dict[str, Any]:
    """The param groups without their tensors: hyper-parameters, and which parameters each group holds."""
    return {
        "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
        "param_names": [sorted({placements[id(p)][0] for p in group["params"]}) for group in optimizer.param_groups],
    }


def restore_hyperparameters(optimizer: Optimizer, saved: dict[str, Any], placements: Placements, *, where: str) -> None:
    groups = optimizer.param_groups
    if len(saved["param_groups"]) != len(groups):
        raise RuntimeError(f"{where} has {len(saved['param_groups'])} optimizer param groups, this "
                           f"{type(optimizer).__name__} has {len(groups)}: configure_optimizers must build the same groups.")
    for i, (group, hyper, names) in enumerate(zip(groups, saved["param_groups"], saved["param_names"])):
        foreign = sorted({placements[id(p)][0] for p in group["params"]} - set(names))
        if foreign:
            raise RuntimeError(f"{where}: optimizer param group {i} now holds {foreign[:3]}, which the saved group "
                               f"{i} did not: configure_optimizers must build the same groups.")
        group.update(hyper)


def allocate_optimizer_state(optimizer: Optimizer, index: int, placements: Placements,
                             saved: dict[str, Any], *,
                             home: Optional[Callable[[nn.Parameter, str], Optional[Tensor]]] = None) -> None:
    """Create the state tensors the checkpoint holds for each parameter (torch optimizers make them lazily
    at the first step), so that they can be read in place. ``saved``: the checkpoint's tensor index.
    ``home(param, key)``: where a state tensor already lives, if not in fresh memory (the ``"nvme"`` offload
    tier's files: ``MainParamOptimizer.state_home``)."""
    by_param: dict[str, dict[str, Any]] = {}
    prefix = f"{OPTIMIZER}/{index}/"
    for key, md in saved.items():
        if key.startswith(prefix):
            name, _, state_key = key[len(prefix):].rpartition("/")
            by_param.setdefault(name, {})[state_key] = md
    for group in optimizer.param_groups:
        on_device = group.get("capturable", False) or group.get("fused", False)
        for param in group["params"]:
            found = by_param.get(placements[id(param)][0])
            if not found:
                continue
            state = optimizer.state[param] = {}
            for key, md in found.items():
                dtype = md.properties.dtype
                if len(md.size) == 0:  # a step counter: on the CPU unless the optimizer steps on the device
                    state[key] = torch.zeros((), dtype=dtype, device=local_tensor(param).device if on_device else "cpu")
                else:
                    kept = home(param, key) if home is not None else None
                    state[key] = kept if kept is not None and kept.dtype == dtype else torch.zeros_like(param.detach(), dtype=dtype)
