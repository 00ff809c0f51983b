"""What the strategy tells the user about the model: its true size, and one line of model-state memory.

**Parameter counts.** Lightning's ``ModelSummary`` counts ``p.numel()`` of rank 0's parameters: one
tensor-parallel shard (with the vocabulary padding) of one pipeline stage. :class:`GlobalModelSummary`
counts the model that was declared instead: each sharded parameter with its global shape (padding
excluded, ``TensorShard.global_shape``), the modules of every pipeline stage (gathered over the pipeline
group, one small object gather at fit start), and a parameter tied across stages (the last stage's copy
of the embedding, ``tied_names``) once, as Lightning counts a tied parameter of an unsplit model.
:func:`install_global_summary` hands it to the ``ModelSummary`` callbacks of a Trainer (``RichModelSummary``
too); they compute it on every rank in ``on_fit_start`` and print it on rank 0.

**Model state.** :func:`model_state_sizes` counts this rank's bytes of parameters, gradients, fp32 main
parameters and optimizer state; :func:`model_state_line` reduces every rank's with one all-reduce and words
the extremes (min / max over ranks) as one line for rank 0.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary.model_summary import UNKNOWN_SIZE, ModelSummary
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_megatron.optim.main_params import MODEL_STATE_KEYS, model_state_bytes
from lightning_megatron.optim.zero3 import local_tensor
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.shards import shard_of
from lightning_megatron.peft.nf4 import quantized_base_bytes


def layout_line(config: ParallelConfig, schedule: str, micro_batch_size: int, world_size: int) -> str:
    """What rank 0 says once the layout is known."""
    pipeline = (f" vpp={config.virtual_pipeline_size} schedule={schedule} micro_batch_size={micro_batch_size}"
                if config.pipeline_parallel_size > 1 else "")
    experts = f" ep={config.expert_parallel_size}" if config.expert_parallel_size > 1 else ""
    context = f" cp={config.context_parallel_size}" if config.context_parallel_size > 1 else ""
    return (f"Megatron3DStrategy: tp={config.tensor_parallel_size}{context} pp={config.pipeline_parallel_size} "
            f"dp={config.data_parallel_size}{experts} sequence_parallel={config.sequence_parallel}{pipeline} "
            f"on {world_size} processes")


def global_numel(param: torch.Tensor) -> int:
    """Entries of the global parameter this local tensor is part of (vocabulary padding excluded)."""
    shard = shard_of(param)
    return param.numel() if shard is None else math.prod(shard.global_shape)  # a ZeRO-3 DTensor: its dp-global numel


@dataclass
class _Parameter:
    names: set[str]  # every full name it has in the unsplit model (a tied parameter has several)
    numel: int
    trainable: bool


@dataclass
class _Module:
    layer_type: str
    training: bool


def _local_parameters(module: nn.Module) -> dict[str, _Parameter]:
    """This rank's parameters keyed by the name the unsplit model would count them under."""
    names_of: dict[int, list[str]] = {}
    params: dict[int, torch.Tensor] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
        params[id(param)] = param
    local: dict[str, _Parameter] = {}
    for key, names in names_of.items():
        param = params[key]
        tied = getattr(param, "tied_names", None)  # (name, original) relative to the split root
        if tied is not None:
            # The copy of a parameter that lives on another stage: count it under the original's name.
            prefix = next((n[: -len(tied[0])] for n in names if n.endswith(tied[0])), "")
            names.insert(0, prefix + tied[1])
        entry = local.setdefault(names[0], _Parameter(set(), global_numel(param), param.requires_grad))
        entry.names.update(names)
    return local


def _gather_over(group: Optional[dist.ProcessGroup], obj: Any) -> list[Any]:
    if group is None or dist.get_world_size(group) == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def _merge_in_order(lists: Iterable[list[str]]) -> list[str]:
    """One order for names listed by several stages: a stage's new names go before its next known one."""
    merged: list[str] = []
    for names in lists:
        pending: list[str] = []
        for name in names:
            if name not in merged:
                pending.append(name)
                continue
            at = merged.index(name)
            merged[at:at] = pending
            pending = []
        merged.extend(pending)
    return merged


class _Row:
    """One line of the table (what Lightning's ``LayerSummary`` offers it), for a module that may live
    on another pipeline stage."""

    in_size = out_size = UNKNOWN_SIZE

    def __init__(self, layer_type: str, num_parameters: int, training: bool) -> None:
        self.layer_type, self.num_parameters, self.training = layer_type, num_parameters, training

    def detach_hook(self) -> None:
        pass


class GlobalModelSummary(ModelSummary):
    """Lightning's model summary of the whole model (all tp shards at their global shapes, all pipeline
    stages, all experts, tied parameters once). A collective over ``pipeline_group`` and then
    ``expert_group`` (the ranks holding other experts): build it on every rank."""

    def __init__(self, model, max_depth: int = 1, *, pipeline_group: Optional[dist.ProcessGroup] = None,
                 expert_group: Optional[dist.ProcessGroup] = None) -> None:
        self._groups = (pipeline_group, expert_group)
        super().__init__(model, max_depth=max_depth)

    def summarize(self) -> dict[str, _Row]:  # called by ModelSummary.__init__
        modules = {name: _Module(type(m).__name__, m.training) for name, m in self._model.named_modules() if name}
        stages = [(list(modules), modules, _local_parameters(self._model))]
        for group in self._groups:  # every stage's, then every expert-parallel rank's modules
            stages = [stage for gathered in _gather_over(group, stages) for stage in gathered]
        self._modules = {name: info for _, stage_modules, _ in stages for name, info in stage_modules.items()}
        self._parameters: dict[str, _Parameter] = {}
        for _, _, params in stages:
            for key, param in params.items():
                merged = self._parameters.setdefault(key, _Parameter(set(), param.numel, param.trainable))
                merged.names.update(param.names)
        names = _merge_in_order(stage_names for stage_names, _, _ in stages)
        if self._max_depth == 0:
            names = []
        elif self._max_depth >= 1:
            names = [name for name in names if name.count(".") < self._max_depth]
        return OrderedDict((name, _Row(self._modules[name].layer_type, self._numel_under(name),
                                       self._modules[name].training)) for name in names)

    def _numel_under(self, module_name: str) -> int:
        prefix = module_name + "."
        return sum(p.numel for p in self._parameters.values() if any(n.startswith(prefix) for n in p.names))

    @property
    def total_parameters(self) -> int:
        return sum(p.numel for p in self._parameters.values())

    @property
    def trainable_parameters(self) -> int:
        return sum(p.numel for p in self._parameters.values() if p.trainable)

    @property
    def total_training_modes(self) -> dict[str, int]:
        modes = [module.training for module in self._modules.values()]
        return {"train": modes.count(True), "eval": modes.count(False)}

    @property
    def flop_counts(self) -> dict[str, dict[Any, int]]:
        return {name: {} for name in self.layer_names}  # no example forward: a stage cannot run alone


def install_global_summary(callbacks: Iterable[Any], pipeline_group: Optional[dist.ProcessGroup],
                           expert_group: Optional[dist.ProcessGroup] = None) -> None:
    """Make the Trainer's ``ModelSummary`` callbacks summarise the whole model (see the module docstring)."""
    for callback in callbacks:
        if isinstance(callback, ModelSummaryCallback):
            def summary(trainer, pl_module, depth=callback._max_depth):
                return GlobalModelSummary(pl_module, max_depth=depth, pipeline_group=pipeline_group,
                                          expert_group=expert_group)

            callback._summary = summary


def model_state_sizes(module: nn.Module, optimizer, step, zero3) -> dict[str, int]:
    """This rank's bytes of each of ``MODEL_STATE_KEYS`` (``step``: the strategy's ``StepGradients``, ``zero3``:
    its ``ZeRO3``, or ``None``); after a step, so that the optimizer state exists."""
    if zero3 is not None:
        sizes = {"main_parameters": 0, **zero3.model_state_bytes(optimizer)}
    else:
        sizes = model_state_bytes(list(module.parameters()), step.sync if step else None,
                                  step.main_params if step else None, optimizer)
    return {**sizes, "parameters": sizes["parameters"] + quantized_base_bytes(module)}  # QLoRA's 4-bit base too


def frozen_parameter_bytes(module: nn.Module) -> int:
    """Bytes of this rank's parameters that do not train (``requires_grad=False``: a LoRA model's base), part of
    ``model_state_sizes``'s ``"parameters"``; they have no gradients, main copies or optimizer state. A base
    quantised to NF4 (``peft.nf4``, no parameter) counts its 4-bit pieces."""
    frozen = [local_tensor(p) for p in dict.fromkeys(module.parameters()) if not p.requires_grad]  # ZeRO-3: its shard
    return sum(p.numel() * p.element_size() for p in frozen) + quantized_base_bytes(module)


def model_state_line(sizes: dict[str, int], *, device: torch.device, module: Optional[nn.Module] = None) -> str:
    """One line for rank 0: each component's (and the total's) min and max over all ranks, in MiB; with ``module``,
    the frozen parameters' share too, where it has any.

    A collective over the world (one all-reduce of ``2 * (len(sizes) + 2)`` integers): call it on every rank.
    """
    frozen = 0 if module is None else frozen_parameter_bytes(module)
    values = [sizes[key] for key in MODEL_STATE_KEYS] + [sum(sizes.values()), frozen]
    extremes = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=device)
    world = 1
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        world = dist.get_world_size()
    n = len(values)
    lows, highs = (-extremes[n:]).tolist(), extremes[:n].tolist()
    return format_model_state(lows[:-1], highs[:-1], world=world, frozen=(lows[-1], highs[-1]))


def report_model_state(module: nn.Module, optimizer, step, zero3, *, device: torch.device) -> dict[str, int]:
    """This rank's :func:`model_state_sizes` (what the strategy keeps as ``model_state_bytes``), and on rank 0 the
    :func:`model_state_line` of every rank's (a collective: call it on every rank, after a step)."""
    sizes = model_state_sizes(module, getattr(optimizer, "_optimizer", optimizer), step, zero3)  # Lightning's wrapper
    rank_zero_info(model_state_line(sizes, device=device, module=module))
    return sizes


def _mib(low: int, high: int) -> str:
    low_text, high_text = f"{low / 2**20:.2f}", f"{high / 2**20:.2f}"
    return f"{high_text} MiB" if low_text == high_text else f"{low_text} / {high_text} MiB"


def format_model_state(lows: list[int], highs: list[int], *, world: int, frozen: tuple[int, int] = (0, 0)) -> str:
    """``lows`` / ``highs``: bytes of each of ``MODEL_STATE_KEYS`` and of their total, min and max over ranks;
    ``frozen``: the frozen parameters' min and max (said when there are any)."""
    parts = [f"{key.replace('_', ' ')} {_mib(low, high)}" for key, low, high in zip(MODEL_STATE_KEYS, lows, highs)]
    total = _mib(lows[-1], highs[-1])
    spread = "min / max " if any(" / " in part for part in [*parts, total]) else ""
    line = f"model state per rank ({spread}over {world} ranks): {', '.join(parts)} (total {total})"
    if frozen[1] == 0:
        return line
    return (f"{line}; of the parameters, {_mib(*frozen)} are frozen (no gradients, fp32 main copies or optimizer "
            f"state)")
