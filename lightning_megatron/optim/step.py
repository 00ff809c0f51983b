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

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_megatron.offload.settings import OffloadSettings
from lightning_megatron.optim.clip import NormCounting, first_replicas, reduce_squares, scale_to_norm
from lightning_megatron.optim.grad_sync import GradientSynchronizer, LocalGradients
from lightning_megatron.optim.loss_scaler import DynamicLossScaler, found_overflow
from lightning_megatron.optim.main_params import MainParamOptimizer, uses_main_params
from lightning_megatron.optim.nonfinite import NonFiniteCheck, loss_flags, loss_poison
from lightning_megatron.optim.partial_grads import partial_grad_groups
from lightning_megatron.parallel.agree import on_every_rank
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
        is_first_tensor_rank: bool = True,
    ) -> None:
        """``nonfinite``: the check to run in :meth:`check_finite` (None: no check, e.g. under fp16,
        whose loss scaler handles overflows itself); ``model_parallel_group`` (tp x pp) is where it sums.
        ``replica_ranks``: (dp rank, expert-data-parallel rank) under expert parallelism without ZeRO, where
        the norm is summed over dp with each replica counted once (``clip.first_replicas``).
        ``is_first_tensor_rank``: this rank counts the parameters replicated over tp in the norm."""
        self.sync, self.main_params, self.loss_scaler = sync, main_params, loss_scaler
        self.data_parallel_group, self.device = data_parallel_group, device
        self.data_parallel_size = 1 if data_parallel_group is None else dist.get_world_size(data_parallel_group)
        self.model_parallel_group, self.nonfinite = model_parallel_group, nonfinite
        self.replica_ranks, self.is_first_tensor_rank = replica_ranks, is_first_tensor_rank
        self._counting: Optional[_Counting] = None
        self._tokens: Tensor | float = 0.0
        self._token_estimate: Optional[Tensor] = None
        self._losses: list[Tensor] = []  # this step's micro-batch losses, for the message of a non-finite step
        self._poison: Optional[Tensor] = None  # 0 while this rank's losses are finite, NaN otherwise (nonfinite.py)
        self._step_poison: Optional[Tensor] = None  # the same, summed over dp by finish()

    def add_tokens(self, tokens: Tensor | float) -> None:
        """Tokens the loss of one micro-batch (or one pipeline schedule) counted on this rank."""
        self._tokens = self._tokens + tokens

    def add_loss(self, loss: Tensor) -> None:
        """Note whether one micro-batch's loss (as ``training_step`` returned it) is NaN or Inf.

        Device tensors only: no host synchronisation per micro-batch; :meth:`check_finite`
        reads the verdict once per step, inside the gradient norm's all-reduce."""
        if self.nonfinite is None:
            return
        loss = loss.detach()
        self._losses.append(loss)
        poison = loss_poison(loss)
        self._poison = poison if self._poison is None else self._poison + poison

    def backward_scale(self, micro_batch_tokens: Tensor | float, *, accumulation: int, loss_scale: float) -> Tensor:
        """What a micro-batch's token-summed loss is multiplied by before backward.

        The exact per-token mean needs the global token count, known only once every
        micro-batch has run; so backward uses a fixed guess made at the step's first
        micro-batch (the most tokens any dp rank's micro-batch counts x accumulation x dp),
        which keeps gradients at the size of a mean (fp16 would overflow on a sum), and
        :meth:`finish` divides out guess / true count. The guess must be the same on every dp
        rank, whose gradients are summed: hence one scalar all-reduce per step. An fp16 loss
        scale joins the factor. A float64 tensor on the device: reading the token count on the
        host would stall the host until the forward pass had run, before it could queue backward.
        The guess is rounded up to a power of two: multiplying by it is then exact, and FP8's
        casts of the gradients (``tensor_parallel.fp8``; rowwise scales are powers of two) give
        the same numbers whatever guess a layout makes (its micro-batch tokens, dp, cp).
        """
        if self._token_estimate is None:
            if isinstance(micro_batch_tokens, Tensor):
                tokens = micro_batch_tokens.detach().to(self.device, torch.float64).clamp(min=1.0)
            else:
                tokens = torch.tensor(max(float(micro_batch_tokens), 1.0), dtype=torch.float64, device=self.device)
            if self.data_parallel_group is not None:
                dist.all_reduce(tokens, op=dist.ReduceOp.MAX, group=self.data_parallel_group)
            self._token_estimate = torch.exp2(torch.ceil(torch.log2(tokens * (accumulation * self.data_parallel_size))))
        return loss_scale / self._token_estimate

    def finish(self, *, accumulation: int, loss_scale: float) -> bool:
        """Reduce, normalise, and prepare the optimizer's gradients; returns whether the step overflowed
        (fp16 with our loss scaler; then the optimizer finds no gradients and changes nothing)."""
        tokens = self._tokens if isinstance(self._tokens, Tensor) else torch.tensor(float(self._tokens))
        if self.nonfinite is not None and self._poison is None:  # every dp rank must send the same shape
            self._poison = torch.zeros((), dtype=torch.float64, device=self.device)
        backward_scale = float(self.backward_scale(tokens, accumulation=accumulation, loss_scale=loss_scale))
        self._step_poison = self.sync.finish(tokens, backward_scale=backward_scale, also_sum=self._poison)
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

    def check_finite(self, param_groups: Sequence[dict], *, step: int,
                     epoch: int) -> tuple[Optional[Tensor], Optional[str]]:
        """After :meth:`finish`: this step's global gradient norm, checked with the micro-batch losses.

        ``param_groups``: the optimizer's (their parameters are what it steps: the fp32 main pieces
        under ZeRO / 16-bit parameters), counted as clipping counts them; under ZeRO-3 its own shards.
        Returns ``(norm, None)`` for a finite step (the norm is for clipping to reuse), ``(norm, warning)``
        for a step skipped on every rank, and raises ``NonFiniteError`` on every rank otherwise.
        ``(None, None)`` without a check.
        """
        check, losses, poison = self.nonfinite, self._losses, self._step_poison
        self._losses, self._poison, self._step_poison = [], None, None
        if check is None:
            return None, None
        mp, dp = self.model_parallel_group, self.data_parallel_group
        if hasattr(self.sync, "grad_squares"):  # ZeRO-3: its shards, summed over dp then tp x pp (its grad_norm)
            squares, groups = self.sync.grad_squares(), (dp, mp)
        else:  # clip.py's order: tp x pp, then dp where dp ranks hold different pieces (ZeRO-1/2, experts)
            counting = self._counting_of(param_groups)
            squares, groups = counting.norm.squares(), (mp, dp if counting.over_dp else None)
        norm, finite = check.global_norm(squares, poison, groups, device=self.device)
        if finite:
            check.passed()
            return norm, None
        grads = self.sync.main_grads() if hasattr(self.sync, "grad_squares") else self._counting_of(param_groups).grads()
        grads_finite = all(bool(torch.isfinite(grad).all()) for grad in grads)
        local_losses = sum(loss_flags(loss) for loss in losses) if losses else None
        warning = check.non_finite(local_losses, grads_finite=grads_finite, step=step, epoch=epoch, device=self.device)
        self.drop_grads()
        return norm, warning

    def _counting_of(self, param_groups: Sequence[dict]) -> "_Counting":
        """The optimizer's parameters and how this rank counts them in the global norm: worked out on first use
        and again only when the optimizer's parameter lists change, so that a step runs no per-parameter Python
        beyond reading the gradients."""
        if self._counting is None or not self._counting.describes(param_groups):
            params = list(dict.fromkeys(p for group in param_groups for p in group["params"]))
            if self.replica_ranks is None:  # ZeRO's pieces differ across dp ranks: summed over dp too
                counted, over_dp = params, bool(self.sync.zero_stage)
            else:  # experts differ across dp ranks: each replica counted once
                data_rank, expert_data_rank = self.replica_ranks
                counted = first_replicas(params, data_parallel_rank=data_rank, expert_data_parallel_rank=expert_data_rank)
                over_dp = True
            self._counting = _Counting(param_groups, params, NormCounting(counted, is_first_tensor_rank=self.is_first_tensor_rank),
                                       over_dp)
        return self._counting

    def clip(self, param_groups: Sequence[dict], max_norm: float, *, norm: Optional[Tensor] = None) -> Tensor:
        """Clip by the global norm (``optim.clip``), counted and summed as :meth:`check_finite` counts it;
        ``norm``: this step's, if the check measured it already (then no collective). Returns the norm."""
        counting = self._counting_of(param_groups)
        if norm is None:
            groups = (self.model_parallel_group, self.data_parallel_group if counting.over_dp else None)
            norm = reduce_squares(counting.norm.squares(), groups, reduce_device=self.device)
        scale_to_norm(counting.grads(), max_norm, norm)
        return norm

    def after_step(self) -> None:
        if self.main_params is not None:
            self.main_params.finish_step()
        self.sync.zero()

    def remove(self) -> None:
        self.sync.remove()
        if self.main_params is not None:
            self.main_params.remove()


class _Counting:
    """An optimizer's parameters (each once) and the rank's :class:`NormCounting` of them, for the parameter
    lists they were taken from (held, so that a list replaced later is told apart from them)."""

    def __init__(self, param_groups: Sequence[dict], params: list[nn.Parameter], norm: NormCounting,
                 over_dp: bool) -> None:
        self.lists = [(group["params"], len(group["params"])) for group in param_groups]
        self.params, self.norm, self.over_dp = params, norm, over_dp

    def describes(self, param_groups: Sequence[dict]) -> bool:
        return len(param_groups) == len(self.lists) and all(
            group["params"] is held and len(held) == size for group, (held, size) in zip(param_groups, self.lists))

    def grads(self) -> list[Tensor]:
        return [grad for param in self.params if (grad := param.grad) is not None]


def replica_ranks(state: ParallelState) -> Optional[tuple[int, int]]:
    """(dp rank, expert-data-parallel rank) where the gradient norm must count replicas once over dp: expert
    parallelism without ZeRO (ZeRO's pieces are distinct anyway); None otherwise."""
    if state.config.expert_parallel_size == 1 or state.config.zero_stage:
        return None
    return state.data_parallel_rank, state.expert_data_parallel_rank


def build_step_gradients(module: nn.Module, state: ParallelState, optimizers: list, options: Any, *, zero3=None,
                         loss_scaler: Optional[DynamicLossScaler], nonfinite: Optional[NonFiniteCheck],
                         device: torch.device, ranks_sharing_host: int = 1) -> StepGradients:
    """The gradient path this layout needs: ZeRO-3's own, one replica's plain ``param.grad`` (no dp, no
    main params), or flat buckets reduced over dp; plus fp32 main parameters where ZeRO, 16-bit
    parameters or offloading ask for them.

    ``options``: the strategy's (``strategy.options.StrategyOptions``), whole; read here: ``bucket_size_mb``,
    ``offload`` (the tiers, ``offload.settings``) and ``overlap_param_gather`` (ZeRO 1/2: ``module``'s next forward
    waits for the parameter all-gathers). Collective where the ``"nvme"`` tier is set up: its disk and memory
    checks fail on every rank or on none (``ranks_sharing_host``: this job's ranks on this machine, which share its
    disk and memory)."""
    offload: OffloadSettings = options.offload
    # Weights are replicated over dp x cp (context-parallel ranks hold other tokens of the same samples): gradients
    # are summed, token counts added and ZeRO pieces cut over that one group.
    common = dict(data_parallel_group=state.replica_group, device=device,
                  model_parallel_group=state.model_parallel_group, nonfinite=nonfinite,
                  replica_ranks=replica_ranks(state), is_first_tensor_rank=state.tensor_parallel_rank == 0)
    if zero3 is not None:
        return StepGradients(zero3, None, loss_scaler, **common)
    params = [p for p in module.parameters() if p.requires_grad]
    partial = partial_grad_groups(params, state)
    needs_main_params = uses_main_params(params, state.config.zero_stage, offload)
    if state.replica_group is None and not needs_main_params:
        sync = LocalGradients(params, partial_grad_groups=partial)
    else:
        sync = GradientSynchronizer(params, data_parallel_group=state.replica_group,
                                    partial_grad_groups=partial, bucket_size_mb=options.bucket_size_mb,
                                    zero_stage=state.config.zero_stage,
                                    expert_data_parallel_group=state.expert_data_parallel_group, device=device)
    main_params = None
    if needs_main_params:
        if len(optimizers) != 1:
            raise ValueError(f"fp32 main parameters (zero_stage > 0, 16-bit parameters or offload_optimizer) support "
                             f"one optimizer; configure_optimizers returned {len(optimizers)}.")
        rank = dist.get_rank() if dist.is_initialized() else 0

        def make() -> MainParamOptimizer:
            return MainParamOptimizer(optimizers[0], sync, offload=offload, rank=rank, ranks_sharing_host=ranks_sharing_host,
                                      overlap_with=module if options.overlap_param_gather else None)

        nvme = offload.optimizer == "nvme"  # the same on every rank
        main_params = on_every_rank(make, doing="set up the 'nvme' offload tier", undo=MainParamOptimizer.remove) \
            if nvme else make()
    if loss_scaler is not None and main_params is None:
        raise ValueError("precision='16-true' needs 16-bit parameters with fp32 main parameters.")
    return StepGradients(sync, main_params, loss_scaler, **common)
