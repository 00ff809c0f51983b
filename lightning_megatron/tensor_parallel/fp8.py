"""The GEMMs of a tensor-parallel linear layer in FP8, with scales that do not depend on the layout.

A linear layer runs three GEMMs: the forward ``y = x w^T``, the input gradient ``dx = g w`` and the weight
gradient ``dw = g^T x``. In FP8 each operand is scaled into the range of an 8-bit float and cast
(``float8_e4m3fn`` for inputs and weights; tensorwise scaling casts gradients to ``float8_e5m2``, which trades
mantissa for range), the GEMM (``torch._scaled_mm``) multiplies the 8-bit operands and undoes the scales in its
high-precision output. The bias, the master weights, their gradients and the optimizer state stay as they are.

**Scales.** A scale is ``finfo.max / amax``, the largest magnitude of the operand: of the whole tensor
(``"tensorwise"``), or of each row along the GEMM's contraction dimension (``"rowwise"``, scales rounded down to
powers of two, every operand in e4m3; torchao's recipe of that name). A tensor-parallel layer holds a slice of
its weight and, depending on the layer, of its input or output: the amax of the slice is not the amax of the
tensor, so its scale, hence its FP8 numbers, would depend on ``tp``. Each amax is therefore all-reduced (MAX)
over every group that cuts a dimension it spans: ``tp`` where the layer cuts that dimension (a column layer its
output features, a row layer its input features), and the context-parallel group for the token dimension (cp
cuts every sequence). Under sequence parallelism the column layer casts after its all-gather and the row layer's
output gradient arrives all-gathered, so no more is needed. Output rows that several ranks share (replicated
key/value heads) cannot be cast exactly and are refused (``fp8_plan``); the loss normaliser backward multiplies
by is a power of two (``optim.step``), so it moves no cast.

==================  ====================  ===================================  =========================
GEMM                operands              tensorwise amax reduced over          rowwise (per-row amax)
==================  ====================  ===================================  =========================
forward             ``x [T, K]``,         x: cp, + tp if K is cut (row);        rows of x and w along K:
                    ``w [N, K]``          w: tp                                 tp if K is cut (row)
input gradient      ``g [T, N]``, ``w``   g: cp, + tp if N is cut (column)      along N: tp if N is cut
weight gradient     ``g``, ``x``          (the same scales as above)            along T: cp
==================  ====================  ===================================  =========================

What no reduction can make layout-free is the batch: a tensorwise scale of an activation or gradient is a
function of the micro-batch it is computed on, so ``dp`` ranks and micro-batches (each its own piece of the
global batch) scale by their own piece's amax. The layout invariance of an FP8 run is therefore defined against
one process running the same pieces one after another with gradient accumulation; the weights' scales are the
same for every piece. Megatron-Core and torchtitan make the same choice (amaxes over the tensor-parallel group
only; torchtitan's DTensor reduces over its tp mesh).

**torchao.** The casts are torchao's (``amax_to_scale``, ``to_fp8_saturated``). Its ``Float8Linear`` is not used:
it replaces ``nn.Linear`` only, computes every amax on the local slice (its autograd function passes no group),
and in an fp32 model runs rowwise GEMMs with bf16 outputs. The autograd function here (:class:`_Fp8Linear`, and
the sequence-parallel column function calling :class:`Fp8Gemms`) is what those three need.

**Shapes.** On CUDA ``_scaled_mm`` needs every GEMM dimension but the output rows divisible by 16: the local
input and output features of the layer (checked by :func:`check_fp8_shape` when the layer is converted), and
the tokens of the weight gradient, which are zero-padded here to a multiple of 16 (zero rows add nothing; the
CPU runs the same code).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

Group = Optional[dist.ProcessGroup]

RECIPES = ("tensorwise", "rowwise")
ALIGNMENT = 16  # _scaled_mm's CUDA kernels: every contraction and output-column dimension


_float8_utils = None  # torchao.float8.float8_utils, once imported


def require_torchao():
    """torchao's float8 casting helpers (``pip install 'lightning-megatron[fp8]'``), imported once, eagerly: by
    ``fp8_plan.convert_to_fp8`` before anything is compiled (an import inside a ``torch.compile``-traced layer fails
    in torchao's class registrations). Its import logs a warning per CUDA kernel library it cannot load on a CPU-only
    build (none of which this uses) and torch a deprecation about torchao's pytree registration: both are held back,
    so every rank's log stays readable."""
    global _float8_utils
    if _float8_utils is not None:
        return _float8_utils
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        from torchao.float8 import float8_utils
    except ImportError as error:
        raise ImportError("FP8 training casts with torchao's float8 helpers; install them with "
                          "`pip install 'lightning-megatron[fp8]'` (torchao>=0.18), or set fp8=None.") from error
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    _float8_utils = float8_utils
    return float8_utils


@dataclass(frozen=True)
class Fp8Recipe:
    """How the operands of the GEMMs are cast: their FP8 formats, and per tensor or per row."""

    name: str
    input_dtype: torch.dtype
    weight_dtype: torch.dtype
    grad_dtype: torch.dtype
    rowwise: bool
    power_of_2_scales: bool

    @classmethod
    def named(cls, name: str) -> "Fp8Recipe":
        if name == "tensorwise":  # torchao's default and Megatron-Core's "hybrid": e5m2 gradients
            return cls(name, torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e5m2, False, False)
        if name == "rowwise":  # torchao's "rowwise": e4m3 throughout, scales rounded down to powers of two
            return cls(name, torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e4m3fn, True, True)
        raise ValueError(f"fp8={name!r} is not one of {RECIPES} (or None for no FP8).")


@dataclass
class Fp8Operand:
    """An operand cast to FP8: ``data * inverse_scale`` is its high-precision value (``inverse_scale``: a scalar,
    or ``[rows, 1]`` / ``[1, columns]`` for rowwise scaling)."""

    data: Tensor
    inverse_scale: Tensor


def cast_to_fp8(t: Tensor, dtype: torch.dtype, *, dim: Optional[int], groups: Sequence[Group],
                power_of_2: bool = False) -> Fp8Operand:
    """Scale ``t`` (2-D) by ``finfo(dtype).max / amax`` and cast it, saturating. ``dim=None``: one amax for the tensor;
    otherwise one per slice along ``dim`` (``keepdim``). ``groups``: where other ranks hold the rest of what the amax
    spans; the amax is all-reduced (MAX) over each, so that every rank scales by the whole tensor's."""
    ao = _float8_utils or require_torchao()
    amax = (t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)).float()
    for group in groups:
        if group is not None:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = ao.amax_to_scale(amax, dtype, round_scales_to_power_of_2=power_of_2)
    return Fp8Operand(ao.to_fp8_saturated(t.float() * scale, dtype), scale.reciprocal())


def scaled_mm(a: Fp8Operand, b: Fp8Operand, out_dtype: torch.dtype) -> Tensor:
    """``a @ b`` in high precision ``out_dtype`` from two FP8 operands: ``a [M, K]`` (scale scalar or ``[M, 1]``), ``b
    [K, N]`` (scalar or ``[1, N]``). ``a`` is made row-major and ``b`` column-major, as the CUDA kernels need."""
    b_data = b.data if b.data.stride(0) == 1 else b.data.t().contiguous().t()
    scale_a, scale_b = a.inverse_scale, b.inverse_scale
    gemm_dtype = out_dtype
    if scale_a.dim():  # rowwise: [M, 1] and [1, N] with unit strides (a transposed [1, M] has not)
        scale_a, scale_b = scale_a.flatten().unsqueeze(1), scale_b.flatten().unsqueeze(0)
        if a.data.is_cuda:  # CUDA's rowwise kernels write bf16 only (pytorch#156771): fp32/fp16 runs round through it
            gemm_dtype = torch.bfloat16
    # Outside autocast (``out_dtype`` is already its dtype where it is on): the CPU kernel dequantizes the operands to
    # fp32 and multiplies them with a matmul that autocast would run on bf16 copies, rounding operands whose scales
    # are not powers of two (tensorwise) by up to 2^-9 more than the GEMM of a GPU, or of this function outside it.
    with torch.autocast(a.data.device.type, enabled=False):
        y = torch._scaled_mm(a.data.contiguous(), b_data, scale_a, scale_b, out_dtype=gemm_dtype)
    return y if gemm_dtype == out_dtype else y.to(out_dtype)


def _pad_rows(t: Tensor) -> Tensor:
    """Zero rows up to a multiple of 16: the tokens are the weight gradient's contraction dimension."""
    missing = -t.shape[0] % ALIGNMENT
    return t if missing == 0 else F.pad(t, (0, 0, 0, missing))


class HighPrecisionGemms:
    """The three GEMMs of a linear layer as they are: ``F.linear`` forward, matmuls in backward. The layers' default
    (``linear`` is ``F.linear`` itself, so autograd saves what it always does). The sequence-parallel column function
    (``sequence_column``) calls the three itself, to overlap them with its collectives."""

    fp8 = False

    def linear(self, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        return F.linear(x, weight, bias)

    def forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        return F.linear(x, weight, bias)

    def grad_input(self, grad: Tensor, weight: Tensor) -> Tensor:
        return torch.matmul(grad, weight)

    def grad_weight(self, grad: Tensor, x: Tensor) -> Tensor:
        """``grad [..., N]``, ``x [..., K]``: the sum over tokens of their outer products, ``[N, K]``."""
        return grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


HIGH_PRECISION = HighPrecisionGemms()


@dataclass(frozen=True)
class Fp8Gemms(HighPrecisionGemms):
    """The three GEMMs of one tensor-parallel linear layer in FP8 (module docstring).

    ``tensor_group``: the group the layer's weight is split over (``None``: whole); ``cuts``: ``"output"`` (a column
    layer: output features split) or ``"input"`` (a row layer); ``token_group``: the group that splits the tokens
    of a sequence (context parallelism), or ``None``. Inputs may have any leading dimensions (``[..., features]``)."""

    recipe: Fp8Recipe
    tensor_group: Group
    cuts: str
    token_group: Group = None

    fp8 = True

    def __post_init__(self) -> None:
        if self.cuts not in ("output", "input"):
            raise ValueError(f"cuts must be 'output' (column-parallel) or 'input' (row-parallel), got {self.cuts!r}.")

    # Which groups hold the rest of each operand's two dimensions.
    def _x_groups(self) -> tuple[Group, Group]:  # [tokens, in]
        return self.token_group, self.tensor_group if self.cuts == "input" else None

    def _weight_groups(self) -> tuple[Group, Group]:  # [out, in]
        return (self.tensor_group if self.cuts == "output" else None, self.tensor_group if self.cuts == "input" else None)

    def _grad_groups(self) -> tuple[Group, Group]:  # [tokens, out]
        return self.token_group, self.tensor_group if self.cuts == "output" else None

    def _cast(self, t: Tensor, dtype: torch.dtype, groups: tuple[Group, Group], along: int) -> Fp8Operand:
        """Cast the 2-D ``t``, per row along dimension ``along`` (rowwise) or as a whole (tensorwise); the amax is
        reduced over the groups of the dimensions it spans."""
        recipe = self.recipe
        if recipe.rowwise:
            return cast_to_fp8(t, dtype, dim=along, groups=[groups[along]], power_of_2=recipe.power_of_2_scales)
        return cast_to_fp8(t, dtype, dim=None, groups=list(dict.fromkeys(groups)), power_of_2=recipe.power_of_2_scales)

    def linear(self, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        return fp8_linear(x, weight, bias, self)

    def forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        xq = self._cast(x2, self.recipe.input_dtype, self._x_groups(), along=1)
        wq = self._cast(weight, self.recipe.weight_dtype, self._weight_groups(), along=1)
        out_dtype = _output_dtype(x)
        y = scaled_mm(xq, Fp8Operand(wq.data.t(), wq.inverse_scale.t()), out_dtype)
        if bias is not None:
            y = y + bias.to(out_dtype)
        return y.view(*x.shape[:-1], weight.shape[0])

    def grad_input(self, grad: Tensor, weight: Tensor) -> Tensor:
        g2 = grad.reshape(-1, grad.shape[-1])
        gq = self._cast(g2, self.recipe.grad_dtype, self._grad_groups(), along=1)
        wq = self._cast(weight, self.recipe.weight_dtype, self._weight_groups(), along=0)
        return scaled_mm(gq, wq, grad.dtype).view(*grad.shape[:-1], weight.shape[1])

    def grad_weight(self, grad: Tensor, x: Tensor) -> Tensor:
        g2, x2 = _pad_rows(grad.reshape(-1, grad.shape[-1])), _pad_rows(x.reshape(-1, x.shape[-1]))
        gq = self._cast(g2, self.recipe.grad_dtype, self._grad_groups(), along=0)
        xq = self._cast(x2, self.recipe.input_dtype, self._x_groups(), along=0)
        return scaled_mm(Fp8Operand(gq.data.t(), gq.inverse_scale.t()), xq, grad.dtype)


def _output_dtype(x: Tensor) -> torch.dtype:
    """The GEMM's output dtype: autocast's where it is on (the weights stay fp32 and are cast to FP8 directly, with no
    round through bf16), else the input's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def fp8_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], gemms: Fp8Gemms) -> Tensor:
    """``F.linear(x, weight, bias)`` with :class:`Fp8Gemms`' three GEMMs. Saves the high-precision input and weight
    (as ``F.linear`` does, and torchao): backward casts them along other dimensions for rowwise scaling."""
    return _Fp8Linear.apply(x, weight, bias, gemms)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], gemms: Fp8Gemms) -> Tensor:
        need_input, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.save_for_backward(x if need_weight else None, weight if need_input else None)
        ctx.gemms, ctx.dtypes = gemms, (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return gemms.forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        gemms, (x_dtype, weight_dtype, bias_dtype) = ctx.gemms, ctx.dtypes
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_x = gemms.grad_input(grad, weight).to(x_dtype) if need_input else None
        grad_weight = gemms.grad_weight(grad, x).to(weight_dtype) if need_weight else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0).to(bias_dtype) if need_bias else None
        return grad_x, grad_weight, grad_bias, None


def check_fp8_shape(name: str, local_in: int, local_out: int, tensor_parallel_size: int) -> None:
    """Refuse a layer whose local GEMM dimensions ``_scaled_mm`` cannot take on CUDA (the CPU kernel takes any, so the
    check is ours, and made everywhere, so that a run that works on CPU works on a GPU)."""
    bad = {what: size for what, size in (("input features", local_in), ("output features", local_out))
           if size % ALIGNMENT}
    if bad:
        sizes = ", ".join(f"{what} {size}" for what, size in bad.items())
        raise ValueError(
            f"FP8 cannot run {name}: its local {sizes} (at tensor_parallel_size={tensor_parallel_size}) are not "
            f"multiples of {ALIGNMENT}, which torch._scaled_mm's kernels need. Keep the layer in high precision "
            f"(add its name to fp8_exclude), or pick sizes whose per-rank slices are multiples of {ALIGNMENT}.")
