"""How a sequence-parallel column or row linear communicates: in turn (the default) or overlapped with its GEMMs.

Under sequence parallelism a column-parallel linear all-gathers its input along the sequence before its GEMM
(and reduce-scatters the input gradient in backward), and a row-parallel linear reduce-scatters its partial
output after its GEMM (and all-gathers the output gradient in backward). The column layer always saves only
its own sequence chunk of the input and gathers it again in backward, overlapped with the input-gradient GEMM,
with the input gradient's reduce-scatter overlapped with the weight-gradient GEMM (``sequence_column``: one
autograd function for both classes here, Megatron-LM's backward). :class:`SequenceParallelLinear` runs the rest
in turn: the column layer's forward gathers, then runs its GEMM; the row layer runs its GEMM, then
reduce-scatters (the autograd operators of ``mappings``). :class:`OverlappedSequenceParallelLinear`
(``tp_comm_overlap=True``) also overlaps the forward collectives (on gloo the collective progresses on gloo's
own thread, on NCCL on its stream):

==============================  ==========================================  =======================================
layer, pass                     collective                                  overlapped with
==============================  ==========================================  =======================================
column, forward                 all-gather of the input's sequence chunks   this rank's own chunk's GEMM
row, forward (``row_chunks``)   reduce-scatter of each piece of the output  the next piece's GEMM
==============================  ==========================================  =======================================

``row_chunks=k > 1`` (userbuffers-style pipelining; off by default) issues ``k`` reduce-scatters per row layer
forward instead of one, each over a ``1/k`` piece of every rank's sequence chunk, launched as soon as that
piece's GEMM is done; the row layer's backward is unchanged (one all-gather, then the GEMMs that need all of it).

What it buys is measured by ``benchmarks/overlap.py --only tp_comm``: on CPU, where gloo's thread and the GEMMs
share the same cores, it adds a few percent of work and shows no reliable wall-clock gain; it is meant for GPUs,
where the collectives run on the network while the GEMMs run.

Same numbers as the default up to the order of fp32 sums inside GEMMs (the chunked GEMMs run in another order):
~1e-7, far inside the layout invariance's 1e-5. Inside ``mappings.full_sequences`` (generation), with no group,
or on inputs not ``[batch, sequence, features]``, the row layer falls back to the default, which handles them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.tensor_parallel.fp8 import HIGH_PRECISION, HighPrecisionGemms
from lightning_megatron.tensor_parallel.mappings import (
    Group,
    all_gather_into,
    reduce_scatter_into,
    reduce_scatter_to_sequence,
    sequences_are_whole,
)
from lightning_megatron.tensor_parallel.sequence_column import sequence_parallel_column


class SequenceParallelLinear:
    """Communicate, then GEMM (column); GEMM, then communicate (row): the layers' default under sequence parallelism."""

    def column(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], group: Group,
               gemms: HighPrecisionGemms = HIGH_PRECISION) -> Tensor:
        """``x``: this rank's sequence chunk ``[batch, seq / tp, in]``; returns ``[batch, seq, out / tp]``. ``gemms``:
        how the layer's GEMMs run (``tensor_parallel.fp8``)."""
        return sequence_parallel_column(x, weight, bias, group, gemms=gemms)

    def row(self, x: Tensor, weight: Tensor, group: Group, gemms: HighPrecisionGemms = HIGH_PRECISION) -> Tensor:
        """``x``: ``[batch, seq, in / tp]``; returns this rank's sequence chunk of the summed output (no bias)."""
        return reduce_scatter_to_sequence(gemms.linear(x, weight), group)


@dataclass(frozen=True)
class OverlappedSequenceParallelLinear(SequenceParallelLinear):
    """The same function, the collectives overlapped with GEMMs (table above). ``row_chunks``: pieces of the row
    layer's forward GEMM and reduce-scatter (1: one of each, as the default; the count used is the greatest common
    divisor of ``row_chunks`` and the rank's sequence chunk, so any sequence length works)."""

    row_chunks: int = 1

    def __post_init__(self) -> None:
        if self.row_chunks < 1:
            raise ValueError(f"row_chunks must be >= 1, got {self.row_chunks}.")

    def column(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], group: Group,
               gemms: HighPrecisionGemms = HIGH_PRECISION) -> Tensor:
        _refuse_fp8(gemms)
        return sequence_parallel_column(x, weight, bias, group, overlap_forward=True)

    def row(self, x: Tensor, weight: Tensor, group: Group, gemms: HighPrecisionGemms = HIGH_PRECISION) -> Tensor:
        _refuse_fp8(gemms)
        if group is None or sequences_are_whole() or x.dim() != 3 or x.shape[1] % dist.get_world_size(group):
            return super().row(x, weight, group)  # (an indivisible sequence: its error)
        pieces = math.gcd(self.row_chunks, x.shape[1] // dist.get_world_size(group))
        if pieces == 1:
            return super().row(x, weight, group)
        return _ChunkedRow.apply(x, weight, group, pieces)


def _refuse_fp8(gemms: HighPrecisionGemms) -> None:
    if gemms.fp8:  # the strategy refuses the combination before training; this guards direct use of the layers
        raise ValueError(FP8_OVERLAP_REFUSAL)


FP8_OVERLAP_REFUSAL = (
    "tp_comm_overlap=True runs a column layer's forward GEMM one rank's sequence chunk at a time, while the chunks "
    "arrive, but an FP8 layer scales its input by the amax of the whole gathered sequence before any GEMM. Use "
    "tp_comm_overlap=False with fp8 (the sequence-parallel backward overlaps its collectives either way).")


def overlapped_linear_for(config: ParallelConfig, tp_comm_overlap: bool) -> Optional[OverlappedSequenceParallelLinear]:
    """What ``tp_comm_overlap`` asks of the layout's sequence-parallel layers (``None``: the default); refuses a
    layout without sequence-parallel communication to overlap."""
    if not tp_comm_overlap:
        return None
    if not config.sequence_parallel or config.tensor_parallel_size == 1:
        raise ValueError(
            f"tp_comm_overlap=True overlaps the sequence-parallel all-gathers and reduce-scatters of the column and "
            f"row linears with their GEMMs, but this layout has tensor_parallel_size={config.tensor_parallel_size} "
            f"and sequence_parallel={config.sequence_parallel}. Set sequence_parallel=True with "
            f"tensor_parallel_size > 1, or leave tp_comm_overlap off.")
    return OverlappedSequenceParallelLinear()


class _ChunkedRow(torch.autograd.Function):
    """``reduce_scatter_seq(F.linear(x, weight))`` in ``pieces`` GEMMs, each piece's reduce-scatter launched
    as soon as its GEMM is done. Piece ``i`` is the ``i``-th ``1/pieces`` of every rank's sequence chunk."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, group: Group, pieces: int) -> Tensor:
        world = dist.get_world_size(group)
        batch, seq, features = x.shape
        by_piece = x.reshape(batch, world, pieces, seq // world // pieces, features)
        partials, outputs, works = [], [], []
        for i in range(pieces):
            partial = F.linear(by_piece[:, :, i].transpose(0, 1).flatten(0, 1), weight)  # [tp * batch, piece, out]
            outputs.append(partial.new_empty((batch, *partial.shape[1:])))
            works.append(reduce_scatter_into(outputs[-1], partial, group, async_op=True))
            partials.append(partial)  # alive until its reduce-scatter is done
        for work in works:
            work.wait()
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return torch.cat(outputs, dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        world = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        gathered = grad.new_empty((world * grad.shape[0], *grad.shape[1:]))
        all_gather_into(gathered, grad, ctx.group)
        grad_full = gathered.view(world, *grad.shape).transpose(0, 1).reshape(*x.shape[:2], grad.shape[-1])
        grad_x = torch.matmul(grad_full, weight.to(grad.dtype)) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad_full.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).to(grad.dtype)
        return grad_x, grad_weight, None, None
