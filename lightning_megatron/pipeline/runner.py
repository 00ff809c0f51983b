"""Run a model's loss through a ``torch.distributed.pipelining`` schedule.

``PipelineRunner.loss(*args, **kwargs)`` has the contract of the model's own ``loss`` (see
``pipeline/blocks.py`` for the protocol): it returns the same result on every pipeline
rank (the last stage broadcasts the summed loss and metrics). In grad mode it also runs
the backward of every micro-batch, so the strategy skips Lightning's backward. The loss is
a *sum* over tokens and the schedule does not rescale gradients (``scale_grads=False``):
the gradient synchroniser divides by the token count of the global batch, exactly as
without pipelining, so micro-batching never changes the result.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from lightning_megatron.models.router import routing_uncounted
from lightning_megatron.pipeline.layout import check_micro_batches
from lightning_megatron.pipeline.timeline import TimelineRecorder

_SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved_1f1b": ScheduleInterleaved1F1B}


class _Stage(PipelineStage):
    """torch infers the stages' shapes on a schedule's first step by running each stage once more, on stand-in
    inputs (uninitialised ones after the first stage), forward and backward. That pass counts no MoE expert loads
    and no routing statistics (it is not a training step). It keeps the training mode: its backward may recompute
    checkpointed layers, which must see the forward they saved."""

    def _compute_outputs(self, *args, module: nn.Module, **kwargs):
        with routing_uncounted():
            return super()._compute_outputs(*args, module=module, **kwargs)


class PipelineRunner:
    def __init__(
        self,
        stage_modules: list[nn.Module],
        stage_ids: list[int],
        *,
        num_stages: int,
        group: dist.ProcessGroup,
        device: torch.device,
        schedule: str,
        micro_batch_size: int,
        root: nn.Module,
        recorder: Optional[TimelineRecorder] = None,
        before_backward: Optional[Callable[[int, Tensor], None]] = None,
    ) -> None:
        self.stage_modules, self.stage_ids, self.num_stages = stage_modules, stage_ids, num_stages
        self.group, self.device, self.schedule_name = group, device, schedule
        self.micro_batch_size = micro_batch_size
        self.root = root
        self.loss_scale = 1.0  # what the token-summed loss is multiplied by for backward (see the strategy)
        self._extras: list[dict[str, Tensor]] = []
        self.recorder = recorder
        self.before_backward = before_backward
        self.has_first, self.has_last = 0 in stage_ids, num_stages - 1 in stage_ids
        self.last_stage_rank = (num_stages - 1) % dist.get_world_size(group)
        self._schedules: dict[tuple, object] = {}

    def _loss_of_micro_batch(self, output, target: Tensor) -> Tensor:
        loss_sum, extras = self.root.pipeline_loss(output, target)
        self._extras.append({"loss_sum": loss_sum.detach().float(), **{k: v.detach() for k, v in extras.items()}})
        return loss_sum * self.loss_scale if self.loss_scale != 1.0 else loss_sum

    def _schedule(self, micro_batches: int, shape: tuple, training: bool):
        """Stages and schedule are built once per (micro-batch count, input shape, mode)."""
        key = (micro_batches, shape, training)
        if key not in self._schedules:
            stages = [
                _Stage(module, stage_id, self.num_stages, self.device, group=self.group)
                for module, stage_id in zip(self.stage_modules, self.stage_ids)
            ]
            if self.recorder is not None:
                for stage in stages:
                    self.recorder.instrument(stage)
            schedule_class = _SCHEDULES[self.schedule_name]
            target = stages if schedule_class is ScheduleInterleaved1F1B else stages[0]
            self._schedules[key] = schedule_class(
                target, micro_batches, loss_fn=self._loss_of_micro_batch, scale_grads=False
            )
        return self._schedules[key]

    def loss(self, *args, **kwargs):
        """The model's ``loss(...)``, run through the schedule."""
        batch = self.root.pipeline_batch(*args, **kwargs)
        micro_batches = check_micro_batches(
            schedule=self.schedule_name,
            batch_size=batch.target.shape[0],
            micro_batch_size=self.micro_batch_size,
            pipeline_parallel_size=dist.get_world_size(self.group),
        )
        training = torch.is_grad_enabled()
        schedule = self._schedule(micro_batches, tuple(batch.target.shape), training)
        self._extras.clear()
        inputs = batch.inputs if self.has_first else ()
        if training:
            if self.before_backward is not None:
                self.before_backward(micro_batches, batch.num_tokens)
            # The loss sums arrive through pipeline_loss; keeping every micro-batch's output (the logits) to
            # concatenate them at the end would hold m x [micro-batch, seq, vocab / tp] on the last stage.
            schedule.step(*inputs, target=batch.target, return_outputs=False, **batch.side)
        else:
            # Lightning may validate under inference_mode; P2P buffers must be ordinary tensors.
            with torch.inference_mode(False), torch.no_grad():
                clone = lambda t: t.clone()  # noqa: E731
                schedule.eval(*map(clone, inputs), target=batch.target.clone(),
                              **{k: clone(v) for k, v in batch.side.items()})
        totals = [None]
        if self.has_last:
            # The last `micro_batches` calls: a schedule's first step may also call the loss while inferring shapes.
            extras = self._extras[-micro_batches:]
            totals = [{name: sum(extra[name] for extra in extras).cpu() for name in extras[0]}]
        dist.broadcast_object_list(totals, group=self.group, group_src=self.last_stage_rank, device=self.device)
        extras = dict(totals[0])
        loss_sum = extras.pop("loss_sum").to(self.device)
        return self.root.pipeline_result(loss_sum, batch.num_tokens, {k: v.to(self.device) for k, v in extras.items()})
