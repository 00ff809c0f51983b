"""Data-parallel gradient reduction into contiguous buckets, overlapped with backward.

Megatron-Core's grad-buffer design: every parameter's gradient accumulates into a view
of one flat buffer (``main_grad``, fp32 for low-precision parameters). The buffer is cut
into buckets in reverse parameter order, roughly the order backward produces them; when
the last gradient of a bucket arrives during the final micro-batch's backward, the
bucket's all-reduce starts asynchronously while backward goes on computing the rest.

The training loss is a sum over tokens (see ``Megatron3DStrategy.backward``); after the
reduction the buffer is divided by the number of tokens in the global batch, so the
gradient is that of the per-token mean over the global batch whatever dp and the
micro-batching are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

DEFAULT_BUCKET_SIZE_MB = 25.0


@dataclass
class _Bucket:
    buffer: Tensor
    params: list[nn.Parameter]
    ready: int = 0
    handle: Optional[dist.Work] = None
    launched: bool = False
    views: list[Tensor] = field(default_factory=list)


def _grad_dtype(param: nn.Parameter) -> torch.dtype:
    return torch.float32 if param.dtype in (torch.float16, torch.bfloat16) else param.dtype


class GradientSynchronizer:
    """Owns the gradient buffers of ``params`` and their reduction over ``data_parallel_group``.

    Per optimizer step: ``start_micro_batch(sync=...)`` before each micro-batch's backward
    (``sync=True`` for the last one; ``backward_passes`` when a pipeline schedule runs several
    backwards in one go), ``finish(num_tokens)`` before the optimizer reads gradients,
    ``zero()`` after the step.

    ``partial_grad_groups`` lists parameters whose gradients are partial sums over some other
    group (replicated parameters under sequence parallelism: the tp group; embeddings tied
    across the first and last pipeline stage: the embedding group); they are summed there.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        *,
        data_parallel_group: Optional[dist.ProcessGroup],
        partial_grad_groups: Sequence[tuple[Sequence[nn.Parameter], dist.ProcessGroup]] = (),
        bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB,
    ) -> None:
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}.")
        self.data_parallel_group = data_parallel_group
        self.partial_grad_groups = [(list(params_), group) for params_, group in partial_grad_groups if params_]
        self.params = [p for p in dict.fromkeys(params) if p.requires_grad]
        self.sync = True
        self.backward_passes = 1
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self._view_of: dict[int, Tensor] = {}
        self._build_buckets(int(bucket_size_mb * 2**20))
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

    def _build_buckets(self, bucket_bytes: int) -> None:
        pending: list[nn.Parameter] = []
        size = 0
        for param in reversed(self.params):
            if pending and (_grad_dtype(param) != _grad_dtype(pending[0]) or size >= bucket_bytes):
                self._add_bucket(pending)
                pending, size = [], 0
            pending.append(param)
            size += param.numel() * torch.empty((), dtype=_grad_dtype(param)).element_size()
        if pending:
            self._add_bucket(pending)

    def _add_bucket(self, params: list[nn.Parameter]) -> None:
        dtype, device = _grad_dtype(params[0]), params[0].device
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        bucket = _Bucket(buffer=buffer, params=params)
        offset = 0
        for param in params:
            view = buffer[offset : offset + param.numel()].view_as(param)
            offset += param.numel()
            bucket.views.append(view)
            self._bucket_of[id(param)] = bucket
            self._view_of[id(param)] = view
            param.main_grad = view
        self.buckets.append(bucket)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        self._view_of[id(param)].add_(param.grad)
        param.grad = None
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        if self.sync and bucket.ready == len(bucket.params) * self.backward_passes:
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.launched = True
        if self.data_parallel_group is not None:
            bucket.handle = dist.all_reduce(bucket.buffer, group=self.data_parallel_group, async_op=True)

    def start_micro_batch(self, *, sync: bool, backward_passes: int = 1) -> None:
        """Begin a micro-batch; ``sync=True`` lets buckets reduce as soon as they are complete."""
        self.sync, self.backward_passes = sync, backward_passes
        for bucket in self.buckets:
            bucket.ready = 0

    def finish(self, num_tokens: Tensor) -> None:
        """Complete every reduction and leave ``param.grad`` as the per-token-mean gradient of the global batch.

        ``num_tokens`` is this rank's token count for the step; it is summed over dp here.
        """
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        num_tokens = num_tokens.detach().to(device=self.buckets[0].buffer.device if self.buckets else "cpu", dtype=torch.float64)
        if self.data_parallel_group is not None:
            dist.all_reduce(num_tokens, group=self.data_parallel_group)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None
        self._sum_partial_grads()
        scale = 1.0 / max(float(num_tokens), 1.0)
        for bucket in self.buckets:
            bucket.buffer.mul_(scale)
            for param, view in zip(bucket.params, bucket.views):
                param.grad = view if view.dtype == param.dtype else view.to(param.dtype)

    def _sum_partial_grads(self) -> None:
        for params, group in self.partial_grad_groups:
            views = [self._view_of[id(p)] for p in params]
            flat = torch.cat([v.reshape(-1) for v in views])
            dist.all_reduce(flat, group=group)
            offset = 0
            for view in views:
                view.copy_(flat[offset : offset + view.numel()].view_as(view))
                offset += view.numel()

    def zero(self) -> None:
        """Reset the buffers after the optimizer step; ``param.grad`` is dropped so the next backward starts clean."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.launched = False
            bucket.ready = 0
            for param in bucket.params:
                param.grad = None

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for param in self.params:
            if hasattr(param, "main_grad"):
                del param.main_grad
