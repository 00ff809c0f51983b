"""One optimizer step, from Lightning's micro-batches to the optimizer: :class:`StepDriver`.

Lightning hands the strategy micro-batches (``training_step``, ``backward``) and then one ``optimizer_step``,
whose closure runs the last micro-batch. The driver owns what happens in between, in this order:

1. per micro-batch: start the data-parallel reduction (or hold it inside gradient accumulation), count the
   tokens and note whether the loss is finite; each backward multiplies the token-summed loss by
   :meth:`backward_scale` (the normaliser of ``optim.step.StepGradients`` times the fp16 loss scale: ours under
   ``16-true``, Lightning's GradScaler under ``16-mixed``, which scales by itself except under pipelining);
2. after the closure: **finish** the reduction (normalise, hand the pieces to the fp32 main parameters; fp16:
   agree on an overflow and log the loss scale), then the **non-finite check** (``optim.nonfinite``), which
   measures the global gradient norm; the driver keeps that norm for this step;
3. Lightning's ``on_before_optimizer_step`` and ``configure_gradient_clipping`` then **clip**: Lightning clips
   through ``precision_plugin.clip_grad_by_norm``, which :meth:`StepDriver.bind` points at :meth:`clip` (the one
   seam: Lightning's own ``clip_grad_norm_`` would clip each rank by its own shards' norm), and the clip reuses
   the kept norm, so it adds no collective;
4. the optimizer **steps**; :meth:`after_step` finishes the main parameters (their all-gathers may stay in flight
   under ``overlap_param_gather``: :meth:`wait_for_parameters`) and zeroes the buffers.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Generator, Mapping, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_megatron.optim.loss_scaler import DynamicLossScaler, agree_on_overflow
from lightning_megatron.optim.main_params import MainParamOptimizer
from lightning_megatron.optim.nonfinite import NonFiniteCheck
from lightning_megatron.optim.step import StepGradients, build_step_gradients
from lightning_megatron.optim.zero3 import ZeRO3
from lightning_megatron.parallel.state import ParallelState
from lightning_megatron.pipeline.runner import PipelineRunner
from lightning_megatron.strategy.options import StrategyOptions


class StepDriver:
    """The strategy's optimizer steps: made with the strategy (its non-finite counters last for its life), bound to
    the precision plugin at each set-up (:meth:`bind`), started for each fit (:meth:`start`), removed at teardown.

    ``nonfinite``: the non-finite policy and its counters; ``loss_scaler``: ours under ``16-true`` (else None);
    ``gradients``: this fit's ``StepGradients`` (None outside a fit); ``main_params``: the fp32 main parameters of
    the last fit (they outlive its teardown: a checkpoint saved after ``fit`` needs them); ``pipeline``: the
    schedule's runner under pipelining, whose backward the driver scales.
    """

    def __init__(self, options: StrategyOptions) -> None:
        self.nonfinite = NonFiniteCheck(options.on_nonfinite, options.max_consecutive_skips)
        self.loss_scaler: Optional[DynamicLossScaler] = None
        self.gradients: Optional[StepGradients] = None
        self.main_params: Optional[MainParamOptimizer] = None
        self.pipeline: Optional[PipelineRunner] = None
        self._grad_scaler = None  # Lightning's GradScaler (16-mixed)
        self._zero3: Optional[ZeRO3] = None
        self._module: Optional[nn.Module] = None
        self._blocking_sync = False
        self._micro_batch_weight: Tensor | float = 1.0
        self._norm: Optional[Tensor] = None  # this step's norm: measured by the check, reused by the clip

    # ------------------------------------------------------------------ set-up
    def bind(self, precision_plugin: Any, device: torch.device, options: StrategyOptions) -> None:
        """fp16's one overflow decision for the whole world, whichever precision flavour runs it; and Lightning's
        clip seam: its ``Precision.clip_gradients`` calls ``clip_grad_by_norm``, which now clips by the global norm."""
        precision = getattr(precision_plugin, "precision", "32-true")
        if precision == "16-true":
            self.loss_scaler = DynamicLossScaler(**options.loss_scaler_settings)
        self._grad_scaler = getattr(precision_plugin, "scaler", None)
        if precision == "16-mixed" and self._grad_scaler is not None:
            agree_on_overflow(self._grad_scaler, device)
        precision_plugin.clip_grad_by_norm = self.clip

    def start(self, module: nn.Module, state: ParallelState, optimizers: list, options: StrategyOptions, *,
              zero3: Optional[ZeRO3], device: torch.device, ranks_sharing_host: int) -> None:
        """This fit's gradient path (``optim.step.build_step_gradients``), after Lightning built the optimizers;
        ``options``: the strategy's as they are now ("auto" sizes resolved)."""
        fp16 = self.loss_scaler is not None or self._grad_scaler is not None
        # fp16's loss scaler (ours, or Lightning's GradScaler, whose gradients are still scaled when the check
        # would run) skips overflowing steps itself.
        check = self.nonfinite if self.nonfinite.enabled and not fp16 else None
        self._module, self._zero3 = module, zero3
        self.gradients = build_step_gradients(module, state, optimizers, options, zero3=zero3,
                                              loss_scaler=self.loss_scaler, nonfinite=check, device=device,
                                              ranks_sharing_host=ranks_sharing_host)
        self.main_params = self.gradients.main_params

    def remove(self) -> None:
        """Teardown: the gradient hooks and buffers go; the main parameters stay for a checkpoint after fit."""
        if self.gradients is not None:
            self.gradients.remove()
            self.gradients = None

    def wait_for_parameters(self) -> None:
        """Complete ZeRO 1/2's parameter all-gathers still in flight after a step (``overlap_param_gather``)."""
        if self.main_params is not None:
            self.main_params.wait_for_params()

    # ------------------------------------------------------------------ micro-batches
    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning wraps every micro-batch but the last of an accumulation window in this."""
        self._blocking_sync = True
        try:
            yield
        finally:
            self._blocking_sync = False

    def start_micro_batch(self) -> None:
        if self.gradients is not None:
            # ZeRO-3 reduce-scatters every micro-batch: accumulating unsharded gradients would break its memory bound.
            self.gradients.sync.start_micro_batch(sync=not self._blocking_sync or self._zero3 is not None)

    def record(self, output: Any) -> None:
        """The tokens and loss ``training_step`` returned (``{"loss", "num_tokens"}`` or a loss)."""
        tokens = output.get("num_tokens") if isinstance(output, Mapping) else None
        self._micro_batch_weight = tokens.detach() if isinstance(tokens, Tensor) else 1.0
        if self.gradients is not None:
            self.gradients.add_tokens(self._micro_batch_weight)
            loss = output.get("loss") if isinstance(output, Mapping) else output
            if isinstance(loss, Tensor):  # under pipelining every stage has it: the runner broadcasts it over pp
                self.gradients.add_loss(loss)

    def backward_factor(self, accumulation: int) -> Tensor:
        """What Lightning's backward multiplies the micro-batch's loss by: Lightning divided it by
        ``accumulate_grad_batches`` and the module returned a per-token mean; undo both, in one factor (exactly 1
        for one replica without accumulation)."""
        return self._micro_batch_weight * (accumulation * self.backward_scale(self._micro_batch_weight, accumulation))

    def before_pipeline_backward(self, micro_batches: int, num_tokens: Tensor, accumulation: int) -> None:
        """The pipeline schedule's hook before its backwards: the reduction starts, the loss sum gets its factor."""
        if self.gradients is not None:
            self.gradients.sync.start_micro_batch(sync=not self._blocking_sync, backward_passes=micro_batches)
            self.pipeline.loss_scale = float(self.backward_scale(num_tokens, accumulation))

    def backward_scale(self, micro_batch_tokens: Tensor | float, accumulation: int) -> Tensor:
        # Our fp16 scaler scales in backward; Lightning's GradScaler (16-mixed) does so itself in
        # pre_backward, except under pipelining, where Lightning's backward is skipped.
        loss_scale = self._current_loss_scale() if self.pipeline is not None else \
            self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        return self.gradients.backward_scale(micro_batch_tokens, accumulation=accumulation, loss_scale=loss_scale)

    def _current_loss_scale(self) -> float:
        if self.loss_scaler is not None:
            return self.loss_scaler.scale
        return float(self._grad_scaler.get_scale()) if self._grad_scaler is not None else 1.0

    # ------------------------------------------------------------------ the step
    def step(self, optimizer: Optimizer, closure: Callable[[], Any], run: Callable[[Callable[[], Any]], Any],
             trainer: Any) -> Any:
        """Lightning's optimizer step (``run``: the precision plugin's, given the closure), with the closure
        followed by finish and check; Lightning's hooks and the clip then run, then the optimizer."""

        def closure_then_finish_and_check() -> Any:
            result = closure()
            if self.gradients is not None:
                accumulation = trainer.accumulate_grad_batches
                loss_scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
                overflow = self.gradients.finish(accumulation=accumulation, loss_scale=loss_scale)
                self._log_loss_scale(overflow)
                self._norm = self._check_nonfinite(optimizer, trainer)
            return result

        output = run(closure_then_finish_and_check)
        self._norm = None
        if self.gradients is not None:
            self.gradients.after_step()
        return output

    def clip(self, optimizer: Optimizer, clip_val: int | float) -> Tensor:
        """Clip by the global norm over tp, pp and dp (``optim.clip``); the norm the check measured this step,
        if it did (then no second all-reduce). Lightning's precision plugin calls this (:meth:`bind`)."""
        if self._zero3 is not None:
            return self._zero3.clip_grad_norm_(float(clip_val), norm=self._norm)
        return self.gradients.clip(optimizer.param_groups, float(clip_val), norm=self._norm)

    def _log_loss_scale(self, overflow: bool) -> None:
        if self.loss_scaler is None:
            return
        if overflow:
            rank_zero_warn(f"fp16 overflow: step skipped on every rank, loss scale now {self.loss_scaler.scale:g}")
        self._module.log("loss_scale", self.loss_scaler.scale, on_step=True, on_epoch=False)
        self._module.log("skipped_steps", float(self.loss_scaler.skipped_steps), on_step=True, on_epoch=False)

    def _check_nonfinite(self, optimizer: Optimizer, trainer: Any) -> Optional[Tensor]:
        """Raise (or skip the step) on every rank if a loss or the global gradient norm is not finite
        (``optim/nonfinite.py``); returns the norm, which the clip reuses. Same parameters as the clip."""
        norm, skipped = self.gradients.check_finite(optimizer.param_groups, step=trainer.global_step,
                                                    epoch=trainer.current_epoch)
        if skipped is not None:
            rank_zero_warn(skipped)
        if self.gradients.nonfinite is not None and self.nonfinite.mode == "skip":
            self._module.log("skipped_steps", float(self.nonfinite.skipped_steps), on_step=True, on_epoch=False)
        return norm
