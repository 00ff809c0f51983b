"""AdamW whose CPU step is one OpenMP-parallel, vectorised pass over all its tensors at once.

Why: with ``offload_optimizer`` the optimizer steps every fp32 main piece in host memory each step, and that step
is compared with DeepSpeed's ``DeepSpeedCPUAdam``. torch's fused CPU AdamW and DeepSpeed's kernel both open one
parallel loop per tensor (DeepSpeed also one Python call per tensor), so each of a model's hundreds of tensors pays
a fork/join of the threads, which costs most when a core is busy with something else. This kernel splits the
concatenated elements of all the tensors evenly over the threads in one parallel region: one fork/join per step.
Per element it does what the other two do (read p, g, m, v; write p, m, v; one square root, one division, FMAs),
vectorised by the C compiler for the machine it runs on (``-march=native``: AVX-512 or AVX2).
``benchmarks/cpu_adam.py`` measures it against DeepSpeed's and torch's kernels side by side.

The kernel is a few lines of C built with the system's C compiler (``$CC``, default ``cc``) when first used in a
process, in well under a second, into a temporary directory (not cached: ``-march=native`` code must not be
loaded on another machine's CPU). It runs on ``torch.get_num_threads()`` threads of the OpenMP runtime torch
already loaded (the same ``libgomp``). Where no compiler works, a warning says so and torch's kernels step.
"""

from __future__ import annotations

import ctypes
import math
import os
import subprocess
import tempfile
import warnings
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.optim.adam import adam

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <omp.h>

/* One AdamW step of n float32 tensors, in the order of torch's single-tensor AdamW: p *= 1 - lr*wd;
   m = lerp(m, g, 1 - beta1); v = v*beta2 + (1 - beta2)*g*g; p += -lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps).
   s: 1 - lr*wd, 1 - beta1, beta2, 1 - beta2, 1/sqrt(bc2), eps, -lr/bc1. The elements of all tensors, end to
   end, are split into one contiguous range per thread (multiples of 16 floats: whole cache lines). */
void adamw_step(int64_t n, float **params, const float **grads, float **exp_avgs, float **exp_avg_sqs,
                const int64_t *numels, const float *s, int threads) {
    const float decay = s[0], w = s[1], beta2 = s[2], one_minus_beta2 = s[3], inv_bc2_sqrt = s[4], eps = s[5],
                neg_step_size = s[6];
    int64_t total = 0;
    for (int64_t k = 0; k < n; k++) total += numels[k];
    #pragma omp parallel num_threads(threads)
    {
        int64_t count = omp_get_num_threads(), id = omp_get_thread_num();
        int64_t per = ((total + count - 1) / count + 15) / 16 * 16;
        int64_t lo = per * id < total ? per * id : total, hi = lo + per < total ? lo + per : total, base = 0;
        for (int64_t k = 0; k < n && base < hi; base += numels[k], k++) {
            int64_t a = lo > base ? lo - base : 0, b = hi - base < numels[k] ? hi - base : numels[k];
            float *restrict p = params[k], *restrict m = exp_avgs[k], *restrict v = exp_avg_sqs[k];
            const float *restrict g = grads[k];
            #pragma omp simd
            for (int64_t i = a; i < b; i++) {
                float gi = g[i];
                float mi = m[i] + w * (gi - m[i]);
                float vi = v[i] * beta2 + one_minus_beta2 * gi * gi;
                m[i] = mi;
                v[i] = vi;
                p[i] = p[i] * decay + neg_step_size * (mi / (sqrtf(vi) * inv_bc2_sqrt + eps));
            }
        }
    }
}
"""
_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")
_library: Any = None  # the loaded kernel, False once building it failed


def _kernel() -> Optional[Callable[..., None]]:
    """``adamw_step`` from the C source, built on first use in this process; None where it cannot be built."""
    global _library
    if _library is None:
        compiler = os.environ.get("CC", "cc")
        try:
            with tempfile.TemporaryDirectory(prefix="lightning_megatron_cpu_adam_") as build:
                source, shared = os.path.join(build, "cpu_adam.c"), os.path.join(build, "cpu_adam.so")
                with open(source, "w") as file:
                    file.write(_SOURCE)
                subprocess.run([compiler, *_FLAGS, source, "-o", shared], check=True, capture_output=True, text=True)
                library = ctypes.CDLL(shared)  # mapped: the file may go with the directory
            library.adamw_step.restype = None
            library.adamw_step.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 6 + [ctypes.c_int]
            _library = library
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", None) or error
            warnings.warn(f"CPUAdamW: could not build its CPU kernel with {compiler!r} ({detail}); torch's AdamW "
                          f"kernels step instead.", stacklevel=3)
            _library = False
    return _library.adamw_step if _library else None


def _pointers(tensors: list[Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])


class CPUAdamW(torch.optim.AdamW):
    """:class:`torch.optim.AdamW` whose float32 CPU tensors are stepped by one parallel pass over all of them.

    Same arguments and state as AdamW (so ``optim.main_params`` wraps it and either loads the other's state dict);
    results equal torch's AdamW to float32 rounding. Tensors the kernel does not cover (not float32, not on the
    CPU, not contiguous, sparse or complex; groups with amsgrad, maximize, capturable or differentiable; steps
    under a ``GradScaler``'s ``grad_scale``) take torch's AdamW path chosen by ``fused``/``foreach`` as usual,
    exactly as ``torch.optim.AdamW`` steps them.

    Which tensors the kernel steps follows from where they are, so one optimizer serves every offload tier: the
    parameters of a model trained on the CPU, or the fp32 main pieces that ``offload_optimizer="cpu"``/``"nvme"``
    keeps in host memory (``optim.main_params`` rebinds the optimizer to them); a model on an accelerator that is
    not offloaded steps entirely on torch's path (no kernel is built, no step counter read). This is why the
    models' recipe (``adam_implementation="auto"``) builds it without asking the strategy where the step will run.

    Example::

        optimizer = CPUAdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    """

    def _takes_kernel(self, group: dict, param: Tensor, grad: Tensor) -> bool:
        # A fake tensor (``lightning-megatron simulate``) has no memory for the kernel: torch's path steps it.
        return (param.device.type == "cpu" and not is_fake(param) and param.dtype == torch.float32 and grad.dtype == torch.float32
                and grad.layout == torch.strided and param.is_contiguous() and grad.is_contiguous()
                and not (group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"]))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """AdamW's step: the kernel for the tensors it covers, torch's AdamW path for the rest."""
        self._accelerator_graph_capture_health_check()  # as AdamW's own step: accelerator tensors step as there
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scaled = getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None
        for group in self.param_groups:
            lists: tuple[list[Tensor], ...] = ([], [], [], [], [], [])  # params, grads, m, v, max v, steps
            has_complex = self._init_group(group, *lists)
            # Tensors on an accelerator (a model that is not offloaded) never need the kernel: nothing is built or read.
            covered = [] if scaled else [i for i, (param, grad) in enumerate(zip(*lists[:2]))
                                         if self._takes_kernel(group, param, grad)]
            kernel = _kernel() if covered else None
            by_step: dict[float, list[int]] = {}  # one set of bias corrections per kernel call
            if kernel is not None:
                # The step counters in one read, not one per parameter (tests/test_device_guards.py counts reads).
                for i, step in zip(covered, torch.stack([lists[5][i] for i in covered]).tolist()):
                    by_step.setdefault(step + 1, []).append(i)
            for step, indices in by_step.items():
                self._run_kernel(kernel, group, step, *([values[i] for i in indices] for values in lists[:4]))
                torch._foreach_add_([lists[5][i] for i in indices], 1)
            stepped = {i for indices in by_step.values() for i in indices}
            rest = tuple([value for i, value in enumerate(values) if i not in stepped] for values in lists) \
                if stepped else lists
            if rest[0]:
                beta1, beta2 = group["betas"]
                adam(*rest, amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2,
                     lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                     foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
                     fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
                     found_inf=getattr(self, "found_inf", None), decoupled_weight_decay=True)
        return loss

    @staticmethod
    def _run_kernel(kernel: Callable[..., None], group: dict, step: float, params: list[Tensor],
                    grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor]) -> None:
        lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
        beta1, beta2 = (float(beta) for beta in group["betas"])
        scalars = (ctypes.c_float * 7)(1 - lr * wd, 1 - beta1, beta2, 1 - beta2, 1 / math.sqrt(1 - beta2**step), eps,
                                       -lr / (1 - beta1**step))
        numels = (ctypes.c_int64 * len(params))(*[p.numel() for p in params])
        kernel(len(params), _pointers(params), _pointers(grads), _pointers(exp_avgs), _pointers(exp_avg_sqs), numels,
               scalars, torch.get_num_threads())
