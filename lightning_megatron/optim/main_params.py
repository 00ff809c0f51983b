"""fp32 main parameters owned by this rank, and the user's optimizer rebound to them.

This is Megatron-LM's distributed optimizer (and ZeRO stages 1-2): the model keeps its
parameters in their training dtype (16-bit under ``bf16-true``/``16-true``), while the
optimizer steps on fp32 *main* copies of the flat ranges this data-parallel rank owns
(``GradientSynchronizer.owned_pieces``; everything at stage 0). After the step the owned
ranges are copied back into the model's parameters and, under ZeRO, all-gathered over dp (``ParamGather``:
at once, or overlapped with the next forward).

Offloaded (``"cpu"``/``"nvme"``), the fp32 gradients the host optimizer reads live in persistent host tensors
(``offload.host_staging``): under ``"cpu"``, a bucket that needs nothing after its reduction but the normalisation
starts copying its pieces when its reduction is launched in backward (``GradientSynchronizer.on_bucket_reduced``),
and the host normalises the copies; the other buckets start theirs as soon as their gradients are final
(``GradientSynchronizer.on_bucket_final``); asynchronously on CUDA, and the step waits once for all of them.

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

from lightning_megatron.offload.host_staging import CopiesQueued, HostStaging, host_tensor, pinned_host_memory
from lightning_megatron.offload.nvme import NvmeOptimizerTier
from lightning_megatron.offload.settings import OffloadSettings
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
_TAGS = ("tensor_shard", "tied_names", "expert_parallel", "whole_expert")


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

    def __init__(self, optimizer: Optimizer, sync: GradientSynchronizer, *,
                 offload: OffloadSettings = OffloadSettings(), overlap_with: Optional[nn.Module] = None,
                 rank: int = 0, ranks_sharing_host: int = 1) -> None:
        """``offload``: the tiers as the strategy's options normalised them (``offload.settings``); its
        ``optimizer`` tier is where the fp32 pieces and the optimizer state live: ``"none"`` (the device), ``"cpu"``
        (host memory, stepped there: ZeRO-Offload's optimizer half; only 16-bit parameters and gradients stay on the
        accelerator) or ``"nvme"`` (files under ``offload.path``, stepped in tiles through a host buffer pool:
        ``offload.nvme``). ``rank`` and ``ranks_sharing_host`` (ranks on this machine) size the ``"nvme"`` tier's checks and name its files.
        ``overlap_with`` (ZeRO only): the model whose next forward waits, module by module, for the parameter
        all-gathers :meth:`finish_step` starts (``overlap_param_gather``); ``None``: they complete in it."""
        check_wrappable(optimizer, sync.zero_stage)
        self.optimizer, self.sync, self.tier = optimizer, sync, offload.optimizer
        group_of = {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self.gather: Optional[ParamGather] = None
        if sync.zero_stage:
            self.gather = ParamGather(sync.buckets, self._flatten_params(), overlap_with=overlap_with)
        owned = [(piece, group_of[id(piece.param)]) for piece in sync.owned_pieces() if id(piece.param) in group_of]
        # Offloaded pieces of a model on CUDA live in page-locked memory: copies to and from it need not block.
        self._pinned = self.tier != "none" and any(pinned_host_memory(piece.param.device) for piece, _ in owned)
        self._written: Optional[torch.cuda.Event] = None  # the last step's copies of the pieces into the model
        self.nvme: Optional[NvmeOptimizerTier] = None
        if self.tier == "nvme":
            grads_in_place = all(p.param.dtype == torch.float32 and p.param.device.type == "cpu" for p, _ in owned)
            self.nvme = NvmeOptimizerTier(optimizer, [(self._owned(p), g) for p, g in owned], path=offload.path,
                                          buffer_mb=offload.buffer_mb, grads_in_place=grads_in_place,
                                          write_back=self._write_back, rank=rank, ranks_sharing_host=ranks_sharing_host,
                                          pin_memory=self._pinned)
            mains = [tiled.main for tiled in self.nvme.mains]
        else:
            mains = [self._main_piece(self._owned(piece)) for piece, _ in owned]
        self.pieces: list[tuple[OwnedPiece, nn.Parameter]] = []
        new_params: list[list[nn.Parameter]] = [[] for _ in optimizer.param_groups]
        for (piece, group), main in zip(owned, mains):
            for tag in _TAGS:  # the global-norm clip needs to know how to count it
                if hasattr(piece.param, tag):
                    setattr(main, tag, getattr(piece.param, tag))
            main.shard_flat_start = piece.start  # where in its shard: replicated ranges are counted once
            new_params[group].append(main)
            self.pieces.append((piece, main))
        self._index_of = {id(main): i for i, (_, main) in enumerate(self.pieces)}
        for group, params in zip(optimizer.param_groups, new_params):
            group["params"] = params
        optimizer.state.clear()
        homes = [self._grad_home(index) for index in range(len(self.pieces))]
        self.staging = HostStaging(homes, device=owned[0][0].param.device if owned else torch.device("cpu"),
                                   reduced_homes=[self._reduced_home(index, home) for index, home in enumerate(homes)])
        self._staged_by_bucket: dict[int, list[int]] = {}
        self._early_buckets: set[int] = set()  # copied when their reduction is launched
        for index, (piece, _) in enumerate(self.pieces):
            if self.staging.homes[index] is not None:
                self._staged_by_bucket.setdefault(id(piece.bucket), []).append(index)
            if self.staging.reduced_homes[index] is not None:
                self._early_buckets.add(id(piece.bucket))
        if self._staged_by_bucket:
            sync.on_bucket_final = self._stage_bucket
        if self._early_buckets:
            sync.on_bucket_reduced = self._stage_reduced_bucket

    @staticmethod
    def _owned(piece: OwnedPiece) -> Tensor:
        """The model's elements of ``piece`` (a flat view of its parameter)."""
        return piece.param.detach().reshape(-1)[piece.start : piece.stop]

    def _main_piece(self, flat: Tensor) -> nn.Parameter:
        """The fp32 main piece on the device or in host memory: fp32 device parameters are shared, not copied."""
        if flat.dtype == torch.float32 and self.tier == "none":
            return nn.Parameter(flat)
        if self.tier == "cpu":
            return nn.Parameter(host_tensor(flat.numel(), dtype=torch.float32, pinned=self._pinned).copy_(flat))
        return nn.Parameter(flat.to(dtype=torch.float32, copy=True))

    def _grad_home(self, index: int) -> Optional[Tensor]:
        """Where piece ``index``'s fp32 gradient is copied every step when the main piece is offloaded to host memory
        and cannot read the reduced gradient in place: the ``"nvme"`` tier's gradient file, else a host tensor made
        here, once. None: read in place (fp32 on the host), or converted where the model is (tier ``"none"``, a CPU
        model's too: as on a GPU, a transient of the step, not a copy kept for the whole run)."""
        piece, main = self.pieces[index]
        if self.tier == "none" or (piece.param.dtype == torch.float32 and piece.param.device.type == "cpu"):
            return None
        if self.nvme is not None:
            return self.nvme.grad_home(index)
        return host_tensor(main.numel(), dtype=torch.float32, pinned=self._pinned)

    def _reduced_home(self, index: int, home: Optional[Tensor]) -> Optional[Tensor]:
        """Where piece ``index``'s reduced gradient is copied early (``HostStaging.copy_reduced``), in the
        gradient's dtype: the fp32 home itself, or a host tensor of the 16-bit dtype made here, once. None: copied
        when final, for a piece that is not staged, of a bucket that is not final when reduced, or of the
        ``"nvme"`` tier (whose homes are files: the copy would block, and memory is what that tier saves)."""
        piece = self.pieces[index][0]
        if home is None or self.tier != "cpu" or not piece.bucket.final_when_reduced:
            return None
        if piece.param.dtype == torch.float32:
            return home
        return host_tensor(home.numel(), dtype=piece.param.dtype, pinned=self._pinned)

    def _stage_reduced_bucket(self, bucket, reduced: Tensor, work) -> Optional[CopiesQueued]:
        """``GradientSynchronizer.on_bucket_reduced``: the bucket's reduction is launched and ``reduced`` (its
        owned range) will hold the result once ``work`` is done; start copying its pieces to the host."""
        if id(bucket) not in self._early_buckets:
            return None
        return self.staging.copy_reduced([(index, self.sync.owned_grad(self.pieces[index][0], reduced))
                                          for index in self._staged_by_bucket[id(bucket)]], work)

    def _stage_bucket(self, bucket, scale: Optional[float]) -> None:
        """``GradientSynchronizer.on_bucket_final``: the bucket's gradients are reduced and normalised (multiplied
        by ``scale``); the pieces copied early get the same scale on the host, the others start their copies."""
        indices = self._staged_by_bucket.get(id(bucket), [])
        if id(bucket) in self._early_buckets:
            self.staging.normalise(indices, scale)
        else:
            self.staging.copy([(index, self.sync.owned_grad(self.pieces[index][0])) for index in indices])

    def _wait_written(self) -> None:
        """Before the host writes the main pieces again: the last step's copies out of them have landed."""
        if self._written is not None:
            self._written.synchronize()
            self._written = None

    def _write_back(self, index: int, lo: int, hi: int, values: Tensor) -> None:
        """The ``"nvme"`` step's updated values of piece ``index``'s elements ``[lo, hi)``, into the model."""
        piece = self.pieces[index][0]
        piece.param.detach().view(-1)[piece.start + lo : piece.start + hi].copy_(values)

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
        self._wait_written()
        with torch.no_grad():
            for piece, main in self.pieces:
                owned = piece.param.detach().reshape(-1)[piece.start : piece.stop]
                if owned.data_ptr() != main.data_ptr():
                    main.copy_(owned)

    def prepare_step(self) -> None:
        """Hand the reduced, token-normalised owned gradients to the fp32 pieces: in place, converted on the
        device, or (host pieces) in their host homes, whose copies the reduction started; one wait for those."""
        self.wait_for_params()  # no gather in flight while the optimizer writes the owned slices
        self._wait_written()
        missed = []  # gradients that were finished without the bucket hook
        for index, (piece, main) in enumerate(self.pieces):
            grad = self.sync.owned_grad(piece)
            if self.staging.homes[index] is not None:
                if not self.staging.copied(index):
                    missed.append((index, grad))
                main.grad = self.staging.homes[index]
            elif grad.dtype == torch.float32 and grad.device == main.device:
                main.grad = grad
            else:
                main.grad = grad.to(main.device, torch.float32)
        self.staging.copy(missed)
        self.staging.wait()

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
                if self.nvme is None and owned.data_ptr() != main.data_ptr():  # "nvme": its step wrote them
                    owned.copy_(main, non_blocking=self._pinned)  # from page-locked memory: queued, not waited for
                main.grad = None
            if self._pinned and self.nvme is None:  # "cpu": the next host writes must wait for these copies
                self._written = torch.cuda.Event()
                self._written.record()
            if self.gather is not None:
                self.gather.launch()

    def state_home(self, main: nn.Parameter, key: str) -> Optional[Tensor]:
        """Where state ``key`` of ``main`` lives when it is not a fresh tensor like ``main`` (the ``"nvme"`` tier's
        files), for loading a checkpoint in place; None otherwise."""
        if self.nvme is None:
            return None
        index = self._index_of.get(id(main))
        return None if index is None else self.nvme.state_home(index, key)

    def remove(self) -> None:
        """Remove the forward pre-hooks of the overlapped gathers; close the ``"nvme"`` tier (its folder goes)."""
        if self.gather is not None:
            self.gather.remove()
        if getattr(self.sync, "on_bucket_final", None) == self._stage_bucket:
            self.sync.on_bucket_final = None
        if getattr(self.sync, "on_bucket_reduced", None) == self._stage_reduced_bucket:
            self.sync.on_bucket_reduced = None
        self._wait_written()
        if self.nvme is not None:
            self.nvme.close()

    def main_param_bytes(self) -> int:
        """Bytes of fp32 copies in memory; pieces that are views of fp32 parameters, or in the ``"nvme"`` tier's
        files, cost nothing here (``nvme.disk_bytes``)."""
        if self.nvme is not None:
            return 0
        # One storage or two (not data pointers: a fake tensor's, lightning-megatron simulate's, are all alike).
        return sum(main.numel() * main.element_size() for piece, main in self.pieces
                   if main.untyped_storage()._cdata != piece.param.untyped_storage()._cdata)


def uses_main_params(params: list[nn.Parameter], zero_stage: int, offload: OffloadSettings = OffloadSettings()) -> bool:
    """fp32 main copies are needed under ZeRO, for 16-bit parameters (Megatron's mixed precision)
    and to step the optimizer in host memory or on disk."""
    return offload.optimizer != "none" or zero_stage > 0 or any(p.dtype in (torch.float16, torch.bfloat16) for p in params)


#: What a rank's model state is made of, in bytes (:func:`model_state_bytes`, the planner's prediction of it).
MODEL_STATE_KEYS = ("parameters", "gradients", "main_parameters", "optimizer_state")


def model_state_bytes(
    params: list[nn.Parameter],
    sync: Optional[GradientSynchronizer],
    main: Optional[MainParamOptimizer],
    optimizer: Optimizer,
) -> dict[str, int]:
    """Per-rank bytes in memory of parameters, gradients, fp32 main parameters and optimizer state (tensors, not step
    counters); what the ``"nvme"`` tier keeps in its files is not in memory (``NvmeOptimizerTier.disk_bytes``)."""
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor) and v.dim() > 0]
    on_disk = main is not None and main.nvme is not None  # its state tensors are views of its files
    return {
        "parameters": sum(p.numel() * p.element_size() for p in dict.fromkeys(params)),
        "gradients": sync.gradient_bytes() if sync is not None else 0,
        "main_parameters": main.main_param_bytes() if main is not None else 0,
        "optimizer_state": 0 if on_disk else sum(v.numel() * v.element_size() for v in state),
    }
