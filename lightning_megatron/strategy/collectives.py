"""Lightning's collectives for ``Megatron3DStrategy`` (a mixin; ``strategy.py`` holds the rest of the wiring).

Each one is recorded as a phase (``diagnostics.records_phase``), so that a timeout in it says what was
waiting. Metrics are reduced over the ranks that saw different tokens (dp x cp, the layout's replica group),
not over the world; barriers, broadcasts and decisions span the world. The mixin reads the strategy's
``parallel_state``, ``root_device`` and ``world_size``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from torch import Tensor

from lightning_megatron.strategy.diagnostics import argument, records_phase


class CollectiveHooks:
    @records_phase("barrier", argument(0, "name"))
    def barrier(self, name: Optional[str] = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @records_phase("broadcast")
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @records_phase("metric reduction")
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[dist.ReduceOp, str]] = "mean") -> Any:
        """Reduce over dp x cp by default: tp/pp ranks of one replica hold the same value, and context-parallel
        ranks each a value of their own tokens (equal shares of every sequence)."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None:
            group = self.parallel_state.replica_group
            if group is None:
                return tensor
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @records_phase("decision")
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not _distributed_is_initialized():
            return decision
        votes = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(votes)
        return bool(votes == self.world_size) if all else bool(votes)
