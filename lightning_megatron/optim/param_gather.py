"""ZeRO 1/2's all-gather of the updated parameters, synchronous or overlapped with the next forward.

After the optimizer step each data-parallel rank holds the update of its owned slice of every bucket (in the
model's flat per-bucket parameter buffers, ``MainParamOptimizer``); one all-gather per bucket over the bucket's
group (dp; experts: expert-dp) gives every rank the whole bucket again.

With ``overlap`` (Megatron-Core's ``overlap_param_gather``) the gathers are only started after the step, in
forward order (buckets are cut from the last parameter backwards, so the last bucket holds the first layers and
is launched first), and a forward pre-hook on every module that owns bucketed parameters waits for those
buckets just before that module runs: the gathers of later layers proceed while the earlier layers compute.
A parameter is thus waited for by the module that registers it (tied weights: by each module holding them),
which is where a forward reads it; a model whose forward read a submodule's parameter without running that
submodule first would read it unfinished (this package's models do not).
Whatever reads parameter values outside a forward between the step and the next forward (checkpoint saves,
the strategy's evaluation steps, its teardown, a user's callback) calls :meth:`ParamGather.wait` first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch.distributed as dist
from torch import Tensor, nn

if TYPE_CHECKING:
    from lightning_megatron.optim.grad_sync import _Bucket

OVERLAP_ZERO_STAGES = (1, 2)


def check_overlap_param_gather(overlap_param_gather: bool, zero_stage) -> None:
    """``overlap_param_gather`` needs the parameter all-gather of ZeRO 1/2: stage 0 has none (every rank steps
    every parameter), and stage 3 gathers each layer's parameters before its forward already (FSDP's prefetch)."""
    if overlap_param_gather and zero_stage not in OVERLAP_ZERO_STAGES:
        raise ValueError(f"overlap_param_gather=True overlaps ZeRO 1/2's all-gather of the updated parameters with "
                         f"the next forward; zero_stage={zero_stage!r} has no such all-gather (stage 0 steps every "
                         f"parameter on every rank; stage 3 gathers per layer before each forward itself). Use "
                         f"zero_stage=1 or 2, or overlap_param_gather=False.")


class ParamGather:
    """One all-gather per bucket of ``buffers`` (the flat parameter buffers of ``buckets``), after each step.

    ``overlap_with``: the module whose next forward waits for the gathers (every submodule owning a gathered
    parameter gets a forward pre-hook); ``None``: :meth:`launch` waits for them itself.
    """

    def __init__(self, buckets: Sequence[_Bucket], buffers: Sequence[Tensor], *,
                 overlap_with: Optional[nn.Module] = None) -> None:
        # Forward order: the reverse of the bucket order. A bucket without a group (one rank) has nothing to gather.
        self._gathers = [(index, bucket, buffers[index]) for index, bucket in reversed(list(enumerate(buckets)))
                         if bucket.group is not None]
        self._pending: dict[int, tuple[dist.Work, Tensor]] = {}  # bucket index -> (its gather, its input)
        self.overlap = overlap_with is not None
        self._hooks = []
        if self.overlap:
            bucket_of = {id(param): index for index, bucket, _ in self._gathers for param in bucket.params}
            for module in overlap_with.modules():
                needed = sorted({bucket_of[id(p)] for p in module.parameters(recurse=False) if id(p) in bucket_of})
                if needed:
                    self._hooks.append(module.register_forward_pre_hook(self._waiter(needed)))

    def _waiter(self, needed: list[int]):
        def wait_for_buckets(module, args) -> None:
            if self._pending:
                for index in needed:
                    self._wait_bucket(index)
        return wait_for_buckets

    def launch(self) -> None:
        """Start every bucket's all-gather of the owned slices (updated, with no gather in flight)."""
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        for index, bucket, buffer in self._gathers:
            owned = buffer.narrow(0, bucket.shard_start, bucket.shard_numel).clone()  # the output holds the input
            self._pending[index] = (gather(buffer, owned, group=bucket.group, async_op=True), owned)
        if not self.overlap:
            self.wait()

    def _wait_bucket(self, index: int) -> None:
        pending = self._pending.pop(index, None)
        if pending is not None:
            pending[0].wait()

    def wait(self) -> None:
        """Complete every gather in flight (in launch order): the parameters are then whole on every rank."""
        for index in list(self._pending):
            self._wait_bucket(index)

    @property
    def in_flight(self) -> int:
        """Buckets whose gather was launched and not yet waited for."""
        return len(self._pending)

    def remove(self) -> None:
        """Remove the forward pre-hooks; a gather still in flight stays for :meth:`wait` (not waited for here: after
        a failure a peer may never join it)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
