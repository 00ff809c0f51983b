"""Token dispatch over the expert-parallel group: an all-to-all there, the experts, an all-to-all back.

The MoE layer hands over its assignments sorted by expert (so also by the rank holding the expert)
with their counts per expert. One all-gather of those counts (``E`` integers per rank) tells every
rank how many tokens it sends to and receives from each peer; an uneven ``all_to_all_single`` then
moves the tokens, which arrive ordered by (source rank, local expert) and are regrouped by local
expert for the experts. ``combine`` undoes both steps. The all-to-all's backward is the all-to-all
with the splits swapped, so a layer costs exactly two all-to-alls forward and two backward (plus the
counts' all-gather in forward), whatever tp and pp do.

Host syncs: ``all_to_all_single`` takes its split sizes as Python integers, so the gathered counts are read
on the host once per layer in forward, after they were exchanged on the device: that one read serves both
all-to-alls and their backward (which reuse the splits), and the regrouping and the local experts' counts
are computed on the device. It is the only host sync of an MoE layer (with grouped GEMMs, ``models.experts``,
and with the loop, which reads these host counts); with the experts on one rank there is none.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, output_splits: list[int], input_splits: list[int], group) -> Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        output_splits, input_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), input_splits, output_splits, ctx.group), None, None, None


def all_to_all(x: Tensor, output_splits: list[int], input_splits: list[int], group) -> Tensor:
    """Rows ``input_splits[r]`` of ``x`` go to rank ``r``; ``output_splits[r]`` rows arrive from it. Differentiable."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


class AllToAllDispatcher:
    """The ``MoE.dispatcher`` of one rank of an expert-parallel ``group`` holding ``num_local_experts`` experts
    (ep rank ``r`` holds experts ``r * num_local_experts`` onwards)."""

    def __init__(self, group: dist.ProcessGroup, num_local_experts: int) -> None:
        self.group, self.num_local_experts = group, num_local_experts
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._pending: Optional[tuple] = None

    def dispatch(self, tokens: Tensor, tokens_per_expert: Tensor) -> tuple[Tensor, Tensor]:
        """``tokens`` sorted by expert (rows past the counted ones, assignments a capacity dropped, stay here);
        ``tokens_per_expert`` ``[E]`` -> this rank's experts' tokens (from every peer), grouped by local expert,
        and their counts per local expert (``[E_local]``, on the host: read with the splits)."""
        counts = tokens_per_expert.to(torch.int64).reshape(1, -1)
        every = counts.new_empty((self.size, counts.shape[1]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(every, counts, group=self.group)  # every[s, e]: tokens rank s sends to expert e
        local = self.num_local_experts
        every = every.view(self.size, self.size, local)  # [source, destination rank, local expert]
        on_host = every.tolist()  # the layer's one host read (module docstring)
        send = [sum(per_expert) for per_expert in on_host[self.rank]]
        received = [on_host[source][self.rank] for source in range(self.size)]  # [source][local expert]
        recv = [sum(per_expert) for per_expert in received]
        arrived = all_to_all(tokens[:sum(send)], recv, send, self.group)
        # Arrived ordered (source, local expert): a stable sort by local expert regroups them, sources in order.
        local_expert = torch.arange(local, device=every.device).repeat(self.size).repeat_interleave(
            every[:, self.rank].reshape(-1), output_size=sum(recv))
        order = torch.argsort(local_expert, stable=True).to(tokens.device)
        self._pending = (order, send, recv, tokens.shape[0])
        return arrived.index_select(0, order), torch.tensor([sum(column) for column in zip(*received)])

    def combine(self, expert_output: Tensor) -> Tensor:
        """The experts' outputs back on the ranks that sent the tokens, in their order; zero rows for the ones that
        stayed (dropped assignments)."""
        order, send, recv, rows = self._pending
        self._pending = None
        back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        out = all_to_all(expert_output.index_select(0, back), send, recv, self.group)
        return F.pad(out, (0, 0, 0, rows - out.shape[0])) if rows > out.shape[0] else out


class TensorParallelShareDispatcher:
    """Experts whole on every tp rank (``expert_tensor_parallel_size=1``): inside the MoE layer's tensor-parallel
    region every tp rank holds the same routed assignments, so tp rank ``r`` of ``size`` dispatches only rows
    ``[r N / size, (r + 1) N / size)`` of them (sorted by expert: a contiguous share of each expert's) through
    ``inner`` (an :class:`AllToAllDispatcher` over tp x dp ranks), and gives back zeros for the others. The
    region's leave then sums the tp ranks' shares (g, or the reduce-scatter) into every row's output, and its
    enter sums the tokens' gradients (f's backward), as it does for experts split over tp."""

    def __init__(self, inner: AllToAllDispatcher, rank: int, size: int) -> None:
        self.inner, self.rank, self.size = inner, rank, size
        self._rows: Optional[tuple[int, int, int]] = None

    def dispatch(self, tokens: Tensor, tokens_per_expert: Tensor) -> tuple[Tensor, Tensor]:
        rows = tokens.shape[0]
        lo, hi = self.rank * rows // self.size, (self.rank + 1) * rows // self.size
        ends = torch.cumsum(tokens_per_expert.to(torch.int64), 0)
        starts = ends - tokens_per_expert.to(torch.int64)
        # Each expert's rows inside [lo, hi), on the device (rows past the counted ones, dropped, count for none).
        share = (torch.minimum(ends, torch.tensor(hi, device=ends.device))
                 - torch.maximum(starts, torch.tensor(lo, device=ends.device))).clamp_(min=0)
        self._rows = (lo, hi, rows)
        return self.inner.dispatch(tokens[lo:hi], share)

    def combine(self, expert_output: Tensor) -> Tensor:
        lo, hi, rows = self._rows
        self._rows = None
        return F.pad(self.inner.combine(expert_output), (0, 0, lo, rows - hi))
