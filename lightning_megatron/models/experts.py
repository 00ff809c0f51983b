"""A Mixture-of-Experts layer's routed experts over tokens grouped by expert: grouped GEMMs or a loop of GEMMs.

:func:`run_experts` takes the tokens sorted by expert and the count of each expert's tokens, a tensor that
stays on the device. Two ways to run them, chosen by :func:`grouped_gemm_supported` (the one place that
decides), giving the same numbers:

* **grouped**: each expert matrix of all experts in one ``torch._grouped_mm`` (one kernel for ``fc``, one for
  ``proj``, and likewise in backward), the groups delimited by int32 offsets read on the device: no host sync.
  Experts with biases (GPT-OSS's) add each row's expert's bias after each GEMM, the row's expert found from the
  offsets on the device.
  The experts' weights (``nn.Linear`` layout ``[out, in]``) are stacked to ``[E, out, in]`` for each GEMM and
  read transposed; backward saves the weights, not the stack. Where: CUDA in bf16 (``bf16-true`` or
  ``bf16-mixed``'s autocast) on compute capability 9.x/10.x (Hopper, Blackwell: torch's CUTLASS kernel; elsewhere
  torch falls back to a loop that reads the offsets on the host, once per GEMM), every width a multiple of 8
  (torch asks 16-byte aligned strides); and the CPU in fp32 (measured on torch 2.13: bitwise equal to the loop,
  forward and backward; with biases within rounding, the loop's ``F.linear`` fusing the add).
* **loop**: each expert's own module on its slice of the tokens. The slices need the counts on the host: one
  read per layer, free on the CPU. Everywhere else (fp16, fp64, CPU bf16, other GPUs), and for experts that
  are not plain linears (FP8 GEMMs, LoRA adapters): they run through their own forward.

Under tensor parallelism the experts' down projections (row-parallel inside the MoE layer's region) give partial
sums, so they leave their biases out; :func:`deferred_biases` gives each row's bias for the MoE layer to add once,
after the region is left.

Rows after the counted ones (assignments a capacity factor dropped) are zeros in the loop's output and
uninitialised memory in the grouped one; the caller masks them (``MoE._routed_experts``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_megatron.models.mlp import GatedMLP, MLP
from lightning_megatron.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

#: torch's grouped GEMM wants every row stride 16-byte aligned: widths a multiple of 8 in bf16.
_BF16_ALIGNMENT = 8
#: CUDA compute capabilities (major) where torch 2.13's bf16 ``_grouped_mm`` runs its CUTLASS kernel.
_GROUPED_GEMM_CAPABILITIES = (9, 10)


def grouped_gemm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of one ``torch._grouped_mm`` from its operands' shapes, in the form
    ``torch.utils.flop_counter.FlopCounterMode(custom_mapping={torch.ops.aten._grouped_mm: grouped_gemm_flops})``
    takes (torch 2.13 has no formula of its own for it and counts 0). Groups along ``a``'s rows or ``b``'s columns
    (``[T, k] x [E, k, n]``, a 3-D ``a``): ``2 x out x k``. Groups along the contracted dimension (``[k, T] x [T, n]``,
    the weight gradient: one ``[E, k, n]`` output, each group contracting its own rows): ``2 k T n``."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * torch.Size(out_shape).numel() * a_shape[-1]


def run_experts(experts: Sequence[nn.Module], tokens: Tensor, counts: Tensor) -> Tensor:
    """``tokens`` ``[N, h]`` grouped by expert, ``counts`` ``[E]`` (int, any device, summing to at most ``N``) ->
    ``[N, h]``: expert ``e``'s MLP on its ``counts[e]`` rows, in the same order (module docstring)."""
    if grouped_gemm_supported(experts, tokens):
        return grouped_experts(experts, tokens, counts)
    return looped_experts(experts, tokens, counts)


def grouped_gemm_supported(experts: Sequence[nn.Module], tokens: Tensor) -> bool:
    """Whether ``experts`` run as grouped GEMMs on ``tokens``' device and compute dtype (module docstring)."""
    if not hasattr(torch, "_grouped_mm") or not experts or not all(_plain_mlp(e) for e in experts):
        return False
    if len({type(e) for e in experts}) != 1 or len({e.fc.weight.dtype for e in experts} | {tokens.dtype}) != 1:
        return False
    if len({(e.fc.bias is None, e.proj.bias is None) for e in experts}) != 1:
        return False
    dtype = compute_dtype(tokens)
    if tokens.device.type == "cuda":
        widths = (*experts[0].fc.weight.shape, experts[0].proj.weight.shape[1])
        return (dtype == torch.bfloat16 and all(w % _BF16_ALIGNMENT == 0 for w in widths)
                and torch.cuda.get_device_capability(tokens.device)[0] in _GROUPED_GEMM_CAPABILITIES)
    return tokens.device.type == "cpu" and dtype == torch.float32


def compute_dtype(tokens: Tensor) -> torch.dtype:
    """The dtype the experts' GEMMs run in: autocast's where it is on (as ``F.linear`` would), else the tokens'."""
    device = tokens.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tokens.dtype


def grouped_experts(experts: Sequence[nn.Module], tokens: Tensor, counts: Tensor) -> Tensor:
    """:func:`run_experts` with two grouped GEMMs (``experts``: plain ``MLP``/``GatedMLP`` of one type)."""
    dtype = compute_dtype(tokens)
    offsets = torch.cumsum(counts.to(tokens.device, non_blocking=True), 0, dtype=torch.int32)
    hidden = grouped_linear(tokens.to(dtype), [e.fc.weight for e in experts], offsets, dtype)
    rows = None
    if experts[0].fc.bias is not None:
        rows = _expert_rows(tokens, offsets)
        hidden = hidden + _row_biases([e.fc.bias for e in experts], rows, dtype)
    out = grouped_linear(experts[0].activate(hidden), [e.proj.weight for e in experts], offsets, dtype)
    if rows is None or defers_bias(experts[0].proj):
        return out
    return out + _row_biases([e.proj.bias for e in experts], rows, dtype)


def defers_bias(layer: nn.Module) -> bool:
    """Whether ``layer`` leaves its bias out of its output: a row-parallel layer with a bias inside the experts'
    region over several tp ranks, whose outputs are partial sums until the region is left (the MoE layer adds the
    bias after: :func:`deferred_biases`)."""
    return (isinstance(layer, RowParallelLinear) and not layer.communicates and layer.group is not None
            and layer.bias is not None)


def deferred_biases(experts: Sequence[nn.Module], tokens: Tensor, counts: Tensor) -> Optional[Tensor]:
    """``[N, h]``: each row of ``tokens`` (grouped by expert as :func:`run_experts` takes them) with its expert's
    down-projection bias where the experts defer it (:func:`defers_bias`; zeros past the counted rows), in the
    experts' compute dtype; None where the experts add their biases themselves."""
    if not experts or not defers_bias(experts[0].proj):
        return None
    offsets = torch.cumsum(counts.to(tokens.device, non_blocking=True), 0, dtype=torch.int32)
    return _row_biases([e.proj.bias for e in experts], _expert_rows(tokens, offsets), compute_dtype(tokens))


def _expert_rows(tokens: Tensor, offsets: Tensor) -> Tensor:
    """``[N]``: each row's expert (``E`` past the counted rows), from the experts' cumulative row ``offsets``:
    searched on the device."""
    return torch.bucketize(torch.arange(tokens.shape[0], device=tokens.device, dtype=torch.int32), offsets, right=True)


def _row_biases(biases: Sequence[Tensor], rows: Tensor, dtype: torch.dtype) -> Tensor:
    """``[N, out]``: the bias of each row's expert (``rows``; ``E``, past the counted rows, gets zeros)."""
    table = torch.stack([b.to(dtype) for b in biases])
    return torch.cat([table, table.new_zeros(1, table.shape[1])])[rows]


def grouped_linear(x: Tensor, weights: Sequence[Tensor], offsets: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` ``[N, in]`` -> ``[N, out]``: rows ``offsets[e-1]:offsets[e]`` times ``weights[e].T`` (each ``[out, in]``,
    ``nn.Linear``'s layout), in ``dtype``; rows past ``offsets[-1]`` unwritten."""
    return _GroupedLinear.apply(x, offsets, dtype, *weights)


class _GroupedLinear(torch.autograd.Function):
    """The grouped GEMM's forward and backward, saving the experts' weights themselves for backward (as ``F.linear``
    saves its weight), not their stack: a stacked copy kept for backward (what ``torch._grouped_mm``'s own backward
    keeps) would hold a second copy of the experts' weights for every layer in flight (Mixtral-8x7B: 2.8 GB a
    layer in bf16). Backward stacks them again, a copy as cheap as reading them once."""

    @staticmethod
    def forward(ctx, x: Tensor, offsets: Tensor, dtype: torch.dtype, *weights: Tensor) -> Tensor:
        ctx.save_for_backward(x, offsets, *weights)
        ctx.dtype = dtype
        return torch._grouped_mm(x, _stacked(weights, dtype).transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, offsets, *weights = ctx.saved_tensors
        grad = grad.contiguous()  # _grouped_mm refuses strides it cannot feed its kernel ([0, 0]: out.sum()'s)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad, _stacked(weights, ctx.dtype), offs=offsets)
        grad_weights = [None] * len(weights)
        if any(ctx.needs_input_grad[3:]):  # [E, out, in]: each group's grad^T x, over its rows only
            stacked = torch._grouped_mm(grad.t(), x, offs=offsets)
            grad_weights = [g.to(w.dtype) if needed else None
                            for g, w, needed in zip(stacked.unbind(), weights, ctx.needs_input_grad[3:])]
        return grad_x, None, None, *grad_weights


def _stacked(weights: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    return torch.stack([w.to(dtype) for w in weights])


def looped_experts(experts: Sequence[nn.Module], tokens: Tensor, counts: Tensor) -> Tensor:
    """:func:`run_experts` as one call of each expert on its slice (the counts read on the host once)."""
    sizes = counts.tolist()
    rest = tokens.shape[0] - sum(sizes)
    parts = tokens.split([*sizes, rest])
    outputs = [expert(part) for expert, part in zip(experts, parts)]
    if rest:
        outputs.append(outputs[-1].new_zeros(rest, outputs[-1].shape[1]))
    return torch.cat(outputs)


def _plain_mlp(expert: nn.Module) -> bool:
    return type(expert) in (MLP, GatedMLP) and _plain_linear(expert.fc) and _plain_linear(expert.proj)


def _plain_linear(layer: nn.Module) -> bool:
    """A linear whose forward is ``F.linear(x, layer.weight, layer.bias)``: ``nn.Linear``, or a tensor-parallel
    layer inside the experts' region (no communication of its own) in high precision; not FP8, not LoRA-adapted."""
    if hasattr(layer, "lora_a"):
        return False
    if type(layer) is nn.Linear:
        return True
    return type(layer) in (ColumnParallelLinear, RowParallelLinear) and not layer.communicates and not layer.gemms.fp8
