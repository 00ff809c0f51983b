"""A Mixture-of-Experts MLP (Mixtral, Qwen-MoE, DeepSeek-style), as one swappable piece of a decoder layer.

``MoE`` replaces a layer's MLP: a :class:`~lightning_megatron.models.router.TopKRouter` picks ``top_k``
of ``num_experts`` expert MLPs per token, the chosen experts' outputs are summed with the router's
weights, and optional *shared* experts (always on) are added, gated per token for Qwen-MoE.

The experts are an ``nn.ModuleDict`` keyed by the global expert index (``mlp.experts.5.fc.weight``),
each an ordinary ``GatedMLP``/``MLP`` without biases: expert parallelism keeps a rank's own experts
and deletes the others (as a pipeline stage keeps its layers), tensor parallelism splits each
expert as it splits a dense MLP, and checkpoints and initial values are keyed by the global index
at every layout. They run as one grouped GEMM per matrix where the device has one, else as a loop of
their modules (``models.experts``), with the same numbers.

No host syncs: the routing's shapes are fixed by the token count, and the tokens per expert stay on the
device (``torch.bincount``, boolean masks and ``.tolist()`` are avoided), so with the experts on one rank
and grouped GEMMs neither the forward nor the backward waits for the device. Expert parallelism needs
one read of the exchanged counts per layer (``expert_parallel.dispatcher``), and so does the loop of GEMMs
without it (its slices' sizes).

No process groups here; three pieces are swapped in by the strategy:

* ``region``: where the experts' tensor-parallel region begins and ends. The experts are split
  over tp like a dense MLP (column then row), but their communication is done once for all of
  them: the tokens and the combine weights enter the region (f, or the sequence all-gather under
  sequence parallelism) and the summed output leaves it (g, or the reduce-scatter). The default is
  one process: identities.
* ``dispatcher``: moves the routed tokens to the rank holding their expert and back
  (``expert_parallel.AllToAllDispatcher``); the default keeps them here.
* ``aux_losses``: shared by a model's MoE layers; the load-balancing and z-losses are added to the
  language-model loss's gradient (see :class:`AuxLosses`).

Routing is deterministic and, by default, dropless. With ``capacity_factor`` each expert takes at
most ``ceil(capacity_factor * S * top_k / E)`` tokens of each sequence in training (the highest
weights first, then the earliest positions); per sequence, so the same tokens are dropped at every
layout. Inference is always dropless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch import Tensor, nn

from lightning_megatron.models.experts import deferred_biases, run_experts
from lightning_megatron.models.mlp import build_mlp
from lightning_megatron.models.transformer import dense_mlp_tensor_parallel_plan
from lightning_megatron.models.router import (
    SCORE_FUNCTIONS,
    TopKRouter,
    counts_routing,
    load_balancing_loss,
    sequence_counts,
    z_loss,
)
from lightning_megatron.tensor_parallel.region import InsideRegion
from lightning_megatron.tensor_parallel.styles import PackedColumn


@dataclass(frozen=True)
class MoEConfig:
    """The Mixture-of-Experts part of a ``GPTConfig`` (Megatron-Core's ``moe_*`` settings, without the prefix).

    * ``num_experts``, ``top_k``: routed experts and how many each token uses.
    * ``ffn_hidden_size``: each expert's width (default: the model's ``ffn_hidden_size``).
    * ``layer_freq``: MoE in every ``k``-th layer (layers ``0, k, 2k, ...``, Megatron-Core's rule) or a
      0/1 pattern with one entry per layer.
    * ``score_function``: ``"softmax"`` or ``"sigmoid"``; ``normalize_topk``: renormalise the chosen
      weights to sum to 1 (Mixtral, DeepSeek-V3; Qwen2-MoE's default leaves them).
    * ``aux_loss_coeff``, ``z_loss_coeff``: the load-balancing and router z-loss coefficients (0: off).
    * ``capacity_factor``: None (dropless) or the per-sequence capacity factor (training only).
    * ``expert_bias``: DeepSeek-V3's aux-loss-free balancing, a per-expert bias added for the top-k
      choice, moved by ``expert_bias_update_rate`` after each optimizer step toward equal loads.
    * ``shared_expert_size``: width of an always-on shared expert (0: none; DeepSeek and Qwen-MoE
      use one); ``shared_expert_gate``: Qwen2-MoE's per-token ``sigmoid(gate(x))`` on its output.
    * ``router_num_groups``, ``router_group_topk``: group-limited routing (DeepSeek-V3's ``n_group``,
      ``topk_group``): the experts form ``router_num_groups`` equal groups and a token chooses its ``top_k`` among
      the ``router_group_topk`` groups whose two best scores sum highest (``models.router``); None: no groups.
    * ``router_topk_scaling_factor``: the combine weights are multiplied by it after any renormalisation
      (DeepSeek-V3's ``routed_scaling_factor``, 2.5); None: 1.
    * ``router_bias``: the router's logits have a learned bias (GPT-OSS's; trained by gradients, unlike
      ``expert_bias``, which only steers the choice).
    * ``add_bias_linear``: biases on the routed experts' linear layers (GPT-OSS's), added after each GEMM
      (``models.experts``); under tensor parallelism the down projection's once, after the partial sums are summed
      (``tensor_parallel.region``), the gate/up ones split with their columns.

    GPT-OSS routes by a softmax over the top-k logits only; that is ``score_function="softmax"`` with
    ``normalize_topk=True`` (the full softmax's top-k renormalised: the same experts, the same weights, up to
    rounding), so there is no option for it. Megatron-Core's ``moe_router_pre_softmax`` names the same choice.
    """

    num_experts: int
    top_k: int = 2
    ffn_hidden_size: Optional[int] = None
    layer_freq: Union[int, tuple[int, ...]] = 1
    score_function: str = "softmax"
    normalize_topk: bool = True
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    capacity_factor: Optional[float] = None
    expert_bias: bool = False
    expert_bias_update_rate: float = 1e-3
    shared_expert_size: int = 0
    shared_expert_gate: bool = False
    router_num_groups: Optional[int] = None
    router_group_topk: Optional[int] = None
    router_topk_scaling_factor: Optional[float] = None
    router_bias: bool = False
    add_bias_linear: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.layer_freq, list):  # from YAML
            object.__setattr__(self, "layer_freq", tuple(self.layer_freq))
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"MoEConfig.num_experts must be a positive integer, got {self.num_experts!r}.")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} must be between 1 and num_experts={self.num_experts}.")
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"MoEConfig.score_function={self.score_function!r} is not one of {SCORE_FUNCTIONS}.")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"MoEConfig.capacity_factor must be positive (or None for dropless), "
                             f"got {self.capacity_factor}.")
        if self.shared_expert_gate and not self.shared_expert_size:
            raise ValueError("MoEConfig.shared_expert_gate gates the shared expert: set shared_expert_size too.")
        if isinstance(self.layer_freq, int) and self.layer_freq < 1:
            raise ValueError(f"MoEConfig.layer_freq must be >= 1 or a 0/1 pattern, got {self.layer_freq}.")
        self._check_groups()

    def _check_groups(self) -> None:
        groups, chosen = self.router_num_groups, self.router_group_topk
        if (groups is None) != (chosen is None):
            raise ValueError(f"MoEConfig.router_num_groups={groups} and router_group_topk={chosen}: group-limited "
                             f"routing needs both (or neither).")
        if groups is not None:
            if groups < 1 or self.num_experts % groups:
                raise ValueError(f"MoEConfig.router_num_groups={groups} must divide num_experts={self.num_experts} "
                                 f"into equal groups.")
            if not 1 <= chosen <= groups or self.top_k > chosen * (self.num_experts // groups):
                raise ValueError(f"MoEConfig.router_group_topk={chosen}: a token chooses top_k={self.top_k} experts "
                                 f"among router_group_topk of router_num_groups={groups} groups of "
                                 f"{self.num_experts // groups}; it must be between 1 and {groups} and leave at "
                                 f"least top_k experts to choose from.")
        factor = self.router_topk_scaling_factor
        if factor is not None and not factor > 0:
            raise ValueError(f"MoEConfig.router_topk_scaling_factor={factor} must be positive (None: 1).")

    def is_moe_layer(self, index: int, num_layers: int) -> bool:
        if isinstance(self.layer_freq, int):
            return index % self.layer_freq == 0
        if len(self.layer_freq) != num_layers or set(self.layer_freq) - {0, 1}:
            raise ValueError(f"MoEConfig.layer_freq={self.layer_freq} must be a 0/1 pattern of num_layers="
                             f"{num_layers} entries.")
        return bool(self.layer_freq[index])

    def moe_layers(self, num_layers: int) -> list[int]:
        return [index for index in range(num_layers) if self.is_moe_layer(index, num_layers)]


class OneProcessRegion:
    """The experts' tensor-parallel region on one process: nothing to enter or leave."""

    sequence_parallel = False

    def enter(self, x: Tensor) -> Tensor:
        return x

    def enter_ids(self, ids: Tensor) -> Tensor:
        return ids

    def leave(self, x: Tensor) -> Tensor:
        return x

    def own_part(self, x: Tensor) -> Tensor:
        return x


class LocalDispatcher:
    """Every expert is on this rank: the tokens (sorted by expert) stay where they are, and so do their counts
    (on the device: no host sync)."""

    def dispatch(self, tokens: Tensor, tokens_per_expert: Tensor) -> tuple[Tensor, Tensor]:
        """``tokens`` ``[N, h]`` sorted by expert (assignments the capacity dropped last), ``tokens_per_expert``
        ``[E]`` -> this rank's experts' tokens, grouped by local expert, and how many each gets (``[E_local]``)."""
        return tokens, tokens_per_expert

    def combine(self, expert_output: Tensor) -> Tensor:
        """The inverse of :meth:`dispatch`: the experts' outputs, back in the order of ``tokens``."""
        return expert_output


class _AttachLoss(torch.autograd.Function):
    """Forward: ``output`` unchanged. Backward: also gives ``loss`` the gradient ``scale()``, the factor the
    language-model loss sum is multiplied by before its backward (Megatron-Core's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, output: Tensor, loss: Tensor, scale: Callable[[], float]) -> Tensor:
        ctx.scale = scale
        ctx.loss_shape = loss.shape
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, torch.full(ctx.loss_shape, float(ctx.scale()), dtype=torch.float32, device=grad.device), None


class AuxLosses:
    """The MoE layers' auxiliary losses (token-sum units) and their statistics, shared by one model's layers.

    By default a layer's loss is collected and the model adds it to the loss sum's gradient
    (``GPTModel.loss``: the value reported stays the language-model loss). Under pipeline parallelism
    a layer may sit on a stage that never sees the loss: :meth:`attach_with` makes each layer attach its
    loss to its output, whose backward gives it the gradient the loss sum gets.

    ``statistics()`` is ``[load_balancing, z_loss, max_load]`` averaged over the MoE layers and forwards
    since the last call, the numbers ``GPT.training_step`` logs: the load-balancing value (1.0 for uniform
    routing; it weighs loads by router probabilities, so it can read near 1 while one expert takes twice its
    share), the z-loss per token, and the busiest expert's tokens over the mean (1.0: even loads; ``top_k``
    experts of ``E`` can reach ``E / top_k``) in the micro-batch one data-parallel rank routes (so, unlike the
    other two, it depends on how the global batch is cut); ``reduce`` (set by the strategy) sums this rank's shares over the ranks
    that hold the other layers and sequence chunks.
    """

    def __init__(self) -> None:
        self.terms: list[Tensor] = []
        self.scale: Optional[Callable[[], float]] = None
        self.reduce: Callable[[Tensor], Tensor] = lambda totals: totals
        # What this rank's numbers count for when ``reduce`` sums them: its values are a share of a layer's (1, or
        # 1 / tp where every tp rank routes the same tokens) and each of its layer forwards 1 / tp of one.
        self.value_share, self.forward_share = 1.0, 1.0
        self._totals: Optional[Tensor] = None

    def attach_with(self, scale: Callable[[], float]) -> None:
        self.scale = scale

    def add(self, output: Tensor, loss: Optional[Tensor]) -> Tensor:
        if loss is None or not loss.requires_grad or torch._C._current_graph_task_id() != -1:  # recomputing: added once
            return output
        if self.scale is None:
            self.terms.append(loss)
            return output
        return _AttachLoss.apply(output, loss, self.scale)

    def drain(self) -> Optional[Tensor]:
        """The collected losses' sum (None if none), and forget them."""
        terms, self.terms = self.terms, []
        return torch.stack(terms).sum() if terms else None

    def record(self, balance: Tensor, z: Tensor, load: Tensor, *, sequences: int, tokens: int) -> None:
        """One layer's forward: ``balance`` summed over its sequences and ``z`` over its tokens (this rank's share);
        ``load``: tokens per expert of whole sequences (the same on every tp rank)."""
        if not counts_routing():
            return
        max_load = load.max().double() / load.double().mean().clamp(min=1e-12)
        values = torch.stack([balance.double() / sequences * self.value_share, z.double() / tokens * self.value_share,
                              max_load * self.forward_share, balance.new_tensor(self.forward_share, dtype=torch.float64)])
        self._totals = values if self._totals is None else self._totals + values

    def statistics(self) -> Tensor:
        """``[load_balancing, z_loss, max_load]`` since the last call, zeros if no layer recorded anything (every
        rank must call it: ``reduce`` may communicate). Decided on the device: ``training_step`` reads it every
        micro-batch, and a host read there would sync once per micro-batch."""
        totals, self._totals = self._totals, None
        if totals is None:  # this rank has no MoE layer (a pipeline stage without one) or ran no training forward
            totals = torch.zeros(4, dtype=torch.float64)
        totals = self.reduce(totals)
        recorded = totals[3] > 0
        return torch.where(recorded, totals[:3] / torch.where(recorded, totals[3], 1.0), 0.0).float()


def capacity_mask(expert_ids: Tensor, weights: Tensor, num_experts: int, capacity: int) -> Tensor:
    """``[B, S, k]`` booleans: which assignments each expert keeps, at most ``capacity`` per sequence, by highest
    weight and then earliest position (a stable sort: ties never depend on the layout)."""
    batch = expert_ids.shape[0]
    ids, w = expert_ids.reshape(batch, -1), weights.reshape(batch, -1)
    by_weight = torch.argsort(-w, dim=1, stable=True)
    order = by_weight.gather(1, torch.argsort(ids.gather(1, by_weight), dim=1, stable=True))
    ordered_ids = ids.gather(1, order)
    counts = sequence_counts(expert_ids, num_experts).long()
    first = counts.cumsum(1) - counts  # where each expert's assignments begin in the sorted order
    rank_in_expert = torch.arange(ids.shape[1], device=ids.device) - first.gather(1, ordered_ids)
    keep = torch.zeros_like(ids, dtype=torch.bool).scatter_(1, order, rank_in_expert < capacity)
    return keep.view_as(expert_ids)


class MoE(nn.Module):
    """``x`` ``[B, S, hidden]`` -> ``[B, S, hidden]``: routed experts' weighted sum, plus the shared expert."""

    def __init__(self, hidden_size: int, config: MoEConfig, *, default_ffn_size: int, activation: str,
                 aux_losses: Optional[AuxLosses] = None) -> None:
        super().__init__()
        self.config = config
        ffn = config.ffn_hidden_size or default_ffn_size
        self.router = TopKRouter(hidden_size, config.num_experts, config.top_k, score_function=config.score_function,
                                 normalize_topk=config.normalize_topk, expert_bias=config.expert_bias,
                                 num_groups=config.router_num_groups, group_topk=config.router_group_topk,
                                 scaling_factor=config.router_topk_scaling_factor,
                                 bias=config.router_bias)
        self.experts = nn.ModuleDict({str(e): build_mlp(activation, hidden_size, ffn, bias=config.add_bias_linear)
                                      for e in range(config.num_experts)})
        self.shared_expert = (build_mlp(activation, hidden_size, config.shared_expert_size, bias=False)
                              if config.shared_expert_size else None)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if config.shared_expert_gate else None
        self.region = OneProcessRegion()
        self.dispatcher = LocalDispatcher()
        self.aux_losses = aux_losses if aux_losses is not None else AuxLosses()

    def forward(self, x: Tensor) -> Tensor:
        batch, _, hidden = x.shape  # (a sequence chunk under sequence parallelism)
        routing = self.router(x)
        # The routing of whole sequences (gathered over tp under sequence parallelism): the same on every tp rank.
        expert_ids = self.region.enter_ids(routing.expert_ids)
        weights = self.region.enter(routing.weights)
        tokens = self.region.enter(x)
        seq = tokens.shape[1]
        aux_loss = self._auxiliary_loss(routing, expert_ids, seq)
        keep = None
        if self.config.capacity_factor is not None and self.training:
            capacity = math.ceil(self.config.capacity_factor * seq * self.config.top_k / self.config.num_experts)
            keep = capacity_mask(expert_ids, weights, self.config.num_experts, capacity)
        out, biases = self._routed_experts(tokens.reshape(-1, hidden), expert_ids.reshape(-1), keep)
        combine = weights if keep is None else weights * keep
        out = (out.view(batch, seq, self.config.top_k, hidden) * combine.unsqueeze(-1).to(out.dtype)).sum(dim=2)
        out = self.region.leave(out)
        if biases is not None:  # the down projections' biases, once, after the partial sums (tensor_parallel.region)
            own = self.region.own_part
            combine = routing.weights if keep is None else routing.weights * own(keep)  # this rank's, not entered
            biases = own(biases.view(batch, seq, self.config.top_k, hidden))
            out = out + (biases * combine.unsqueeze(-1).to(biases.dtype)).sum(dim=2)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return self.aux_losses.add(out, aux_loss)

    def _routed_experts(self, tokens: Tensor, expert_ids: Tensor,
                        keep: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
        """``[T * k, hidden]``: each assignment's expert output (zeros where dropped), in assignment order; and its
        expert's down-projection bias where the experts leave it out of their partial sums (tp-split experts with
        biases, ``models.experts.deferred_biases``: back through the same combine), else None.

        Every shape here is fixed by ``T * k``, never by the routing, and the counts stay on the device: with the
        experts on this rank (and grouped GEMMs, ``models.experts``) the layer never waits for the device. An
        assignment the capacity drops is sorted after every expert's (id ``E``), counted for none, and its row
        zeroed going in and coming out (a grouped GEMM leaves rows past its groups unwritten)."""
        top_k, num_experts = self.config.top_k, self.config.num_experts
        dropped = None if keep is None else ~keep.reshape(-1)
        if dropped is not None:
            expert_ids = expert_ids.masked_fill(dropped, num_experts)
        order = torch.argsort(expert_ids, stable=True)  # grouped by expert, in assignment order within each
        tokens_per_expert = self.router.count_tokens(expert_ids)
        routed = tokens[order // top_k]
        dropped_rows = None if dropped is None else dropped[order].unsqueeze(-1)
        if dropped_rows is not None:
            routed = routed.masked_fill(dropped_rows, 0.0)
        local_tokens, local_counts = self.dispatcher.dispatch(routed, tokens_per_expert)
        experts = list(self.experts.values())
        expert_output = run_experts(experts, local_tokens, local_counts)
        biases = deferred_biases(experts, local_tokens, local_counts)
        outputs = [self.dispatcher.combine(expert_output)] if biases is None else \
            self.dispatcher.combine(torch.cat([expert_output, biases], dim=-1)).chunk(2, dim=-1)
        if dropped_rows is not None:
            outputs = [output.masked_fill(dropped_rows, 0.0) for output in outputs]
        outputs = [output.new_zeros(expert_ids.numel(), tokens.shape[1]).index_copy(0, order, output)
                   for output in outputs]
        return outputs[0], (outputs[1] if len(outputs) > 1 else None)

    def _auxiliary_loss(self, routing, expert_ids: Tensor, seq: int) -> Optional[Tensor]:
        """This rank's share (its tokens) of the balance and z-losses in token-sum units; records the statistics."""
        config = self.config
        if not (self.training and torch.is_grad_enabled()):
            return None
        counts = sequence_counts(expert_ids, config.num_experts)
        balance = load_balancing_loss(routing.scores, counts, config.top_k, seq)
        z = z_loss(routing.logits)
        self.aux_losses.record(balance.detach() / seq, z.detach(), counts.sum(dim=0), sequences=expert_ids.shape[0],
                               tokens=routing.logits.shape[:-1].numel())
        losses = [coeff * term for coeff, term in ((config.aux_loss_coeff, balance), (config.z_loss_coeff, z)) if coeff]
        return sum(losses) if losses else None


def moe_tensor_parallel_plan(prefix: str, config: MoEConfig, *, gated_mlp: bool) -> dict[str, object]:
    """An ``MoE`` at ``prefix``: every expert split like a dense MLP inside one region (``tensor_parallel.region``),
    the shared expert a dense MLP with its own communication; the router stays replicated."""
    plan = {
        prefix: "experts_region",
        f"{prefix}.experts.*.fc": InsideRegion(PackedColumn(2) if gated_mlp else "column", experts=True),
        f"{prefix}.experts.*.proj": InsideRegion("row", experts=True),
    }
    if config.shared_expert_size:
        plan.update(dense_mlp_tensor_parallel_plan(f"{prefix}.shared_expert", gated_mlp=gated_mlp))
    return plan


def update_expert_biases(module: nn.Module, rate: float, reduce: Callable[[Tensor], Tensor] = lambda t: t) -> None:
    """After an optimizer step: move every expert bias of ``module``'s routers (``MoEConfig.expert_bias``) by the
    loads of the step's global batch; ``reduce`` sums a tensor over the data-parallel ranks (one collective for
    all the routers). A no-op for a module without such routers."""
    routers = [m for m in module.modules() if isinstance(m, TopKRouter) and m.expert_bias is not None]
    if not routers:
        return
    counts = reduce(torch.stack([router.tokens_per_expert for router in routers]))
    for router, global_counts in zip(routers, counts):
        router.update_expert_bias(global_counts, rate)
