"""fp32 main parameters owned by this rank, and the user's optimizer rebound to them.

This is Megatron-LM's distributed optimizer (and ZeRO stages 1-2): the model keeps its
parameters in their training dtype (16-bit under ``bf16-true``/``16-true``), while the
optimizer steps on fp32 *main* copies of the flat ranges this data-parallel rank owns
(``GradientSynchronizer.owned_pieces``; everything at stage 0). After the step the owned
ranges are copied back into the model's parameters and, under ZeRO, all-gathered over dp (``ParamGather``:
at once, or overlapped with the next forward).

The optimizer that ``configure_optimizers`` returned is kept as the same object, with
its param groups' tensors replaced by the fp32 pieces, so hyper-parameters, LR schedulers
and Lightning's bookkeeping keep working. Only element-wise optimizers can be wrapped
this way: a piece may cut a tensor anywhere.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_megatron.optim.grad_sync import GradientSynchronizer, OwnedPiece
from lightning_megatron.optim.param_gather import ParamGather

ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
)
_TAGS = ("tensor_shard", "tied_names", "expert_parallel")


def check_wrappable(optimizer: Optimizer, zero_stage: int) -> None:
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        names = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(
            f"zero_stage={zero_stage} / fp32 main parameters shard each tensor element-wise over data-parallel ranks, "
            f"which is only correct for element-wise optimizers ({names}); got {type(optimizer).__name__}. "
            f"Use one of those, or zero_stage=0 with 32-bit parameters."
        )


class MainParamOptimizer:
    """Binds ``optimizer`` to fp32 copies of this rank's owned pieces of the model parameters.

    fp32 parameters on the device need no copy: their pieces are views of the parameters'
    flat buffer (Megatron-Core's distributed optimizer does the same), so ZeRO at ``32-true``
    costs no extra 4Ψ/N bytes.
    """

    def __init__(self, optimizer: Optimizer, sync: GradientSynchronizer, *, offload: bool = False,
                 overlap_with: Optional[nn.Module] = None) -> None:
        """``offload=True`` keeps the fp32 pieces and the optimizer state in CPU memory and steps there
        (ZeRO-Offload's optimizer half): only 16-bit parameters and gradients stay on the accelerator.
        ``overlap_with`` (ZeRO only): the model whose next forward waits, module by module, for the parameter
        all-gathers :meth:`finish_step` starts (``overlap_param_gather``); ``None``: they complete in it."""
        check_wrappable(optimizer, sync.zero_stage)
        self.optimizer, self.sync = optimizer, sync
        self.offload = offload
        group_of = {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self.gather: Optional[ParamGather] = None
        if sync.zero_stage:
            self.gather = ParamGather(sync.buckets, self._flatten_params(), overlap_with=overlap_with)
        self.pieces: list[tuple[OwnedPiece, nn.Parameter]] = []
        new_params: list[list[nn.Parameter]] = [[] for _ in optimizer.param_groups]
        for piece in sync.owned_pieces():
            if id(piece.param) not in group_of:
                continue  # trainable but not optimised by this optimizer
            flat = piece.param.detach().reshape(-1)[piece.start : piece.stop]
            shares = flat.dtype == torch.float32 and not offload
            main = nn.Parameter(flat if shares else flat.to(device="cpu" if offload else flat.device,
                                                            dtype=torch.float32, copy=True))
            for tag in _TAGS:  # the global-norm clip needs to know how to count it
                if hasattr(piece.param, tag):
                    setattr(main, tag, getattr(piece.param, tag))
            main.shard_flat_start = piece.start  # where in its shard: replicated ranges are counted once
            new_params[group_of[id(piece.param)]].append(main)
            self.pieces.append((piece, main))
        for group, params in zip(optimizer.param_groups, new_params):
            group["params"] = params
        optimizer.state.clear()

    def _flatten_params(self) -> list[Tensor]:
        """Under ZeRO the model's params live in flat per-bucket buffers, so one all-gather refreshes a bucket."""
        buffers = []
        for bucket in self.sync.buckets:
            buffer = torch.zeros(bucket.numel, dtype=bucket.dtype, device=bucket.device)
            for param, offset in zip(bucket.params, bucket.offsets):
                view = buffer.narrow(0, offset, param.numel()).view_as(param)
                view.copy_(param.detach())
                param.data = view
            buffers.append(buffer)
        return buffers

    def wait_for_params(self) -> None:
        """Complete the parameter all-gathers still in flight (``overlap_param_gather``): before anything other
        than the next forward reads (or writes) the model's parameters."""
        if self.gather is not None:
            self.gather.wait()

    def copy_from_model(self) -> None:
        """Refresh the fp32 pieces from the model's parameters, after weights were loaded into the model."""
        self.wait_for_params()
        with torch.no_grad():
            for piece, main in self.pieces:
                owned = piece.param.detach().reshape(-1)[piece.start : piece.stop]
                if owned.data_ptr() != main.data_ptr():
                    main.copy_(owned)

    def prepare_step(self) -> None:
        """Hand the reduced, token-normalised owned gradients to the fp32 pieces."""
        self.wait_for_params()  # no gather in flight while the optimizer writes the owned slices
        for piece, main in self.pieces:
            grad = self.sync.owned_grad(piece)
            main.grad = grad if grad.dtype == torch.float32 and grad.device == main.device else grad.to(main.device, torch.float32)

    def main_grads(self) -> list[Optional[Tensor]]:
        return [main.grad for _, main in self.pieces]

    def drop_grads(self) -> None:
        """Skip this step: torch optimizers leave parameters without a gradient untouched."""
        for _, main in self.pieces:
            main.grad = None

    def finish_step(self) -> None:
        """Write the updated pieces into the model's parameters, then share them over dp (each bucket over its
        own group; experts: expert-data-parallel), or start doing so (``overlap_with``)."""
        with torch.no_grad():
            self.wait_for_params()
            for piece, main in self.pieces:
                owned = piece.param.view(-1)[piece.start : piece.stop]
                if owned.data_ptr() != main.data_ptr():
                    owned.copy_(main)
                main.grad = None
            if self.gather is not None:
                self.gather.launch()

    def remove(self) -> None:
        """Remove the forward pre-hooks of the overlapped gathers."""
        if self.gather is not None:
            self.gather.remove()

    def main_param_bytes(self) -> int:
        """Bytes of fp32 copies; pieces that are views of fp32 parameters cost nothing extra."""
        return sum(main.numel() * main.element_size() for piece, main in self.pieces
                   if main.data_ptr() != piece.param.view(-1)[piece.start : piece.stop].data_ptr())


def uses_main_params(params: list[nn.Parameter], zero_stage: int, offload: bool = False) -> bool:
    """fp32 main copies are needed under ZeRO, for 16-bit parameters (Megatron's mixed precision)
    and to step the optimizer in CPU memory."""
    return offload or zero_stage > 0 or any(p.dtype in (torch.float16, torch.bfloat16) for p in params)


def model_state_bytes(
    params: list[nn.Parameter],
    sync: Optional[GradientSynchronizer],
    main: Optional[MainParamOptimizer],
    optimizer: Optimizer,
) -> dict[str, int]:
    """Per-rank bytes of parameters, gradients, fp32 main parameters and optimizer state (tensors, not step counters)."""
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor) and v.dim() > 0]
    return {
        "parameters": sum(p.numel() * p.element_size() for p in dict.fromkeys(params)),
        "gradients": sync.gradient_bytes() if sync is not None else 0,
        "main_parameters": main.main_param_bytes() if main is not None else 0,
        "optimizer_state": sum(v.numel() * v.element_size() for v in state),
    }
