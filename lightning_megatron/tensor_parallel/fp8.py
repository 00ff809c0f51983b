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

**What a step costs beyond the GEMMs.** A weight is cast once per optimizer step per GEMM layout, not per
micro-batch (``fp8_weights``: kept until the optimizer steps or the weight is written; not under ZeRO-3), and its
amax reduced then only. A cast reads its operand in its own dtype: the amax is its infinity norm (no ``abs`` or fp32
copy), the scaled product is fp32 read from the 16-bit tensor, clamped in place and cast (:func:`scale_and_cast`).
The amaxes of one pass (the forward's input and, on a miss, weight; backward's gradient, weight and input) are
all-reduced together, one all-reduce per group (:func:`reduce_amaxes`); tensorwise, backward casts the output
gradient once for both of its GEMMs and the input with the forward's scale (the same tensor, the same amax, so no
collective). Per layer and micro-batch that leaves the activations' amaxes: one all-reduce over tp (the row
layer's forward input, or the column layer's backward gradient), and per pass one over cp where it cuts the tokens.
(The sequence-parallel column layer runs its two backward GEMMs apart, each overlapped with a collective, so there
each casts its own operands, as before.) The forward GEMM accumulates fast (:data:`FORWARD_FAST_ACCUMULATION`).

**torchao.** The scales are torchao's (``amax_to_scale``); the saturating cast is its ``to_fp8_saturated`` without
the fp32 copy. Its ``Float8Linear`` is not used: it replaces ``nn.Linear`` only, computes every amax on the local
slice (its autograd function passes no group), and in an fp32 model runs rowwise GEMMs with bf16 outputs. The
autograd function here (:class:`_Fp8Linear`, and the sequence-parallel column function calling :class:`Fp8Gemms`)
is what those three need.

**Shapes.** On CUDA ``_scaled_mm`` needs every GEMM dimension but the output rows divisible by 16: the local
input and output features of the layer (checked by :func:`check_fp8_shape` when the layer is converted), and
the tokens of the weight gradient, which are zero-padded here to a multiple of 16 (zero rows add nothing; the
CPU runs the same code).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_megatron.tensor_parallel.fp8_weights import Fp8WeightCache
from lightning_megatron.tensor_parallel.torchao_import import import_torchao

Group = Optional[dist.ProcessGroup]

RECIPES = ("tensorwise", "rowwise")
ALIGNMENT = 16  # _scaled_mm's CUDA kernels: every contraction and output-column dimension


_float8_utils = None  # torchao.float8.float8_utils, once imported


def require_torchao():
    """torchao's float8 casting helpers (``pip install 'lightning-megatron[fp8]'``), imported once, eagerly: by
    ``fp8_plan.convert_to_fp8`` before anything is compiled (an import inside a ``torch.compile``-traced layer fails
    in torchao's class registrations)."""
    global _float8_utils
    if _float8_utils is None:
        _float8_utils = import_torchao("torchao.float8.float8_utils", needed_for="FP8 training casts with torchao's "
                                       "float8 helpers", extra="fp8", without="fp8=None")
    return _float8_utils


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
    or ``[rows, 1]`` / ``[1, columns]`` for rowwise scaling); ``scale``: what it was multiplied by to cast it."""

    data: Tensor
    inverse_scale: Tensor
    scale: Tensor

    def t(self) -> "Fp8Operand":
        return Fp8Operand(self.data.t(), self.inverse_scale.t(), self.scale.t())


@dataclass(frozen=True, eq=False)
class CastRequest:
    """One operand of a pass to cast: ``t`` (2-D) into ``dtype``, scaled as a whole (``dim=None``) or per slice along
    ``dim``; ``groups``: where other ranks hold the rest of what the amax spans; ``scale``: already known (the
    forward's, for the same tensor again in backward), so no amax is taken."""

    t: Tensor
    dtype: torch.dtype
    dim: Optional[int]
    groups: tuple[Group, ...] = ()
    scale: Optional[Tensor] = None


def amax_of(t: Tensor, dim: Optional[int]) -> Tensor:
    """The largest magnitude of ``t`` (``dim=None``) or of each slice along ``dim`` (kept), as fp32: the infinity norm,
    one pass over ``t`` in its own dtype with no ``abs`` copy (a maximum of magnitudes is exact in any dtype)."""
    inf = float("inf")
    norm = torch.linalg.vector_norm(t, inf) if dim is None else torch.linalg.vector_norm(t, inf, dim=dim, keepdim=True)
    return norm.float()


def reduce_amaxes(amaxes: list[Tensor], groups: Sequence[tuple[Group, ...]]) -> list[Tensor]:
    """``amaxes[i]`` all-reduced (MAX) over each group of ``groups[i]``, all of them in one all-reduce per distinct
    group, of the concatenated amaxes that group spans. The maximum is exact and associative, so reducing over the
    context-parallel group and then the tensor-parallel one is reducing over both. Every rank of a group passes its
    amaxes in the same order (the same code runs on each), so the concatenations line up."""
    amaxes = list(amaxes)
    members: dict[dist.ProcessGroup, list[int]] = {}
    for index, spanned in enumerate(groups):
        for group in spanned:
            if group is not None:
                members.setdefault(group, []).append(index)
    for group, indices in members.items():
        flat = torch.cat([amaxes[i].reshape(-1) for i in indices])
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        for i, piece in zip(indices, flat.split([amaxes[i].numel() for i in indices])):
            amaxes[i] = piece.view_as(amaxes[i])
    return amaxes


def scale_and_cast(t: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``t * scale`` saturated into ``dtype``'s range and cast. The product is computed in fp32 from ``t``'s own dtype,
    with no fp32 copy of ``t`` (a 0-dim scale is viewed as ``[1, 1]``: a scalar tensor would leave a 16-bit ``t``'s
    product in 16 bits), clamped in place, then cast: three passes in eager, one kernel under ``torch.compile``."""
    fp8_max = torch.finfo(dtype).max
    product = torch.mul(t, scale.reshape(1, 1) if scale.dim() == 0 else scale)
    return product.clamp_(-fp8_max, fp8_max).to(dtype)


def cast_together(requests: Sequence[CastRequest], power_of_2: bool = False) -> list[Fp8Operand]:
    """Scale each request by ``finfo(dtype).max / amax`` and cast it, saturating, its amax reduced over its groups so
    that every rank scales by the whole tensor's; the amaxes of all the requests in as few all-reduces as there are
    groups (:func:`reduce_amaxes`)."""
    ao = _float8_utils or require_torchao()
    pending = [index for index, request in enumerate(requests) if request.scale is None]
    amaxes = reduce_amaxes([amax_of(requests[i].t, requests[i].dim) for i in pending],
                           [requests[i].groups for i in pending])
    scales = [request.scale for request in requests]
    for index, amax in zip(pending, amaxes):
        scales[index] = ao.amax_to_scale(amax, requests[index].dtype, round_scales_to_power_of_2=power_of_2)
    return [Fp8Operand(scale_and_cast(request.t, scale, request.dtype), scale.reciprocal(), scale)
            for request, scale in zip(requests, scales)]


def scaled_mm(a: Fp8Operand, b: Fp8Operand, out_dtype: torch.dtype, fast_accumulation: bool = False) -> Tensor:
    """``a @ b`` in high precision ``out_dtype`` from two FP8 operands: ``a [M, K]`` (scale scalar or ``[M, 1]``), ``b
    [K, N]`` (scalar or ``[1, N]``). ``a`` is made row-major and ``b`` column-major, as the CUDA kernels need.
    ``fast_accumulation``: ``_scaled_mm``'s ``use_fast_accum`` (:data:`FORWARD_FAST_ACCUMULATION`)."""
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
        y = torch._scaled_mm(a.data.contiguous(), _column_major(b.data), scale_a, scale_b, out_dtype=gemm_dtype,
                             use_fast_accum=fast_accumulation)
    return y if gemm_dtype == out_dtype else y.to(out_dtype)


# Fast accumulation in the forward GEMM only (torchao's and Transformer Engine's recipes do the same). On Hopper, an FP8
# GEMM without it promotes its partial sums from the tensor cores' reduced-precision accumulator into fp32 every few
# steps along the contraction; with it the sums stay in that accumulator, which is faster. The forward's output is an
# activation over a contraction of the layer's input features; the gradients contract over the output features and,
# for the weight gradient, over every token of the micro-batch, the long sums where the lost bits accumulate, so
# backward keeps the promotion. The CPU kernel takes the flag and ignores it (it dequantizes and runs an fp32 GEMM):
# the CPU's numbers do not depend on it, so it needs no per-device choice.
FORWARD_FAST_ACCUMULATION = True


def _column_major(t: Tensor) -> Tensor:
    return t if t.stride(0) == 1 else t.t().contiguous().t()


def _pad_rows(t: Tensor) -> Tensor:
    """Zero rows up to a multiple of 16: the tokens are the weight gradient's contraction dimension."""
    missing = -t.shape[0] % ALIGNMENT
    return t if missing == 0 else F.pad(t, (0, 0, 0, missing))


def _pad_fp8_rows(operand: Fp8Operand) -> Fp8Operand:
    """:func:`_pad_rows` of an operand already cast with one scale for the tensor (its zero rows cast to the byte 0,
    +0 in both formats; padded through ``uint8``, which every device's ``cat`` takes)."""
    missing = -operand.data.shape[0] % ALIGNMENT
    if missing == 0:
        return operand
    raw = operand.data.view(torch.uint8)
    padded = torch.cat([raw, raw.new_zeros(missing, raw.shape[1])]).view(operand.data.dtype)
    return Fp8Operand(padded, operand.inverse_scale, operand.scale)


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
    of a sequence (context parallelism), or ``None``. Inputs may have any leading dimensions (``[..., features]``).
    ``cache_weights``: keep the weight's FP8 casts from one optimizer step to the next (``fp8_weights``; one per
    layer: ``weight_casts``), so that micro-batches, pipeline schedules and recomputation cast it once per step."""

    recipe: Fp8Recipe
    tensor_group: Group
    cuts: str
    token_group: Group = None
    cache_weights: bool = True
    weight_casts: Fp8WeightCache = field(default_factory=Fp8WeightCache, compare=False, repr=False)

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

    def _request(self, t: Tensor, dtype: torch.dtype, groups: tuple[Group, Group], along: int,
                 scale: Optional[Tensor] = None) -> CastRequest:
        """Cast the 2-D ``t`` per row along dimension ``along`` (rowwise) or as a whole (tensorwise); the amax is
        reduced over the groups of the dimensions it spans."""
        if self.recipe.rowwise:
            return CastRequest(t, dtype, along, (groups[along],), scale)
        return CastRequest(t, dtype, None, tuple(dict.fromkeys(groups)), scale)

    def _cast_pass(self, requests: dict[str, CastRequest], weight: Optional[Tensor],
                   gemm: str) -> tuple[dict[str, Fp8Operand], Optional[Fp8Operand]]:
        """The casts of one pass, their amaxes reduced together, and ``weight`` as ``gemm`` takes it (``"forward"``:
        ``w^T [K, N]``, ``"grad_input"``: ``w [N, K]``): from the cache, or cast with the others and kept."""
        wq = self._cached_weight(weight, gemm) if weight is not None else None
        if weight is not None and wq is None:
            along = 1 if gemm == "forward" else 0  # rowwise: along the GEMM's contraction
            requests = {**requests, "weight": self._request(weight, self.recipe.weight_dtype, self._weight_groups(),
                                                            along)}
        operands = dict(zip(requests, cast_together(list(requests.values()), self.recipe.power_of_2_scales)))
        if "weight" in operands:
            wq = self._keep_weight(weight, gemm, operands.pop("weight"))
        return operands, wq

    def _cached_weight(self, weight: Tensor, gemm: str) -> Optional[Fp8Operand]:
        if not self.cache_weights:
            return None
        found = self.weight_casts.lookup(weight, gemm)
        if found is None and not self.recipe.rowwise:  # one tensorwise cast serves both GEMMs, transposed
            other_gemm = "grad_input" if gemm == "forward" else "forward"
            other = self.weight_casts.lookup(weight, other_gemm)
            if other is not None:  # back to [N, K] as cast (a view), then laid out for this GEMM
                found = self.weight_casts.store(weight, gemm, _layout_for(gemm, other.t() if other_gemm == "forward"
                                                                     else other))
        return found

    def _keep_weight(self, weight: Tensor, gemm: str, wq: Fp8Operand) -> Fp8Operand:
        """``wq`` (``[N, K]`` as cast) laid out for ``gemm``, kept in the cache if it is on."""
        operand = _layout_for(gemm, wq)
        return self.weight_casts.store(weight, gemm, operand) if self.cache_weights else operand

    def linear(self, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        return fp8_linear(x, weight, bias, self)

    def forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        return self.forward_and_input(x, weight, bias)[0]

    def forward_and_input(self, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> tuple[Tensor, Fp8Operand]:
        """The forward, and the input's cast (whose tensorwise scale backward reuses for the same input)."""
        x2 = x.reshape(-1, x.shape[-1])
        requests = {"x": self._request(x2, self.recipe.input_dtype, self._x_groups(), along=1)}
        operands, wq = self._cast_pass(requests, weight, "forward")
        out_dtype = _output_dtype(x)
        y = scaled_mm(operands["x"], wq, out_dtype, fast_accumulation=FORWARD_FAST_ACCUMULATION)
        if bias is not None:
            y = y + bias.to(out_dtype)
        return y.view(*x.shape[:-1], weight.shape[0]), operands["x"]

    def grad_input(self, grad: Tensor, weight: Tensor) -> Tensor:
        return self.gradients(grad, None, weight)[0]

    def grad_weight(self, grad: Tensor, x: Tensor) -> Tensor:
        return self.gradients(grad, x, None)[1]

    def gradients(self, grad: Tensor, x: Optional[Tensor], weight: Optional[Tensor],
                  x_scale: Optional[Tensor] = None) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """The input gradient (if ``weight`` is given) and the weight gradient (if ``x`` is), their casts in one pass:
        tensorwise, the output gradient is cast once for both GEMMs and ``x`` with ``x_scale``, the forward's scale
        of it, if given (no amax, no collective); rowwise casts each along its GEMM's contraction."""
        rowwise, recipe = self.recipe.rowwise, self.recipe
        g2 = grad.reshape(-1, grad.shape[-1])
        requests = {}
        if weight is not None or not rowwise:
            requests["grad"] = self._request(g2, recipe.grad_dtype, self._grad_groups(), along=1)
        if x is not None:
            if rowwise:
                requests["grad_t"] = self._request(_pad_rows(g2), recipe.grad_dtype, self._grad_groups(), along=0)
            x2 = _pad_rows(x.reshape(-1, x.shape[-1]))
            requests["x_t"] = self._request(x2, recipe.input_dtype, self._x_groups(), along=0,
                                            scale=None if rowwise else x_scale)
        operands, wq = self._cast_pass(requests, weight, "grad_input")
        grad_x = grad_weight = None
        if weight is not None:
            grad_x = scaled_mm(operands["grad"], wq, grad.dtype).view(*grad.shape[:-1], weight.shape[1])
        if x is not None:
            gt = operands["grad_t"] if rowwise else _pad_fp8_rows(operands["grad"])
            grad_weight = scaled_mm(gt.t(), operands["x_t"], grad.dtype)
        return grad_x, grad_weight


def _layout_for(gemm: str, wq: Fp8Operand) -> Fp8Operand:
    """The weight ``wq`` (``[N, K]``) as ``gemm``'s second operand, column-major: the forward's is ``w^T`` (a view),
    the input gradient's ``w`` itself (a transposed copy, made once per step when cached)."""
    if gemm == "forward":
        return wq.t()
    return Fp8Operand(_column_major(wq.data), wq.inverse_scale, wq.scale)


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
        y, xq = gemms.forward_and_input(x, weight, bias)
        ctx.x_scale = xq.scale if need_weight and not gemms.recipe.rowwise else None  # (rowwise recasts along T)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        gemms, (x_dtype, weight_dtype, bias_dtype) = ctx.gemms, ctx.dtypes
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_x = grad_weight = None
        if need_input or need_weight:
            grad_x, grad_weight = gemms.gradients(grad, x if need_weight else None, weight if need_input else None,
                                                  x_scale=ctx.x_scale)
        grad_x = grad_x.to(x_dtype) if need_input else None
        grad_weight = grad_weight.to(weight_dtype) if need_weight else None
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
