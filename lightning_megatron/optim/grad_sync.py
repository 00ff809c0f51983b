"""Data-parallel gradient reduction into contiguous buckets, overlapped with backward.

Megatron-Core's grad-buffer design: every parameter's gradient accumulates into a view
of a flat buffer, in the parameter's own dtype (16-bit grads for 16-bit params, as the
ZeRO memory formulas assume). Buffers are cut into buckets in reverse parameter order,
roughly the order backward produces them; when the last gradient of a bucket arrives
during the final micro-batch's backward, the bucket's reduction starts asynchronously
while backward goes on computing the rest.

``zero_stage`` chooses the reduction (Rajbhandari et al. 2020):

* 0: all-reduce; every dp rank keeps the full summed gradient.
* 1: reduce-scatter; each dp rank's *owned* slice of the (full-size) buffer holds the sum.
* 2: the full buffer is transient: each backward's bucket is reduce-scattered into a
  persistent owned slice (``1/dp`` of the gradients) and freed. Under gradient
  accumulation this reduces after every micro-batch (ZeRO-2's price for its memory).

Each bucket is reduced over its parameters' group: the data-parallel group, or for the experts of
an expert-parallel layout (parameters tagged ``expert_parallel``) the expert-data-parallel group, the
ranks holding the same experts; ZeRO then shards each bucket over its own group.

The training loss is a sum over tokens (see ``Megatron3DStrategy.backward``); after the
reduction gradients are divided by the number of tokens in the global batch, so they are
those of the per-token mean over the global batch whatever dp and the micro-batching are.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, NamedTuple, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_megatron.optim.partial_grads import PartialGrads

DEFAULT_BUCKET_SIZE_MB = 25.0


def sum_over_group(tensors: Sequence[Tensor], group: dist.ProcessGroup,
                   device: Optional[torch.device] = None) -> None:
    """All-reduce several tensors in place with one collective (flattened into one buffer); ``device``: where
    the buffer is reduced (NCCL's device, for tensors offloaded to host memory), by default the tensors'."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(device)
    dist.all_reduce(flat, group=group)
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def changes_nothing(scale: float, dtypes: Iterable[torch.dtype]) -> bool:
    """Whether multiplying tensors of ``dtypes`` by ``scale`` leaves every value as it is, so the pass can be skipped.

    torch multiplies 16- and 32-bit floats by a Python scalar converted to float32 (their compute type), so a
    scale within rounding of 1 multiplies by exactly 1 there. That is the token normaliser of every step
    that needs none (one replica, no accumulation: ``1 / (n * (1 / n))``); float64 needs exactly 1.
    """
    if scale == 1.0:
        return True
    return struct.unpack("f", struct.pack("f", scale))[0] == 1.0 and torch.float64 not in set(dtypes)


def flat_part(tensor: Tensor, start: int, stop: int) -> Tensor:
    """Elements ``[start, stop)`` of ``tensor`` in row-major order, as a view (the tensor itself when whole)."""
    if start == 0 and stop == tensor.numel():
        return tensor
    return tensor.view(-1)[start:stop]


def sum_tokens(num_tokens: Tensor, group: Optional[dist.ProcessGroup], device, also_sum: Optional[Tensor] = None
               ) -> tuple[Tensor, Optional[Tensor]]:
    """A step's token count summed over ``group`` (float64), and ``also_sum`` (small per-rank counts, e.g. the
    non-finite-loss flags of ``optim.nonfinite``) summed in the same all-reduce: they ride along for free."""
    packed = num_tokens.detach().to(device=device, dtype=torch.float64).reshape(1)
    if also_sum is not None:
        packed = torch.cat([packed, also_sum.detach().to(device=device, dtype=torch.float64).reshape(-1)])
    if group is not None:
        dist.all_reduce(packed, group=group)
    return packed[0], None if also_sum is None else packed[1:]


def cut_buckets(params: Sequence, *, bucket_bytes: int, group_of: Callable, own_bucket: set[int]) -> list[list]:
    """The bucket layout: ``params`` (anything with ``numel()``, ``element_size()`` and ``dtype``, so the planner
    can lay out parameters it never allocates) cut in reverse order, roughly the order backward produces their
    gradients, into runs of at least ``bucket_bytes``. A new bucket starts at a change of reduction group (experts'
    buckets hold only experts: they are reduced over another group) or dtype; a parameter whose ``id`` is in
    ``own_bucket`` (a pipeline-tied embedding) gets a bucket of its own, so that its layout, hence its owned slice,
    is the same on the first and the last stage."""
    buckets: list[list] = []
    pending: list = []
    size = 0
    for param in reversed(list(params)):
        alone = id(param) in own_bucket
        other_group = pending and group_of(param) is not group_of(pending[0])
        if pending and (alone or other_group or param.dtype != pending[0].dtype or size >= bucket_bytes):
            buckets.append(pending)
            pending, size = [], 0
        pending.append(param)
        size += param.numel() * param.element_size()
        if alone:
            buckets.append(pending)
            pending, size = [], 0
    if pending:
        buckets.append(pending)
    return buckets


def bucket_numel(total: int, group_size: int, zero_stage: int) -> tuple[int, int]:
    """``(numel, shard_numel)`` of a bucket of ``total`` gradient elements reduced over ``group_size`` ranks: under
    ZeRO the bucket is padded to a multiple of the group so that every rank owns an equal slice."""
    if not zero_stage:
        return total, total
    numel = math.ceil(total / group_size) * group_size
    return numel, numel // group_size


def _reduce_scatter(out: Tensor, full: Tensor, group: dist.ProcessGroup) -> dist.Work:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(out, full, group=group, async_op=True)


@dataclass
class _Bucket:
    group: Optional[dist.ProcessGroup]  # the group it is reduced (and, under ZeRO, sharded) over
    params: list[nn.Parameter]
    offsets: list[int]  # start of each param in the flat bucket
    numel: int  # padded to a multiple of its group's size (under ZeRO)
    dtype: torch.dtype
    device: torch.device
    shard_start: int  # this rank's owned range [shard_start, shard_start + shard_numel)
    shard_numel: int
    buffer: Optional[Tensor] = None  # full-size gradients (persistent for stages 0-1, transient for 2)
    shard: Optional[Tensor] = None  # owned summed gradients: a view of buffer (stage 1) or persistent (stage 2)
    arrivals: int = 0  # gradient arrivals per backward pass: one per parameter and pipeline stage using it
    ready: int = 0
    launched: bool = False
    pending: list[tuple[Waitable, Optional[Tensor]]] = field(default_factory=list)
    # its reduced owned values are final but for the normalisation (ZeRO 0-1, no partial sums): on_bucket_reduced
    final_when_reduced: bool = False


class Waitable(Protocol):
    """A collective's ``dist.Work``, or work queued on the reduced gradients (``on_bucket_reduced``): ``wait()``
    orders what the caller does next after it (on CUDA, the current stream; elsewhere, the host)."""

    def wait(self) -> object: ...


class OwnedPiece(NamedTuple):
    """The flat range ``[start, stop)`` of ``param`` whose summed gradient (and update) this rank owns."""

    param: nn.Parameter
    bucket: _Bucket
    offset: int  # of the param in the bucket
    start: int
    stop: int


class GradientSynchronizer:
    """Owns the gradient buffers of ``params`` and their reduction over ``data_parallel_group``.

    Per optimizer step: ``start_micro_batch(sync=...)`` before each micro-batch's backward
    (``sync=True`` for the last one; ``backward_passes`` when a pipeline schedule runs several
    backwards in one go), ``finish(num_tokens)`` before the optimizer reads gradients,
    ``zero()`` after the step.

    ``partial_grad_groups`` lists gradients (flat ranges of parameters) that are partial sums over
    some other group (``optim.partial_grads.partial_grad_groups``: sequence-parallel replicated
    parameters over tp, a pipeline-tied embedding over the embedding group, replicated ranges of
    a segmented tp shard over a tp subgroup); they are summed there, one all-reduce per group.

    ``expert_data_parallel_group``: where the ``expert_parallel`` parameters are reduced (default: dp).
    ``device``: the run's device, where the token count is summed when this rank has no bucket (a pipeline stage
    without trainable parameters): collectives take tensors on that device only (NCCL: the accelerator).

    ``on_bucket_reduced(bucket, reduced, work)``: called when the reduction of a bucket whose reduced values need
    nothing but the normalisation (``final_when_reduced``: ZeRO 0-1, which reduce once per step, and no partial
    sums in it) is launched, in the last micro-batch's backward: ``reduced`` holds this rank's owned range of the
    bucket (``shard_numel`` elements, in its dtype) once ``work`` is done (None: it already does). The offloaded
    optimizer starts its device-to-host copies there (``MainParamOptimizer``), overlapping the rest of backward;
    what it returns (``Waitable`` or None) is waited for before :meth:`finish` writes the bucket.
    ``on_bucket_final(bucket, scale)``: called with each bucket in :meth:`finish` as soon as its gradients are final
    (reduced, partial sums added, multiplied by ``scale`` in the bucket's dtype; None: left as they were), before the
    next bucket is normalised: the other buckets' copies start there, overlapping the rest of the gradient work.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        *,
        data_parallel_group: Optional[dist.ProcessGroup],
        partial_grad_groups: Sequence[PartialGrads] = (),
        bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB,
        zero_stage: int = 0,
        expert_data_parallel_group: Optional[dist.ProcessGroup] | str = "data_parallel_group",
        device: Optional[torch.device] = None,
    ) -> None:
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}.")
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"GradientSynchronizer handles zero_stage 0, 1 or 2, got {zero_stage}.")
        self.data_parallel_group = data_parallel_group
        if expert_data_parallel_group == "data_parallel_group":
            expert_data_parallel_group = data_parallel_group
        self.expert_data_parallel_group = expert_data_parallel_group
        self.zero_stage = zero_stage
        self.params = [p for p in dict.fromkeys(params) if p.requires_grad]
        self.partial_grad_groups = list(partial_grad_groups)
        self.device = device
        self.sync = True
        self.backward_passes = 1
        self.buckets: list[_Bucket] = []
        self.on_bucket_reduced: Optional[Callable[[_Bucket, Tensor, Optional[dist.Work]], Optional[Waitable]]] = None
        self.on_bucket_final: Optional[Callable[[_Bucket, Optional[float]], None]] = None
        self._bucket_of: dict[int, tuple[_Bucket, int]] = {}
        tied = {id(p) for partial in self.partial_grad_groups for p, _, _ in partial.parts
                if getattr(p, "pipeline_tied", False)}
        self._build_buckets(int(bucket_size_mb * 2**20), tied)
        summed = {id(p) for partial in self.partial_grad_groups for p, _, _ in partial.parts}
        for bucket in self.buckets:  # ZeRO-2 adds each micro-batch's reduction in finish(): not final before
            bucket.final_when_reduced = zero_stage < 2 and not any(id(p) in summed for p in bucket.params)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

    # ---------------------------------------------------------------- layout
    def _build_buckets(self, bucket_bytes: int, own_bucket: set[int]) -> None:
        for params in cut_buckets(self.params, bucket_bytes=bucket_bytes, group_of=self._group_of,
                                  own_bucket=own_bucket):
            self._add_bucket(params)

    def _group_of(self, param: nn.Parameter) -> Optional[dist.ProcessGroup]:
        if getattr(param, "expert_parallel", False):
            return self.expert_data_parallel_group
        return self.data_parallel_group

    def _add_bucket(self, params: list[nn.Parameter]) -> None:
        offsets, total = [], 0
        for param in params:
            offsets.append(total)
            total += param.numel()
        group = self._group_of(params[0])
        size, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
        numel, shard_numel = bucket_numel(total, size, self.zero_stage)
        shard_start = rank * shard_numel if self.zero_stage else 0  # stage 0: every rank "owns" everything
        bucket = _Bucket(group=group, params=params, offsets=offsets, numel=numel, dtype=params[0].dtype,
                         device=params[0].device, shard_start=shard_start, shard_numel=shard_numel,
                         arrivals=sum(getattr(p, "pipeline_stage_uses", 1) for p in params))
        if self.zero_stage < 2:
            bucket.buffer = torch.zeros(numel, dtype=bucket.dtype, device=bucket.device)
            bucket.shard = bucket.buffer.narrow(0, shard_start, shard_numel)
        else:
            bucket.shard = torch.zeros(shard_numel, dtype=bucket.dtype, device=bucket.device)
        for index, param in enumerate(params):
            self._bucket_of[id(param)] = (bucket, index)
        self.buckets.append(bucket)

    def _grad_view(self, bucket: _Bucket, index: int) -> Tensor:
        if bucket.buffer is None:  # stage 2: the full buffer lives for one backward
            bucket.buffer = torch.zeros(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        param = bucket.params[index]
        return bucket.buffer.narrow(0, bucket.offsets[index], param.numel()).view_as(param)

    def owned_pieces(self) -> Iterator[OwnedPiece]:
        for bucket in self.buckets:
            lo, hi = bucket.shard_start, bucket.shard_start + bucket.shard_numel
            for param, offset in zip(bucket.params, bucket.offsets):
                start, stop = max(lo, offset), min(hi, offset + param.numel())
                if start < stop:
                    yield OwnedPiece(param, bucket, offset, start - offset, stop - offset)

    @staticmethod
    def owned_grad(piece: OwnedPiece, shard: Optional[Tensor] = None) -> Tensor:
        """The summed gradient of an owned piece, as a view of its bucket's shard (or of ``shard``, laid out like
        it: the ``reduced`` tensor of ``on_bucket_reduced``)."""
        shard = piece.bucket.shard if shard is None else shard
        return shard.narrow(0, piece.offset + piece.start - piece.bucket.shard_start, piece.stop - piece.start)

    # ---------------------------------------------------------------- backward
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket, index = self._bucket_of[id(param)]
        self._grad_view(bucket, index).add_(param.grad)
        param.grad = None
        bucket.ready += 1
        complete = bucket.ready == bucket.arrivals * self.backward_passes
        if complete and (self.sync or self.zero_stage == 2):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.launched = True
        group = bucket.group
        if self.zero_stage == 0:
            work = None if group is None else dist.all_reduce(bucket.buffer, group=group, async_op=True)
            if work is not None:
                bucket.pending.append((work, None))
            self._reduced(bucket, bucket.shard, work)
            return
        if self.zero_stage == 2 and group is None:
            bucket.shard.add_(bucket.buffer)
            bucket.buffer = None
            return
        if group is None:
            self._reduced(bucket, bucket.shard, None)
            return
        out = torch.empty(bucket.shard_numel, dtype=bucket.dtype, device=bucket.device)
        work = _reduce_scatter(out, bucket.buffer, group)
        bucket.pending.append((work, out))
        if self.zero_stage == 2:
            bucket.buffer = None  # the collective holds its own reference until it completes
        else:
            self._reduced(bucket, out, work)

    def _reduced(self, bucket: _Bucket, reduced: Tensor, work: Optional[dist.Work]) -> None:
        """Hand ``on_bucket_reduced`` the tensor that holds the owned reduced values of ``bucket`` once ``work``
        is done; what it returns is waited for (in :meth:`_wait`) before :meth:`finish` writes the bucket."""
        if self.on_bucket_reduced is None or not bucket.final_when_reduced:
            return
        done = self.on_bucket_reduced(bucket, reduced, work)
        if done is not None:
            bucket.pending.append((done, None))

    def _wait(self, bucket: _Bucket) -> None:
        for work, out in bucket.pending:
            work.wait()
            if out is not None:
                if self.zero_stage == 1:
                    bucket.shard.copy_(out)
                else:
                    bucket.shard.add_(out)
        bucket.pending.clear()

    def start_micro_batch(self, *, sync: bool, backward_passes: int = 1) -> None:
        """Begin a micro-batch; ``sync=True`` lets buckets reduce as soon as they are complete."""
        self.sync, self.backward_passes = sync, backward_passes
        for bucket in self.buckets:
            bucket.ready = 0

    def finish(self, num_tokens: Tensor, backward_scale: float = 1.0, also_sum: Optional[Tensor] = None
               ) -> Optional[Tensor]:
        """Complete every reduction and turn the gradients into those of the per-token mean.

        ``num_tokens`` is this rank's token count for the step; it is summed over dp here, and
        ``also_sum`` with it (returned summed; see :func:`sum_tokens`).
        ``backward_scale`` is what the backward passes multiplied the token-summed loss by (a
        normaliser guessed up front, an fp16 loss scale); it is divided out.
        At stage 0 ``param.grad`` is then the per-token-mean gradient; at stages 1-2 the owned
        slices hold it (see :meth:`owned_grad`).
        """
        for bucket in self.buckets:
            needs_launch = bucket.buffer is not None if self.zero_stage == 2 else not bucket.launched
            if needs_launch:
                self._launch(bucket)
        device = self.buckets[0].device if self.buckets else (self.device or torch.device("cpu"))
        num_tokens, also_sum = sum_tokens(num_tokens, self.data_parallel_group, device, also_sum)
        for bucket in self.buckets:
            self._wait(bucket)
        self._sum_partial_grads()
        scale = 1.0 / (max(float(num_tokens), 1.0) * backward_scale)
        rescale = not changes_nothing(scale, (bucket.dtype for bucket in self.buckets))
        for bucket in self.buckets:
            if rescale:
                bucket.shard.mul_(scale)
            if self.zero_stage == 0:
                for index, param in enumerate(bucket.params):
                    param.grad = self._grad_view(bucket, index)
            if self.on_bucket_final is not None:
                self.on_bucket_final(bucket, scale if rescale else None)
        return also_sum

    def _sum_partial_grads(self) -> None:
        """Sum the owned parts of partial gradients; their layouts agree across the summing group
        (identical local shapes over tp; a bucket of its own for the tied embedding)."""
        for partial in self.partial_grad_groups:
            ranges = partial.ranges_by_param()
            owned = []
            for piece in self.owned_pieces():
                for start, stop in ranges.get(id(piece.param), ()):
                    lo, hi = max(start, piece.start), min(stop, piece.stop)
                    if lo < hi:
                        owned.append(self.owned_grad(piece).narrow(0, lo - piece.start, hi - lo))
            sum_over_group(owned, partial.group)

    def zero(self) -> None:
        """Reset after the optimizer step; ``param.grad`` is dropped so the next backward starts clean."""
        for bucket in self.buckets:
            if bucket.buffer is not None:
                bucket.buffer.zero_()
            bucket.shard.zero_()
            bucket.launched = False
            bucket.ready = 0
            for param in bucket.params:
                param.grad = None

    def drop_grads(self) -> None:
        """Skip this step (zero_stage 0, no fp32 main params): torch optimizers leave parameters without a
        gradient untouched; ``zero`` clears the buffers after the step as usual."""
        for param in self.params:
            param.grad = None

    def gradient_bytes(self) -> int:
        """Bytes of persistent gradient storage on this rank (transient stage-2 buffers excluded)."""
        if self.zero_stage == 2:
            return sum(b.shard.numel() * b.shard.element_size() for b in self.buckets)
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


class LocalGradients:
    """``GradientSynchronizer``'s contract for a single replica (dp=1, no ZeRO, no fp32 main params).

    With nothing to reduce over dp, gradients stay where autograd puts them (``param.grad``):
    no per-parameter hook and no copy into a flat buffer, which is what a plain PyTorch loop
    costs. ``finish`` only sums the partial gradients over their groups and divides.
    """

    zero_stage = 0

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        *,
        partial_grad_groups: Sequence[PartialGrads] = (),
    ) -> None:
        self.params = [p for p in dict.fromkeys(params) if p.requires_grad]
        self.partial_grad_groups = list(partial_grad_groups)
        self._dtypes = {p.dtype for p in self.params}

    def start_micro_batch(self, *, sync: bool, backward_passes: int = 1) -> None:
        """Nothing to schedule: there is no data-parallel reduction."""

    def finish(self, num_tokens: Tensor, backward_scale: float = 1.0, also_sum: Optional[Tensor] = None
               ) -> Optional[Tensor]:
        for partial in self.partial_grad_groups:
            sum_over_group([flat_part(p.grad, start, stop) for p, start, stop in partial.parts if p.grad is not None],
                           partial.group)
        scale = 1.0 / (max(float(num_tokens), 1.0) * backward_scale)
        if not changes_nothing(scale, self._dtypes):
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, scale)
        return also_sum  # one replica: nothing to sum it over

    def zero(self) -> None:
        for param in self.params:
            param.grad = None

    def drop_grads(self) -> None:
        """Skip this step: torch optimizers leave parameters without a gradient untouched."""
        self.zero()

    def gradient_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)

    def remove(self) -> None:
        """No hooks to remove."""
