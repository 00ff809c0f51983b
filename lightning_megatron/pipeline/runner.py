"""Run a model's loss through a ``torch.distributed.pipelining`` schedule.

``PipelineRunner.loss(*args, **kwargs)`` has the contract of the model's own ``loss`` (see
``pipeline/blocks.py`` for the protocol): it returns the same result on every pipeline
rank (the last stage broadcasts the summed loss and metrics). In grad mode it also runs
the backward of every micro-batch, so the strategy skips Lightning's backward. The loss is
a *sum* over tokens and the schedule does not rescale gradients (``scale_grads=False``):
the gradient synchroniser divides by the token count of the global batch, exactly as
without pipelining, so micro-batching never changes the result.

Zero-bubble schedules (``interleaved_zero_bubble``, ``zbv``, ``dualpipev``) split each backward
into an input-gradient pass (what the previous stage waits for) and a weight-gradient pass run
later, in what would be bubbles. torch's weight pass writes ``param.grad`` itself, past autograd's
accumulation, so gradient hooks (the data-parallel buckets' ``post_accumulate_grad`` hooks) would
never see those gradients. Here the weight pass asks autograd to accumulate them
(:func:`accumulate_weight_gradients`): every hook fires as in a full backward, once per
micro-batch and stage, so the dp reduction, ZeRO and the tied-embedding sum work unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                          ScheduleZBVZeroBubble)
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, stage_backward_input
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from lightning_megatron.pipeline.inference import PipelineInference
from lightning_megatron.pipeline.layout import SCHEDULE_SPECS, check_micro_batches, rank_of_stage
from lightning_megatron.pipeline.timeline import TimelineRecorder

_SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved_1f1b": ScheduleInterleaved1F1B,
              "interleaved_zero_bubble": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
              "dualpipev": ScheduleDualPipeV}


def _stage_parameters(module: nn.Module) -> list[nn.Parameter]:
    """What a stage's forward uses (``StageModule.stage_parameters``; any other module: its own parameters)."""
    own = getattr(module, "stage_parameters", None)
    return own() if own is not None else list(module.parameters())


def accumulate_weight_gradients(params: list[nn.Parameter], param_groups: list[dict]) -> None:
    """The weight-gradient pass of a split backward, accumulated into ``param.grad`` by autograd.

    ``param_groups`` is what torch's input-gradient pass (``stage_backward_input``) saved: per group of
    parameters, the intermediate nodes where their gradient paths meet the input's, and the gradients that
    reached those nodes. Backward from those nodes to the parameters gives the weight gradients; with the
    parameters as ``inputs`` of ``torch.autograd.backward`` autograd accumulates them, running each
    parameter's hooks, where torch's own pass computes them with ``autograd.grad`` and assigns ``.grad``.
    """
    param_of = {_get_grad_fn_or_grad_acc(p): p for p in params if p.requires_grad}
    for group in param_groups:
        intermediates, saved = group.pop("intermediates"), group.pop("grads", None)
        if saved is None:
            continue  # no gradient reached this group in the input pass
        edges, grads = [], []
        for node, node_grads in zip(intermediates, saved):
            for index, grad in enumerate(node_grads):
                if grad is not None:
                    edges.append(GradientEdge(node, index))
                    grads.append(grad)
        # A group's intermediates may feed one another: each gets only its saved gradient, never a second
        # contribution through the other, or it would count twice.
        handles = [node.register_prehook(lambda _, kept=node_grads: kept)
                   for node, node_grads in zip(intermediates, saved)] if len(intermediates) > 1 else []
        try:
            if edges:
                torch.autograd.backward(edges, grads, inputs=[param_of[node] for node in group["params"]])
        finally:
            for handle in handles:
                handle.remove()


class _Stage(PipelineStage):
    """torch infers the stages' shapes on a schedule's first step by running each stage once more, on stand-in
    inputs (uninitialised ones after the first stage), forward and backward. That pass is not a training step: it
    runs inside the root's ``shape_inference()`` context where the model declares one (``pipeline/blocks.py``; an
    MoE model's counts no expert loads and no routing statistics). It keeps the training mode: its backward may
    recompute checkpointed layers, which must see the forward they saved."""

    def __init__(self, *args, shape_inference: Callable[[], ContextManager], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shape_inference = shape_inference

    def _compute_outputs(self, *args, module: nn.Module, **kwargs):
        with self.shape_inference():
            return super()._compute_outputs(*args, module=module, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        """A split backward's two passes over every parameter the stage uses (the root's embedding and head too),
        the weight pass accumulated through autograd (see the module docstring). A full backward is torch's."""
        if backward_type == "input":
            return stage_backward_input(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                        bwd_kwargs["input_values"], iter(_stage_parameters(self.submod)))
        if backward_type == "weight":
            accumulate_weight_gradients(_stage_parameters(self.submod), bwd_kwargs["param_groups"])
            return (), None
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)


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
        overlap_p2p_comm: bool = True,
    ) -> None:
        """``overlap_p2p_comm``: the multi-stage schedules (interleaved 1F1B, the zero-bubble ones) post each receive
        as early as their action table allows, so it completes under the compute before its use; ``False`` posts it
        just before (torch's ``defer_pp_recv``: fewer buffers waiting). 1F1B and GPipe batch their sends and receives
        per step either way."""
        self.stage_modules, self.stage_ids, self.num_stages = stage_modules, stage_ids, num_stages
        self.group, self.device, self.schedule_name = group, device, schedule
        self.micro_batch_size = micro_batch_size
        self.root = root
        self.loss_scale = 1.0  # what the token-summed loss is multiplied by for backward (see the strategy)
        self._extras: list[dict[str, Tensor]] = []
        self.recorder = recorder
        self.before_backward = before_backward
        self.overlap_p2p_comm = overlap_p2p_comm
        self.has_first, self.has_last = 0 in stage_ids, num_stages - 1 in stage_ids
        self.last_stage_rank = rank_of_stage(num_stages - 1, dist.get_world_size(group), schedule)
        self._schedules: dict[tuple, object] = {}
        self._forward_only: Optional[PipelineInference] = None  # V placement's evaluation (see its method)

    def _loss_of_micro_batch(self, output, target: Tensor) -> Tensor:
        loss_sum, extras = self.root.pipeline_loss(output, target)
        self._extras.append({"loss_sum": loss_sum.detach().float(), **{k: v.detach() for k, v in extras.items()}})
        return loss_sum * self.loss_scale if self.loss_scale != 1.0 else loss_sum

    def _schedule(self, micro_batches: int, shape: tuple, training: bool):
        """Stages and schedule are built once per (micro-batch count, input shape, mode)."""
        key = (micro_batches, shape, training)
        if key not in self._schedules:
            stages = [
                _Stage(module, stage_id, self.num_stages, self.device, group=self.group,
                       shape_inference=getattr(self.root, "shape_inference", contextlib.nullcontext))
                for module, stage_id in zip(self.stage_modules, self.stage_ids)
            ]
            if self.recorder is not None:
                for stage in stages:
                    self.recorder.instrument(stage)
            schedule_class = _SCHEDULES[self.schedule_name]
            multi = issubclass(schedule_class, PipelineScheduleMulti)
            self._schedules[key] = schedule_class(
                stages if multi else stages[0], micro_batches, loss_fn=self._loss_of_micro_batch, scale_grads=False,
                **({"defer_pp_recv": not self.overlap_p2p_comm} if multi else {}))
            if self.recorder is not None and hasattr(self._schedules[key], "pipeline_order"):
                self.recorder.action_tables[micro_batches] = self._schedules[key].pipeline_order
        return self._schedules[key]

    def drop_schedules(self) -> None:
        """Forget the schedules built so far, and with them their receive buffers (torch allocates one per
        micro-batch when it builds a schedule): ``lightning-megatron simulate`` warms up with fewer micro-batches
        than the step it measures, whose schedule alone a real run holds."""
        self._schedules.clear()

    def _evaluate_stage_by_stage(self, batch, micro_batches: int) -> None:
        """Forward-only evaluation for the V placement, one micro-batch at a time through the stages in order
        (``PipelineInference``): torch 2.13's V-shaped schedules fail in ``eval()`` where one rank runs two
        consecutive stages (it looks for a backward that forward-only never made)."""
        if self._forward_only is None:
            self._forward_only = PipelineInference(self.stage_modules, self.stage_ids, num_stages=self.num_stages,
                                                   group=self.group, device=self.device, schedule=self.schedule_name,
                                                   for_loss=True)
        pieces = lambda t: t.tensor_split(micro_batches)  # noqa: E731  (the schedules' split along dim 0)
        inputs = [pieces(t) for t in batch.inputs] if self.has_first else []
        side = {name: pieces(value) for name, value in batch.side.items()}
        targets = pieces(batch.target)
        with torch.no_grad():
            for i in range(micro_batches):
                output = self._forward_only(*(chunks[i] for chunks in inputs), **{k: v[i] for k, v in side.items()})
                if self.has_last:
                    self._loss_of_micro_batch(output, targets[i])

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
        self._extras.clear()
        inputs = batch.inputs if self.has_first else ()
        if training:
            schedule = self._schedule(micro_batches, tuple(batch.target.shape), training)
            if self.before_backward is not None:
                self.before_backward(micro_batches, batch.num_tokens)
            # The loss sums arrive through pipeline_loss; keeping every micro-batch's output (the logits) to
            # concatenate them at the end would hold m x [micro-batch, seq, vocab / tp] on the last stage.
            schedule.step(*inputs, target=batch.target, return_outputs=False, **batch.side)
        elif SCHEDULE_SPECS[self.schedule_name].placement == "v":
            self._evaluate_stage_by_stage(batch, micro_batches)
        else:
            # Lightning may validate under inference_mode; P2P buffers must be ordinary tensors.
            schedule = self._schedule(micro_batches, tuple(batch.target.shape), training)
            with torch.inference_mode(False), torch.no_grad():
                clone = lambda t: t.clone()  # noqa: E731
                schedule.eval(*map(clone, inputs), target=batch.target.clone(),
                              **{k: clone(v) for k, v in batch.side.items()})
        # What a receive leaves where no stage sends (the fake process group of ``lightning-megatron simulate``,
        # which simulates one rank at a time): a loss sum and nothing else.
        totals = [{"loss_sum": torch.zeros(())}]
        if self.has_last:
            # The last `micro_batches` calls: a schedule's first step may also call the loss while inferring shapes.
            extras = self._extras[-micro_batches:]
            totals = [{name: sum(extra[name] for extra in extras).cpu() for name in extras[0]}]
        dist.broadcast_object_list(totals, group=self.group, group_src=self.last_stage_rank, device=self.device)
        extras = dict(totals[0])
        loss_sum = extras.pop("loss_sum").to(self.device)
        return self.root.pipeline_result(loss_sum, batch.num_tokens, {k: v.to(self.device) for k, v in extras.items()})
