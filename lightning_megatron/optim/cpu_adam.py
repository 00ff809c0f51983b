"""AdamW with a faster step for large CPU tensors: one compiled, vectorised pass per tensor.

Why: with ``offload_optimizer="cpu"`` the optimizer steps ~all of a rank's fp32 main parameters in host memory,
once per step, and that step competes with DeepSpeed's ``DeepSpeedCPUAdam`` (hand-written AVX-512 + OpenMP).
The step is bound by memory traffic (read p, g, m, v; write p, m, v: 28 bytes per parameter) and, on few cores,
by its divisions. torch's fused CPU kernel is one pass but divides twice per element; this one is inductor's
C++ code for the same arithmetic written with one division (``sqrt(v) * (1/sqrt(bc2))`` instead of
``sqrt(v) / sqrt(bc2)``), vectorised (AVX-512/AVX2) and spread over the OpenMP threads of one loop.
``benchmarks/cpu_adam.py`` measures it against DeepSpeed's and torch's kernels side by side.

It stays a :class:`torch.optim.AdamW` (so ``optim.main_params`` wraps it, and its state dict is AdamW's, loadable
either way): only float32 CPU tensors of at least ``min_compiled_numel`` elements, in groups without amsgrad,
maximize, capturable or differentiable, and steps without a ``GradScaler``'s ``grad_scale``, take the compiled
pass; everything else (small tensors, CUDA tensors) takes torch's own AdamW path chosen by ``fused``/``foreach``
as usual. Small tensors never compile anything, so a tiny model costs no compile time. The first compiled step
builds the kernel with the machine's C++ compiler (seconds; cached on disk by inductor); where that fails, a
warning says so and torch's path steps those tensors from then on.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim.adam import adam

MIN_COMPILED_NUMEL = 1 << 18
CHUNK = 16


def _adamw_passes(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                  scalars: Tensor) -> None:
    """One AdamW update of each tensor, in place. ``scalars``: ``1 - lr * wd``, ``beta1``, ``1 - beta1``,
    ``beta2``, ``1 - beta2``, ``1 / sqrt(1 - beta2**t)``, ``eps``, ``-lr / (1 - beta1**t)`` (a tensor, so a new
    step's values reuse the compiled kernel instead of recompiling it for each float)."""
    decay, beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bias_correction2_sqrt, eps, neg_step_size = (
        scalars.unbind())
    for param, grad, exp_avg, exp_avg_sq in zip(params, grads, exp_avgs, exp_avg_sqs):
        m = exp_avg * beta1 + grad * one_minus_beta1
        v = exp_avg_sq * beta2 + grad * grad * one_minus_beta2
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
        param.copy_(param * decay + m / (v.sqrt() * inv_bias_correction2_sqrt + eps) * neg_step_size)


_compiled_passes: Optional[Callable[..., None]] = None


def _kernel() -> Callable[..., None]:
    """The compiled passes over ``CHUNK`` tensors, built once per process: every size is its own symbol
    (``dynamic=True`` without duck sizing, so two tensors that happened to be equal are not assumed to stay so)."""
    global _compiled_passes
    if _compiled_passes is None:
        compiled = torch.compile(_adamw_passes, fullgraph=True, dynamic=True)

        def passes(*args: Any) -> None:
            with torch.fx.experimental._config.patch(use_duck_shape=False):
                compiled(*args)

        _compiled_passes = passes
    return _compiled_passes


class CPUAdamW(torch.optim.AdamW):
    """:class:`torch.optim.AdamW` whose large float32 CPU tensors are stepped by compiled vectorised passes.

    Same arguments as AdamW, plus ``min_compiled_numel``: the smallest tensor that takes the compiled passes (below
    it torch's fused or foreach kernel is as fast). Results equal torch's AdamW to float32 rounding.

    Example::

        optimizer = CPUAdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    """

    def __init__(self, params: Any, *args: Any, min_compiled_numel: int = MIN_COMPILED_NUMEL, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self.min_compiled_numel = min_compiled_numel  # not a group default: AdamW's state dicts load unchanged
        self.compiled_passes_failed = False
        # Stand-ins that fill a short last chunk, so every call has CHUNK tensors and one kernel serves them all.
        self._padding = [[torch.zeros(2) for _ in range(CHUNK)] for _ in range(4)]

    def _takes_compiled_passes(self, group: dict, param: Tensor, grad: Tensor) -> bool:
        return (not self.compiled_passes_failed and param.device.type == "cpu" and param.dtype == torch.float32
                and grad.dtype == torch.float32 and not grad.is_sparse and param.numel() >= self.min_compiled_numel
                and param.is_contiguous() and grad.is_contiguous()
                and not (group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"]))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """AdamW's step: compiled passes for the tensors that take them, torch's AdamW path for the rest."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scaled = getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None
        for group in self.param_groups:
            lists: tuple[list[Tensor], ...] = ([], [], [], [], [], [])
            has_complex = self._init_group(group, *lists)
            compiled: dict[float, list[int]] = {}  # by step count: one set of bias corrections per call
            for i, (param, grad) in enumerate(zip(*lists[:2])):
                if not scaled and self._takes_compiled_passes(group, param, grad):
                    compiled.setdefault(float(lists[5][i]), []).append(i)
            stepped = set()
            for step, indices in compiled.items():
                for start in range(0, len(indices), CHUNK):
                    chunk = indices[start:start + CHUNK]
                    if not self._compiled_passes(group, step + 1, [[values[i] for i in chunk] if values else [] for values in lists]):
                        break
                    stepped.update(chunk)
            rest = tuple([value for i, value in enumerate(values) if i not in stepped] if values else []
                         for values in lists)  # max_exp_avg_sqs is empty without amsgrad
            if rest[0]:
                beta1, beta2 = group["betas"]
                adam(*rest, amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2,
                     lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                     foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
                     fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
                     found_inf=getattr(self, "found_inf", None), decoupled_weight_decay=True)
        return loss

    def _compiled_passes(self, group: dict, step: float, chunk: list[list[Tensor]]) -> bool:
        """Step one chunk (params, grads, exp_avgs, exp_avg_sqs, _, steps) at ``step``; False (nothing changed)
        when the kernel cannot be built."""
        params, grads, exp_avgs, exp_avg_sqs, _, state_steps = chunk
        lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
        beta1, beta2 = (float(beta) for beta in group["betas"])
        scalars = torch.tensor([1 - lr * wd, beta1, 1 - beta1, beta2, 1 - beta2, 1 / math.sqrt(1 - beta2**step),
                                eps, -lr / (1 - beta1**step)], dtype=torch.float32)
        pad = CHUNK - len(params)
        # detached: dynamo compiles an nn.Parameter's sizes in as constants, a plain tensor's as a symbol
        tensors = [[t.detach() for t in ts] + padding[:pad]
                   for ts, padding in zip((params, grads, exp_avgs, exp_avg_sqs), self._padding)]
        try:
            _kernel()(*tensors, scalars)
        except Exception as error:  # no working C++ compiler, or inductor refuses: torch's kernels step instead
            self.compiled_passes_failed = True
            warnings.warn(f"CPUAdamW: the compiled AdamW passes could not be built ({type(error).__name__}: {error});"
                          f" torch's AdamW kernels step every tensor instead.", stacklevel=3)
            return False
        torch._foreach_add_(state_steps, 1)
        return True
