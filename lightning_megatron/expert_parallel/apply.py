"""Turn a model's MoE layers into this rank's part of an expert-parallel layout (``preparation.py`` calls these).

:func:`apply_expert_parallel` runs after the tensor-parallel plan and before the pipeline split,
while every parameter is still on the meta device: each MoE layer keeps experts
``[r * E / ep, (r + 1) * E / ep)`` of expert-parallel rank ``r`` (their names, hence their initial
values and checkpoint keys, keep the global expert index) and dispatches with an all-to-all.
Their parameters are tagged ``expert_parallel``: they are summed over the expert-data-parallel
group (the ranks with the same experts), not over all of dp, and counted once per expert in the
global gradient norm (``whole_expert`` too when each tp rank holds other experts whole: counted on every tp rank,
where an expert split over tp has its unsplit row bias counted on tp rank 0 alone). With ``expert_tensor_parallel_size=1`` the experts stay whole (the tensor-parallel
plan leaves them alone), the tp ranks of a pipeline stage join the dp ranks as expert-parallel ranks
(``ParallelConfig.expert_slot``), and each tp rank dispatches its share of the layer's assignments
(``dispatcher.TensorParallelShareDispatcher``).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor, nn

from lightning_megatron.expert_parallel.dispatcher import AllToAllDispatcher, TensorParallelShareDispatcher
from lightning_megatron.models.moe import AuxLosses, MoE
from lightning_megatron.parallel.state import ParallelState


def moe_layers(module: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in module.named_modules() if isinstance(m, MoE)]


def apply_expert_parallel(module: nn.Module, state: ParallelState) -> None:
    ep = state.config.expert_parallel_size
    layers = moe_layers(module)
    if ep == 1:
        return
    if not layers:
        raise ValueError(f"expert_parallel_size={ep} splits the experts of Mixture-of-Experts layers, but "
                         f"{type(module).__name__} has none. Give the model a MoE config (GPTConfig(moe=...)) or "
                         f"use expert_parallel_size=1.")
    rank = state.expert_parallel_rank
    for name, layer in layers:
        num_experts = len(layer.experts)
        if num_experts % ep:
            raise ValueError(f"{name} has {num_experts} experts, which do not split over expert_parallel_size={ep}. "
                             f"Use an expert_parallel_size dividing {num_experts}.")
        local = num_experts // ep
        keep = {str(e) for e in range(rank * local, (rank + 1) * local)}
        for key in list(layer.experts.keys()):
            if key not in keep:
                del layer.experts[key]
        whole = state.config.whole_experts
        for param in layer.experts.parameters():
            param.expert_parallel = True
            if whole:  # the layer's sequence-parallel tag does not apply: each tp rank's gradient is its experts' own
                param.__dict__.pop("sequence_parallel_grad", None)
                param.whole_expert = True  # not a replica of another tp rank's (optim.clip counts it on each)
        layer.dispatcher = AllToAllDispatcher(state.expert_parallel_group, local)
        if whole:
            layer.dispatcher = TensorParallelShareDispatcher(layer.dispatcher, state.tensor_parallel_rank,
                                                             state.config.tensor_parallel_size)
    # Generation stops early only when every rank of the group is done (``generation.generate``); every rank's
    # model root gets the group, also on a pipeline stage without MoE layers (it follows the others' tokens).
    for m in module.modules():
        if isinstance(getattr(m, "moe_aux_losses", None), AuxLosses):
            m.expert_parallel_group = state.expert_parallel_group


def wire_auxiliary_losses(module: nn.Module, state: ParallelState) -> None:
    """The MoE layers' statistics are summed over the model-parallel ranks (other pipeline stages' layers, other
    sequence chunks); a tp group that routes the same tokens counts each layer once."""
    tp = state.config.tensor_parallel_size
    group = state.model_parallel_group
    for aux in auxiliary_losses(module):
        aux.value_share = 1.0 if state.config.sequence_parallel else 1.0 / tp
        aux.forward_share = 1.0 / tp
        if group is not None:
            aux.reduce = _summed_over(group, state.device)


def prepare_experts(module: nn.Module, state: ParallelState) -> None:
    """This rank's experts and their dispatch (``expert_parallel_size > 1``); the MoE statistics' reduction."""
    apply_expert_parallel(module, state)
    wire_auxiliary_losses(module, state)


def auxiliary_losses(module: nn.Module) -> list[AuxLosses]:
    """Every ``AuxLosses`` of the model: its layers' and its own (``GPTModel.moe_aux_losses``, which a pipeline
    stage without MoE layers still holds, so that every rank takes part in the statistics' reduction)."""
    found: dict[int, AuxLosses] = {}
    for m in module.modules():
        for attribute in ("aux_losses", "moe_aux_losses"):
            value = getattr(m, attribute, None)
            if isinstance(value, AuxLosses):
                found[id(value)] = value
    return list(found.values())


def _summed_over(group: dist.ProcessGroup, device):
    def reduce(totals: Tensor) -> Tensor:
        totals = totals.to(device)
        dist.all_reduce(totals, group=group)
        return totals
    return reduce
