"""Gradient clipping by the true global norm of a model split over tensor-parallel ranks.

``torch.nn.utils.clip_grad_norm_`` sees one rank's shards and would clip each rank by a
different factor. Here each element of the global model is counted exactly once: sharded
parameters on every rank (a range of a segmented shard replicated on several tp ranks on
its primary only), replicated ones on tensor-parallel rank 0 only, and an embedding
tied across pipeline stages on the first stage only; the squares are then summed over the
model-parallel group (tp x pp). After an all-reduce every dp rank holds the same
gradients, so no dp reduction is needed; under ZeRO each dp rank holds different pieces,
and the squares are summed over dp too. Under expert parallelism without ZeRO the dp ranks
hold different experts, so the squares are summed over dp as well, each replica counted once
(``replicas``: dense parameters on dp rank 0, experts on expert-data-parallel rank 0). Experts kept whole
on each tp rank (``expert_tensor_parallel_size=1``) are different experts there, not replicas: each tp rank
counts its own.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_megatron.parallel.shards import TensorShard, shard_of


def counted_squares(grad: Tensor, shard: Optional[TensorShard], *, flat_start: int = 0,
                    dtype: torch.dtype = torch.float32) -> Tensor:
    """The sum of squares of ``grad`` (in ``dtype``) over the elements this rank counts: all of them, except
    in a segmented shard's ranges whose primary is another rank. ``grad`` holds the flat elements from
    ``flat_start`` of the tp shard (a ZeRO piece, a ZeRO-3 block of rows; 0: the whole shard)."""
    ranges = None if shard is None else shard.counted_flat_ranges()
    grad = grad.detach().to(dtype)
    if ranges is None:
        return grad.pow(2).sum()
    flat, stop = grad.reshape(-1), flat_start + grad.numel()
    parts = [flat[max(lo, flat_start) - flat_start : min(hi, stop) - flat_start] for lo, hi in ranges
             if lo < stop and hi > flat_start]
    return torch.cat(parts).pow(2).sum() if parts else grad.new_zeros(())


def first_replicas(params: Iterable[nn.Parameter], *, data_parallel_rank: int,
                   expert_data_parallel_rank: int) -> list[nn.Parameter]:
    """The parameters whose squares this rank counts when the norm is summed over dp without ZeRO (expert
    parallelism): dense ones on dp rank 0, ``expert_parallel`` ones on expert-data-parallel rank 0."""
    return [p for p in params
            if (expert_data_parallel_rank if getattr(p, "expert_parallel", False) else data_parallel_rank) == 0]


def counted_on_this_tensor_rank(param: nn.Parameter, is_first_tensor_rank: bool) -> bool:
    """Whether this tp rank counts ``param``'s gradient in the global norm: a tp shard on every rank; a parameter
    replicated over tp (an expert split over tp: its row bias too) on tp rank 0 only; experts kept whole on each tp
    rank (``whole_expert``: ``expert_tensor_parallel_size=1``) are different experts there, each counted by its own."""
    return shard_of(param) is not None or is_first_tensor_rank or getattr(param, "whole_expert", False)

class NormCounting:
    """What this rank counts in the global gradient norm, decided once for a list of parameters.

    The decision (counted whole, counted in some ranges of a segmented shard, or not at all) depends
    only on the parameters' tags and this rank's tensor-parallel rank, which do not change while
    training; deciding it once leaves each step only reading the current gradients of the counted
    parameters and one ``torch._foreach_norm`` over them (``StepGradients`` keeps one per optimizer).
    An fp32 main piece says where it starts in its shard with ``shard_flat_start`` (``MainParamOptimizer``).
    """

    def __init__(self, params: Iterable[nn.Parameter], *, is_first_tensor_rank: bool) -> None:
        self.whole: list[nn.Parameter] = []
        self.segmented: list[tuple[nn.Parameter, TensorShard, int]] = []
        for param in dict.fromkeys(params):
            if not counted_on_this_tensor_rank(param, is_first_tensor_rank):
                continue
            shard = shard_of(param)
            if hasattr(param, "tied_names"):  # the last stage's copy of a tied embedding
                continue
            if shard is None or shard.counted_flat_ranges() is None:
                self.whole.append(param)
            else:
                self.segmented.append((param, shard, getattr(param, "shard_flat_start", 0)))

    @torch.no_grad()
    def squares(self) -> Tensor:
        """This rank's share of the squared global gradient norm (before any reduction), float32."""
        terms = [counted_squares(param.grad, shard, flat_start=start) for param, shard, start in self.segmented
                 if param.grad is not None]
        whole = [grad for param in self.whole if (grad := param.grad) is not None]
        if whole:  # one fused kernel per dtype and device, not two passes per parameter
            terms.append(torch.stack(torch._foreach_norm(whole, 2, dtype=torch.float32)).pow(2).sum())
        if len(terms) == 1:
            return terms[0]
        return torch.stack(terms).sum() if terms else torch.zeros((), dtype=torch.float32)


def local_grad_squares(params: Iterable[nn.Parameter], *, is_first_tensor_rank: bool) -> Tensor:
    """This rank's share of the squared global gradient norm (before any reduction), counted as
    the module docstring says; ``optim.nonfinite`` sums the same shares for its check."""
    return NormCounting(params, is_first_tensor_rank=is_first_tensor_rank).squares()


def reduce_squares(squares: Tensor, groups: Iterable[Optional[dist.ProcessGroup]], *,
                   reduce_device: Optional[torch.device] = None) -> Tensor:
    """The global norm from this rank's squares: summed (float64) over ``groups`` in order (None: nothing to sum).

    ``reduce_device``: where the sum of squares is all-reduced (NCCL needs the accelerator even
    when the gradients were offloaded to the CPU)."""
    squares = squares.double() if reduce_device is None else squares.to(reduce_device, torch.float64)
    for group in groups:
        if group is not None:
            dist.all_reduce(squares, group=group)
    return squares.sqrt().float()


@torch.no_grad()
def scale_to_norm(grads: list[Tensor], max_norm: float, norm: Tensor) -> None:
    """Scale ``grads`` in place so that a global norm of ``norm`` becomes at most ``max_norm`` (one fused kernel)."""
    clip_coef = max_norm / (float(norm) + 1e-6)
    if clip_coef < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coef)


def global_grad_norm(
    params: Iterable[nn.Parameter],
    *,
    model_parallel_group: Optional[dist.ProcessGroup],
    is_first_tensor_rank: bool,
    data_parallel_group: Optional[dist.ProcessGroup] = None,
    reduce_device: Optional[torch.device] = None,
) -> Tensor:
    """The L2 norm of all gradients of the global model, identical on every rank (see :func:`reduce_squares`)."""
    squares = local_grad_squares(params, is_first_tensor_rank=is_first_tensor_rank)
    return reduce_squares(squares, (model_parallel_group, data_parallel_group), reduce_device=reduce_device)


def clip_grads_by_global_norm(
    params: Iterable[nn.Parameter],
    max_norm: float,
    *,
    model_parallel_group: Optional[dist.ProcessGroup],
    is_first_tensor_rank: bool,
    data_parallel_group: Optional[dist.ProcessGroup] = None,
    reduce_device: Optional[torch.device] = None,
    norm: Optional[Tensor] = None,
    counted: Optional[list[nn.Parameter]] = None,
) -> Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; returns the norm before clipping.

    Pass ``data_parallel_group`` when each dp rank holds different pieces of the gradients (ZeRO, or
    experts under expert parallelism: then ``counted`` = :func:`first_replicas` of them).
    ``norm``: this step's global norm if it is known already (the strategy's non-finite check
    computes it right after the gradients are reduced); it is used as it is, with no collective.
    """
    params = [p for p in dict.fromkeys(params) if p.grad is not None]
    if norm is None:
        norm = global_grad_norm(params if counted is None else [p for p in counted if p.grad is not None],
                                model_parallel_group=model_parallel_group,
                                is_first_tensor_rank=is_first_tensor_rank, data_parallel_group=data_parallel_group,
                                reduce_device=reduce_device)
    scale_to_norm([p.grad for p in params], max_norm, norm)
    return norm
