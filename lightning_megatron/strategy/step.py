"""The step hooks of ``Megatron3DStrategy`` behind fp16 loss scaling and the non-finite check (a mixin;
``strategy.py`` holds the rest of the wiring).

What each micro-batch's backward multiplies its token-summed loss by (the normaliser of ``StepGradients``
times the fp16 loss scale: ours under ``16-true``, Lightning's GradScaler under ``16-mixed``, which scales
by itself except under pipelining), the loss scale's log, and the check that stops or skips a step whose
loss or global gradient norm is not finite. The mixin reads the strategy's ``_step`` (``StepGradients``),
``loss_scaler``, ``nonfinite``, ``_pipeline``, precision plugin and layout, and its ``_main_params``, whose
parameter all-gathers may still be in flight after a step (``overlap_param_gather``).
"""

from __future__ import annotations

from typing import Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_megatron.optim.loss_scaler import DynamicLossScaler, agree_on_overflow
from lightning_megatron.optim.nonfinite import NonFiniteCheck


class StepHooks:
    def wait_for_parameters(self) -> None:
        """Complete ZeRO 1/2's parameter all-gathers still in flight after a step (``overlap_param_gather``).

        The next forward (module by module), checkpoint saves and loads, evaluation and teardown do so
        themselves; call it before reading parameter values anywhere else between a step and the next forward
        (a callback's ``on_train_batch_end``)."""
        if self._main_params is not None:
            self._main_params.wait_for_params()

    def _nonfinite_check(self) -> Optional[NonFiniteCheck]:
        """The check, unless fp16 runs: its loss scaler (ours, or Lightning's GradScaler under ``16-mixed``,
        whose gradients are still scaled when the check would run) skips overflowing steps itself."""
        fp16 = self.loss_scaler is not None or getattr(self.precision_plugin, "scaler", None) is not None
        return self.nonfinite if self.nonfinite.enabled and not fp16 else None

    def _setup_loss_scaling(self) -> None:
        """fp16 needs one overflow decision for the whole world, whichever precision flavour runs it."""
        precision = getattr(self.precision_plugin, "precision", "32-true")
        if precision == "16-true":
            self.loss_scaler = DynamicLossScaler(**self.options.loss_scaler)
        grad_scaler = getattr(self.precision_plugin, "scaler", None)
        if precision == "16-mixed" and grad_scaler is not None:
            agree_on_overflow(grad_scaler, self.root_device)

    def _current_loss_scale(self) -> float:
        if self.loss_scaler is not None:
            return self.loss_scaler.scale
        grad_scaler = getattr(self.precision_plugin, "scaler", None)
        return float(grad_scaler.get_scale()) if grad_scaler is not None else 1.0

    def _backward_scale(self, micro_batch_tokens) -> Tensor:
        # Our fp16 scaler scales in backward; Lightning's GradScaler (16-mixed) does so itself in
        # pre_backward, except under pipelining, where Lightning's backward is skipped.
        loss_scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        if self._pipeline is not None:
            loss_scale = self._current_loss_scale()
        accumulation = self.lightning_module.trainer.accumulate_grad_batches
        return self._step.backward_scale(micro_batch_tokens, accumulation=accumulation, loss_scale=loss_scale)

    def _log_loss_scale(self, overflow: bool) -> None:
        if self.loss_scaler is None:
            return
        if overflow:
            rank_zero_warn(f"fp16 overflow: step skipped on every rank, loss scale now {self.loss_scaler.scale:g}")
        module = self.lightning_module
        module.log("loss_scale", self.loss_scaler.scale, on_step=True, on_epoch=False)
        module.log("skipped_steps", float(self.loss_scaler.skipped_steps), on_step=True, on_epoch=False)

    def _check_nonfinite(self, optimizer: Optimizer) -> Optional[Tensor]:
        """Raise (or skip the step) on every rank if a loss or the global gradient norm is not finite
        (``optim/nonfinite.py``); returns the norm, which the clip reuses. Same parameters as the clip."""
        trainer = self.lightning_module.trainer
        norm, skipped = self._step.check_finite(optimizer.param_groups, step=trainer.global_step,
                                                epoch=trainer.current_epoch)
        if skipped is not None:
            rank_zero_warn(skipped)
        if self._step.nonfinite is not None and self.nonfinite.mode == "skip":
            self.lightning_module.log("skipped_steps", float(self.nonfinite.skipped_steps), on_step=True,
                                      on_epoch=False)
        return norm
