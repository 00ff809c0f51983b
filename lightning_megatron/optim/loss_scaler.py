"""Dynamic loss scaling for fp16 (Micikevicius et al. 2018), with Megatron-LM's hysteresis.

fp16 gradients underflow unless the loss is multiplied by a large scale before backward.
After each step the scale grows by ``growth_factor`` once ``growth_interval`` steps in a
row had finite gradients; a step with an inf/NaN gradient on *any* rank is skipped on
*every* rank, and after ``hysteresis`` such steps (not necessarily consecutive) the scale
shrinks by ``backoff_factor``. The decision must be the same everywhere, so the overflow
check is an all-reduce over the whole world (``found_overflow``).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor


def nonfinite_flag(grads: Iterable[Optional[Tensor]], device: torch.device) -> Tensor:
    """1.0 if any of ``grads`` holds an inf/NaN, else 0.0: a float32 scalar on ``device``, with no host sync.

    One fused check per device the gradients are on (``torch._amp_foreach_non_finite_check_and_unscale_``, as
    GradScaler runs it, with an unscale by exactly 1, which changes no value), however many pieces there are;
    offloaded gradients (host memory) are checked where they are and only their flag moves to ``device``."""
    by_device: dict[torch.device, list[Tensor]] = {}
    for grad in grads:
        if grad is not None:
            by_device.setdefault(grad.device, []).append(grad)
    flag = torch.zeros((), device=device)
    for where, group in by_device.items():
        found = torch.zeros((), device=where)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, torch.ones((), device=where))
        flag = torch.maximum(flag, found.to(device))
    return flag


def found_overflow(grads: Iterable[Optional[Tensor]], device: torch.device) -> bool:
    """Whether any rank holds a non-finite gradient: one all-reduce over the world, on ``device`` (the strategy's:
    NCCL's accelerator even when the gradients were offloaded), and one host read per step."""
    flag = nonfinite_flag(grads, device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def agree_on_overflow(grad_scaler, device: torch.device) -> None:
    """Make Lightning's ``GradScaler`` (``16-mixed``) decide an overflow for the whole world: after its
    own unscale, its found-inf flags are all-reduced (max), so every rank skips the same steps.

    GradScaler keeps one flag per device its optimizer's gradients are on: host memory under
    ``offload_optimizer``. Collectives take tensors on the strategy's ``device`` only (NCCL refuses host
    tensors), so the flags are combined there, reduced in one all-reduce (one on every rank, whatever number of
    devices its gradients are on) and copied back."""
    unscale = grad_scaler.unscale_

    def unscale_then_agree(optimizer) -> None:
        unscale(optimizer)
        flags = list(grad_scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
        agreed = torch.zeros((), device=device)  # one all-reduce on every rank, with or without gradients
        for flag in flags:
            agreed = torch.maximum(agreed, flag.to(device, torch.float32))
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        for flag in flags:
            flag.copy_(agreed)

    grad_scaler.unscale_ = unscale_then_agree


class DynamicLossScaler:
    def __init__(
        self,
        *,
        initial_scale: float = 2.0**16,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        if not (initial_scale >= min_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1):
            raise ValueError(
                f"Need initial_scale >= min_scale > 0, growth_factor > 1 and 0 < backoff_factor < 1; got "
                f"{initial_scale}, {min_scale}, {growth_factor}, {backoff_factor}."
            )
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(f"growth_interval and hysteresis must be >= 1, got {growth_interval} and {hysteresis}.")
        self.scale = float(initial_scale)
        self.min_scale, self.growth_factor, self.backoff_factor = min_scale, growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self._good_steps = 0
        self._overflows_left = hysteresis
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        """Record a step's outcome (the same on every rank) and adapt the scale."""
        if overflow:
            self.skipped_steps += 1
            self._good_steps = 0
            self._overflows_left -= 1
            if self._overflows_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self._good_steps += 1
        if self._good_steps == self.growth_interval:
            self._good_steps = 0
            self._overflows_left = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "overflows_left": self._overflows_left,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._good_steps = float(state["scale"]), int(state["good_steps"])
        self._overflows_left, self.skipped_steps = int(state["overflows_left"]), int(state["skipped_steps"])
