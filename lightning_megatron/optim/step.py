"""One optimizer step's gradient bookkeeping, between Lightning's hooks and the optimizer.

Lightning hands the strategy micro-batches (``training_step``, ``backward``) and then one
``optimizer_step``; ``StepGradients`` turns what happens in between into exact gradients:
it counts the tokens the loss is averaged over, chooses what each backward multiplies the
token-summed loss by, completes the data-parallel reduction and divides those factors out,
hands the owned pieces to the fp32 main parameters, and decides (the same on every rank)
whether an fp16 step overflowed, or (other precisions, ``optim.nonfinite``) whether the step's
losses and global gradient norm are finite.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_megatron.optim.clip import clip_grads_by_global_norm, first_replicas, local_grad_squares
from lightning_megatron.optim.grad_sync import GradientSynchronizer, LocalGradients
from lightning_megatron.optim.loss_scaler import DynamicLossScaler, found_overflow
from lightning_megatron.optim.main_params import MainParamOptimizer, uses_main_params
from lightning_megatron.optim.nonfinite import NonFiniteCheck, loss_flags
from lightning_megatron.optim.partial_grads import partial_grad_groups
from lightning_megatron.parallel.state import ParallelState


class StepGradients:
    def __init__(
        self,
        sync: GradientSynchronizer,
        main_params: Optional[MainParamOptimizer],
        loss_scaler: Optional[DynamicLossScaler],
        *,
        data_parallel_group: Optional[dist.ProcessGroup],
        device: torch.device,
        model_parallel_group: Optional[dist.ProcessGroup] = None,
        nonfinite: Optional[NonFiniteCheck] = None,
        replica_ranks: Optional[tuple[int, int]] = None,
    ) -> None:
        """``nonfinite``: the check to run in :meth:`check_finite` (None: no check, e.g. under fp16,
        whose loss scaler handles overflows itself); ``model_parallel_group`` (tp x pp) is where it sums.
        ``replica_ranks``: (dp rank, expert-data-parallel rank) under expert parallelism without ZeRO, where
        the norm is summed over dp with each replica counted once (``clip.first_replicas``)."""
        self.sync, self.main_params, self.loss_scaler = sync, main_params, loss_scaler
        self.data_parallel_group, self.device = data_parallel_group, device
        self.data_parallel_size = 1 if data_parallel_group is None else dist.get_world_size(data_parallel_group)
        self.model_parallel_group, self.nonfinite = model_parallel_group, nonfinite
        self.replica_ranks = replica_ranks
        self._tokens: Tensor | float = 0.0
        self._token_estimate: Optional[float] = None
        self._loss_flags: Optional[Tensor] = None  # this rank's [NaN losses, Inf losses] of the step
        self._step_loss_flags: Optional[Tensor] = None  # the same, summed over dp by finish()

    def add_tokens(self, tokens: Tensor | float) -> None:
        """Tokens the loss of one micro-batch (or one pipeline schedule) counted on this rank."""
        self._tokens = self._tokens + tokens

    def add_loss(self, loss: Tensor) -> None:
        """Note whether one micro-batch's loss (as ``training_step`` returned it) is NaN or Inf.

        Device tensors only: no host synchronisation per micro-batch; :meth:`check_finite`
        reads the sum once per step, inside the gradient norm's all-reduce."""
        if self.nonfinite is None:
            return
        flags = loss_flags(loss)
        self._loss_flags = flags if self._loss_flags is None else self._loss_flags + flags

    def backward_scale(self, micro_batch_tokens: Tensor | float, *, accumulation: int, loss_scale: float) -> float:
        """What a micro-batch's token-summed loss is multiplied by before backward.

        The exact per-token mean needs the global token count, known only once every
        micro-batch has run; so backward uses a fixed guess made at the step's first
        micro-batch (the most tokens any dp rank's micro-batch counts x accumulation x dp),
        which keeps gradients at the size of a mean (fp16 would overflow on a sum), and
        :meth:`finish` divides out guess / true count. The guess must be the same on every dp
        rank, whose gradients are summed: hence one scalar all-reduce per step. An fp16 loss
        scale joins the factor.
        """
        if self._token_estimate is None:
            tokens = torch.tensor(max(float(micro_batch_tokens), 1.0), device=self.device)
            if self.data_parallel_group is not None:
                dist.all_reduce(tokens, op=dist.ReduceOp.MAX, group=self.data_parallel_group)
            self._token_estimate = float(tokens) * accumulation * self.data_parallel_size
        return loss_scale / self._token_estimate

    def finish(self, *, accumulation: int, loss_scale: float) -> bool:
        """Reduce, normalise, and prepare the optimizer's gradients; returns whether the step overflowed
        (fp16 with our loss scaler; then the optimizer finds no gradients and changes nothing)."""
        tokens = self._tokens if isinstance(self._tokens, Tensor) else torch.tensor(float(self._tokens))
        if self.nonfinite is not None and self._loss_flags is None:  # every dp rank must send the same shape
            self._loss_flags = torch.zeros(2, dtype=torch.float64, device=self.device)
        self._step_loss_flags = self.sync.finish(
            tokens, backward_scale=self.backward_scale(tokens, accumulation=accumulation, loss_scale=loss_scale),
            also_sum=self._loss_flags if self.nonfinite is not None else None)
        self._tokens, self._token_estimate = 0.0, None
        if self.main_params is not None:
            self.main_params.prepare_step()
        if self.loss_scaler is None:
            return False
        owner = self.main_params if self.main_params is not None else self.sync  # ZeRO-3: fp32 shards step
        overflow = found_overflow(owner.main_grads(), self.device)
        self.loss_scaler.update(overflow)
        if overflow:
            self.drop_grads()
        return overflow

    def drop_grads(self) -> None:
        """Skip this step on this rank: the optimizer finds no gradient on what it steps and changes nothing."""
        (self.main_params if self.main_params is not None else self.sync).drop_grads()

    def check_finite(self, params: Iterable[nn.Parameter], *, is_first_tensor_rank: bool, step: int,
                     epoch: int) -> tuple[Optional[Tensor], Optional[str]]:
        """After :meth:`finish`: this step's global gradient norm, checked with the micro-batch losses.

        ``params``: what the optimizer steps (the fp32 main pieces under ZeRO / 16-bit parameters),
        counted as clipping counts them; under ZeRO-3 its own shards. Returns ``(norm, None)`` for
        a finite step (the norm is for clipping to reuse), ``(norm, warning)`` for a step skipped on
        every rank, and raises ``NonFiniteError`` on every rank otherwise. ``(None, None)`` without a check.
        """
        check, local_losses, losses = self.nonfinite, self._loss_flags, self._step_loss_flags
        self._loss_flags = self._step_loss_flags = None
        if check is None:
            return None, None
        mp, dp = self.model_parallel_group, self.data_parallel_group
        if hasattr(self.sync, "grad_squares"):  # ZeRO-3: its shards, summed over dp then tp x pp (its grad_norm)
            squares, grads, reductions = self.sync.grad_squares(), self.sync.main_grads(), [(dp, False), (mp, True)]
        else:  # clip.py's order: tp x pp, then dp where dp ranks hold different pieces (ZeRO-1/2, experts)
            params = [p for p in dict.fromkeys(params) if p.grad is not None]
            counted, over_dp = self._norm_counting(params)
            squares = local_grad_squares(counted, is_first_tensor_rank=is_first_tensor_rank)
            grads = [p.grad for p in params]
            reductions = [(mp, True)] + ([(dp, False)] if over_dp else [])
        norm, finite = check.global_norm(squares, losses, reductions, device=self.device)
        if finite:
            check.passed()
            return norm, None
        grads_finite = all(bool(torch.isfinite(grad).all()) for grad in grads)
        warning = check.non_finite(local_losses, grads_finite=grads_finite, step=step, epoch=epoch, device=self.device)
        self.drop_grads()
        return norm, warning

    def _norm_counting(self, params: list[nn.Parameter]) -> tuple[list[nn.Parameter], bool]:
        """What this rank counts in the global norm, and whether the squares are summed over dp too (ZeRO's pieces
        and expert parallelism's experts differ across dp ranks; then each replica is counted once)."""
        if self.replica_ranks is None:
            return params, bool(self.sync.zero_stage)
        data_rank, expert_data_rank = self.replica_ranks
        return first_replicas(params, data_parallel_rank=data_rank, expert_data_parallel_rank=expert_data_rank), True

    def clip(self, params: Iterable[nn.Parameter], max_norm: float, *, is_first_tensor_rank: bool,
             norm: Optional[Tensor] = None) -> Tensor:
        """Clip by the global norm (``optim.clip``), counted and summed as :meth:`check_finite` counts it."""
        params = list(params)
        counted, over_dp = self._norm_counting(params)
        return clip_grads_by_global_norm(params, max_norm, model_parallel_group=self.model_parallel_group,
                                         is_first_tensor_rank=is_first_tensor_rank,
                                         data_parallel_group=self.data_parallel_group if over_dp else None,
                                         reduce_device=self.device, norm=norm, counted=counted)

    def after_step(self) -> None:
        if self.main_params is not None:
            self.main_params.finish_step()
        self.sync.zero()

    def remove(self) -> None:
        self.sync.remove()
        if self.main_params is not None:
            self.main_params.remove()


def replica_ranks(state: ParallelState) -> Optional[tuple[int, int]]:
    """(dp rank, expert-data-parallel rank) where the gradient norm must count replicas once over dp: expert
    parallelism without ZeRO (ZeRO's pieces are distinct anyway); None otherwise."""
    if state.config.expert_parallel_size == 1 or state.config.zero_stage:
        return None
    return state.data_parallel_rank, state.expert_data_parallel_rank


def build_step_gradients(module: nn.Module, state: ParallelState, optimizers: list, *, zero3=None,
                         loss_scaler: Optional[DynamicLossScaler], nonfinite: Optional[NonFiniteCheck],
                         bucket_size_mb: float, offload: bool, device: torch.device,
                         overlap_param_gather: bool = False) -> StepGradients:
    """The gradient path this layout needs: ZeRO-3's own, one replica's plain ``param.grad`` (no dp, no
    main params), or flat buckets reduced over dp; plus fp32 main parameters where ZeRO, 16-bit
    parameters or offloading ask for them, whose ZeRO 1/2 parameter all-gathers ``module``'s next forward
    waits for under ``overlap_param_gather``."""
    # Weights are replicated over dp x cp (context-parallel ranks hold other tokens of the same samples): gradients
    # are summed, token counts added and ZeRO pieces cut over that one group.
    common = dict(data_parallel_group=state.replica_group, device=device,
                  model_parallel_group=state.model_parallel_group, nonfinite=nonfinite,
                  replica_ranks=replica_ranks(state))
    if zero3 is not None:
        return StepGradients(zero3, None, loss_scaler, **common)
    params = [p for p in module.parameters() if p.requires_grad]
    partial = partial_grad_groups(params, state)
    needs_main_params = uses_main_params(params, state.config.zero_stage, offload)
    if state.replica_group is None and not needs_main_params:
        sync = LocalGradients(params, partial_grad_groups=partial)
    else:
        sync = GradientSynchronizer(params, data_parallel_group=state.replica_group,
                                    partial_grad_groups=partial, bucket_size_mb=bucket_size_mb,
                                    zero_stage=state.config.zero_stage,
                                    expert_data_parallel_group=state.expert_data_parallel_group)
    main_params = None
    if needs_main_params:
        if len(optimizers) != 1:
            raise ValueError(f"fp32 main parameters (zero_stage > 0, 16-bit parameters or offload_optimizer) support "
                             f"one optimizer; configure_optimizers returned {len(optimizers)}.")
        main_params = MainParamOptimizer(optimizers[0], sync, offload=offload,
                                         overlap_with=module if overlap_param_gather else None)
    if loss_scaler is not None and main_params is None:
        raise ValueError("precision='16-true' needs 16-bit parameters with fp32 main parameters.")
    return StepGradients(sync, main_params, loss_scaler, **common)
