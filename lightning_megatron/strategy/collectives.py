"""Lightning's collectives over the layout, as the strategy's hooks call them.

Metrics are reduced over the ranks that saw different tokens (dp x cp, the layout's replica group), not over the
world; barriers, broadcasts and decisions span the world. The strategy records each call as a phase
(``diagnostics.records_phase``), so that a timeout in it says what was waiting.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from torch import Tensor

from lightning_megatron.parallel.state import ParallelState


def barrier() -> None:
    if _distributed_is_initialized():
        dist.barrier()


def broadcast(obj: Any, src: int = 0) -> Any:
    if not _distributed_is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def reduce(tensor: Any, state: ParallelState, group: Optional[Any] = None,
           reduce_op: Optional[Union[dist.ReduceOp, str]] = "mean") -> Any:
    """Reduce over dp x cp by default: tp/pp ranks of one replica hold the same value, and context-parallel
    ranks each a value of their own tokens (equal shares of every sequence)."""
    if not isinstance(tensor, Tensor):
        return tensor
    if group is None:
        group = state.replica_group
        if group is None:
            return tensor
    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def reduce_boolean_decision(decision: bool, all: bool, device: torch.device, world_size: int) -> bool:
    """Every rank's vote, summed over the world: whether all (``all``) or any voted yes."""
    if not _distributed_is_initialized():
        return decision
    votes = torch.tensor(int(decision), device=device)
    dist.all_reduce(votes)
    return bool(votes == world_size) if all else bool(votes)
