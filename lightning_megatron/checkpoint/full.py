"""Full (consolidated) state dicts: global names, global unpadded shapes, any layout.

Saving gathers each tensor-parallel shard into its global tensor; loading cuts this
rank's shard back out. A checkpoint written at one tensor-parallel size therefore loads
at any other. Sharded checkpoints (``checkpoint.sharded``) never gather; these are for export and tests.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_megatron.tensor_parallel.sharding import TensorShard, shard_of


def gather_shard(local: Tensor, shard: TensorShard, group: Optional[dist.ProcessGroup]) -> Tensor:
    """The global tensor (padding dropped) of a tensor-parallel shard, from every rank's ``local`` in ``group``
    (the tp group; ``None`` when the shard is not split): the ranks' segments put where they belong."""
    if group is None or shard.world == 1:
        return shard.assemble([local])
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return shard.assemble(parts)


def gather_full_state_dict(module: nn.Module, group: Optional[dist.ProcessGroup]) -> dict[str, Any]:
    """Every rank returns the full state dict on the CPU (a collective over ``group``, the tp group, and
    under ZeRO-3 over the dp group that shards the parameters' rows)."""
    full: dict[str, Any] = {}
    # Shard specs by name from the parameters themselves: FSDP's state-dict hooks may hand out other objects.
    shards = {name: shard_of(p) for name, p in module.named_parameters(remove_duplicate=False)}
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, Tensor):
            full[name] = value
            continue
        tensor = value.detach()
        tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # over dp: the tp shard
        shard = shards.get(name) or shard_of(value)
        if shard is not None:
            tensor = gather_shard(tensor, shard, group)
        full[name] = tensor.cpu().clone()
    return full


def merge_pipeline_stages(state: dict[str, Any], group: Optional[dist.ProcessGroup]) -> dict[str, Any]:
    """Each pipeline stage holds some keys; every rank gets their union (a collective over ``group``)."""
    if group is None:
        return state
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, state, group=group)
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    return merged


def local_state_dict_from_full(module: nn.Module, full: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's entries (its pipeline stage, its tensor-parallel shards) of a full state dict."""
    local: dict[str, Any] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if name not in full:
            continue  # load_state_dict(strict=True) reports it as missing
        shard = shard_of(value) if isinstance(value, Tensor) else None
        if shard is None:
            local[name] = full[name]
            continue
        saved = full[name]
        if tuple(saved.shape) != shard.global_shape:
            raise ValueError(
                f"Checkpoint tensor {name!r} has shape {tuple(saved.shape)} but the model expects the global shape "
                f"{shard.global_shape}. The checkpoint belongs to a model of another size."
            )
        local[name] = shard.local_slice(saved)
    return local


def full_optimizer_state_unusable(saved_layout: Mapping[str, Any], config: Any, *, has_main_params: bool) -> Optional[str]:
    """Why a full (single-file) checkpoint's optimizer state cannot be restored here, or None if it can.

    It holds rank 0's optimizer state only, which is every rank's only at tp=1 without ZeRO or fp32 main
    parameters, at saving and at loading."""
    sharded_now = config.tensor_parallel_size != 1 or config.zero_stage != 0 or has_main_params
    sharded_then = saved_layout.get("tensor_parallel_size", 1) != 1 or saved_layout.get("zero_stage", 0) != 0
    if not (sharded_now or sharded_then):
        return None
    return (f"Megatron3DStrategy: a full (single-file) checkpoint's optimizer state is not restored under tensor "
            f"parallelism or fp32 main parameters (saved tp={saved_layout.get('tensor_parallel_size', '?')}, "
            f"zero_stage={saved_layout.get('zero_stage', '?')}; now tp={config.tensor_parallel_size}, "
            f"zero_stage={config.zero_stage}); the weights and the trainer state are. The optimizer starts fresh. "
            f"Sharded checkpoints (checkpoint_format='sharded', the default) restore it at any layout.")
