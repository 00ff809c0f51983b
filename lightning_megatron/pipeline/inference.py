"""Forward-only passes through the pipeline, one batch at a time, for generation and prediction.

Training and validation go through ``torch.distributed.pipelining``'s schedules, which split a
batch into micro-batches and need fixed shapes. Generation runs one batch whose sequence length
changes after the prompt (prefill, then one token per step) and keeps a key/value cache in the
layers, so it walks the stages itself: the rank of stage ``s`` receives the hidden states from the
rank of stage ``s - 1``, runs its layers and sends them on; the last stage returns the logits.
Each send is preceded by a small header (shape and dtype), so a receiver needs no knowledge of
the model. Virtual stages work the same way: a rank runs its stages in order.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_megatron.pipeline.layout import rank_of_stage
from lightning_megatron.pipeline.stage import StageModule

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]
_HEADER = 5  # ndim, up to 3 sizes, dtype


class PipelineInference:
    """This rank's stages run forward without a schedule (see the module docstring). ``for_loss``: the last stage
    returns what the model's ``pipeline_loss`` takes (``StageModule.forward``) instead of the logits."""

    def __init__(self, stage_modules: list[StageModule], stage_ids: list[int], *, num_stages: int,
                 group: dist.ProcessGroup, device: torch.device, schedule: str = "1f1b",
                 for_loss: bool = False) -> None:
        self.stages = dict(zip(stage_ids, stage_modules))
        self.for_loss = for_loss
        self.num_stages, self.group, self.device = num_stages, group, device
        self.pipeline_size = dist.get_world_size(group)
        self.schedule = schedule  # its placement says which rank runs which stage
        self.last_stage_rank = self._rank_of(num_stages - 1)
        self.is_last = num_stages - 1 in self.stages

    def _rank_of(self, stage: int) -> int:
        return rank_of_stage(stage, self.pipeline_size, self.schedule)

    def forward(self, *inputs: Tensor, **side) -> Optional[Tensor]:
        """The last stage's output on the rank that runs it; ``None`` on the others."""
        x = None
        for stage_id in range(self.num_stages):
            stage = self.stages.get(stage_id)
            if stage is None:
                continue
            if stage_id > 0 and stage_id - 1 not in self.stages:  # a V placement runs stages p-1 and p on one rank
                x = self._receive(self._rank_of(stage_id - 1))
            run = stage if self.for_loss else stage.logits
            x = run(*inputs, **side) if stage_id == 0 else run(x, **side)
            if stage_id < self.num_stages - 1 and stage_id + 1 not in self.stages:
                self._send(x, self._rank_of(stage_id + 1))
        return x if self.is_last else None

    __call__ = forward

    def broadcast_from_last(self, tensor: Optional[Tensor]) -> Tensor:
        """The last stage's ``tensor`` on every rank of the pipeline (``None`` on the others)."""
        if self.is_last:
            tensor = tensor.contiguous()
            self._broadcast_header(tensor)
            dist.broadcast(tensor, group=self.group, group_src=self.last_stage_rank)
            return tensor
        tensor = self._broadcast_header(None)
        dist.broadcast(tensor, group=self.group, group_src=self.last_stage_rank)
        return tensor

    def _header(self, tensor: Tensor) -> Tensor:
        if tensor.dim() > _HEADER - 2:
            raise ValueError(f"Pipeline inference sends tensors of up to {_HEADER - 2} dimensions, not {tensor.dim()}.")
        sizes = [*tensor.shape, *[0] * (_HEADER - 2 - tensor.dim())]
        return torch.tensor([tensor.dim(), *sizes, _DTYPES.index(tensor.dtype)], dtype=torch.long, device=self.device)

    def _empty(self, header: Tensor) -> Tensor:
        ndim, *sizes, dtype = header.tolist()
        return torch.empty(sizes[:ndim], dtype=_DTYPES[dtype], device=self.device)

    def _send(self, tensor: Tensor, group_rank: int) -> None:
        tensor = tensor.contiguous()
        dist.send(self._header(tensor), group=self.group, group_dst=group_rank)
        dist.send(tensor, group=self.group, group_dst=group_rank)

    def _receive(self, group_rank: int) -> Tensor:
        header = torch.empty(_HEADER, dtype=torch.long, device=self.device)
        dist.recv(header, group=self.group, group_src=group_rank)
        tensor = self._empty(header)
        dist.recv(tensor, group=self.group, group_src=group_rank)
        return tensor

    def _broadcast_header(self, tensor: Optional[Tensor]) -> Optional[Tensor]:
        header = self._header(tensor) if tensor is not None else torch.empty(_HEADER, dtype=torch.long,
                                                                             device=self.device)
        dist.broadcast(header, group=self.group, group_src=self.last_stage_rank)
        return None if tensor is not None else self._empty(header)
