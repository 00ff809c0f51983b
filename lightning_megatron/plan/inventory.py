"""Which parameters a rank holds, found by building its shards exactly as the strategy does.

The model is built on the meta device (``configure_model``, LoRA adapters included), then ``parallelize``
applies its ``tensor_parallel_plan()`` and its adapters' (``peft.plan.tensor_parallel_plan_of``) with the
strategy's vocabulary padding and ``prepare_experts`` keeps one expert-parallel rank's experts, over torch's
fake process group (real groups, no communication, no memory). That is done once per (tp, ep); which of
those parameters each pipeline rank keeps is then asked of the pipeline split itself
(``pipeline.stage.stage_contents``), so a search over hundreds of pipeline layouts builds each
tensor-parallel model once. Tensor-parallel ranks hold equal shapes (the
model's checks make every split even), so tp rank 0 stands for all. A QLoRA base (``LoRAConfig.quantize_base``)
is entered with the bytes of its rank's NF4 pieces (``peft.nf4.nf4_base_bytes``), which is what it holds.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.state import ParallelState
from lightning_megatron.pipeline.blocks import PipelineBlocks
from lightning_megatron.pipeline.layout import PipelineLayout
from lightning_megatron.pipeline.stage import split_across_stages, stage_contents
from lightning_megatron.expert_parallel.apply import prepare_experts
from lightning_megatron.peft.nf4 import marked_layers, nf4_base_bytes
from lightning_megatron.peft.plan import tensor_parallel_plan_of
from lightning_megatron.tensor_parallel.plan import parallelize


@dataclass(frozen=True)
class ParameterEntry:
    """One parameter of a tensor-parallel rank's model: its names (several when tied), local shape, tags."""

    names: tuple[str, ...]  # as registered on the LightningModule, first one first
    shape: tuple[int, ...]
    expert: bool  # an expert of an MoE layer (reduced over the expert-data-parallel group)
    requires_grad: bool
    stored_bytes: Optional[int] = None  # a QLoRA base: its NF4 pieces' bytes (``peft.nf4``), no parameter then

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


@dataclass(frozen=True)
class RankParameter:
    entry: ParameterEntry
    pipeline_tied: bool  # its tied partner lives on another pipeline rank (a bucket of its own)


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """torch's fake process group for one rank of ``world_size``: groups report real sizes and ranks, and no
    collective moves data (the planner's inventories, and ``lightning-megatron simulate``'s ranks). Needs a process
    without a default group (the planner runs before the strategy starts its processes)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("The layout planner (and lightning-megatron simulate) builds each rank's shards over "
                           "torch's fake process group, which needs a process without a default process group; call "
                           "it before torch.distributed is initialised (Megatron3DStrategy does, in "
                           "setup_environment) or in a separate process.")
    excepthook = sys.excepthook  # init_process_group wraps it to prefix "[rank0]:"; a planner is one process
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook


class Inventory:
    """The parameters of tp rank 0 (and ep rank 0) of a LightningModule, in ``module.parameters()`` order."""

    def __init__(self, traversal: list[tuple[str, ParameterEntry]], blocks: Optional[PipelineBlocks],
                 num_layers: int) -> None:
        """``traversal``: every (name, entry) in ``named_parameters(remove_duplicate=False)`` order. A tied
        parameter whose first name a pipeline rank drops comes, on that rank, where the first name it keeps is."""
        self.traversal, self.blocks, self.num_layers = traversal, blocks, num_layers
        self.entries = list(dict.fromkeys(entry for _, entry in traversal))

    @classmethod
    def build(cls, make_module: Callable[[], nn.Module], *, tensor_parallel_size: int, expert_parallel_size: int = 1,
              pad_vocab_to_multiple_of: int = 128, expert_tensor_parallel_size: Optional[int] = None) -> "Inventory":
        """``make_module()`` returns a new LightningModule (``configure_model`` not yet called);
        ``expert_tensor_parallel_size=1``: whole experts on each tp rank (tp rank 0's are entered)."""
        config = ParallelConfig(tensor_parallel_size=tensor_parallel_size, data_parallel_size=expert_parallel_size,
                                expert_parallel_size=expert_parallel_size,
                                expert_tensor_parallel_size=expert_tensor_parallel_size)
        with fake_world(config.world_size):
            state = ParallelState.create(config, "cpu")
            with torch.device("meta"):
                module = make_module()
                if getattr(module, "pretrained", None) is not None:
                    module.pretrained = None  # shapes only: a pretrained base's weights are never read to plan
                if hasattr(module, "configure_model"):
                    module.configure_model()
            parallelize(module, tensor_parallel_plan_of(module, config), state, pad_vocab_to_multiple_of=pad_vocab_to_multiple_of)
            prepare_experts(module, state)
        named = list(module.named_parameters(remove_duplicate=False))
        names_of: dict[int, list[str]] = {}
        for name, param in named:
            names_of.setdefault(id(param), []).append(name)
        quantized = {id(module.get_submodule(name).weight): nf4_base_bytes(name, module.get_submodule(name).weight,
                                                                            settings)
                     for name, settings in marked_layers(module).items()}
        entry_of = {key: ParameterEntry(tuple(names), tuple(param.shape), bool(getattr(param, "expert_parallel", False)),
                                        param.requires_grad, quantized.get(key))
                    for key, names, param in ((id(p), names_of[id(p)], p) for _, p in named)}
        blocks = module.pipeline_blocks() if hasattr(module, "pipeline_blocks") else None
        num_layers = len(blocks.root_of(module).get_submodule(blocks.layers)) if blocks is not None else 0
        return cls([(name, entry_of[id(param)]) for name, param in named], blocks, num_layers)

    def rank_parameters(self, *, pipeline_parallel_size: int = 1, virtual_pipeline_size: int = 1,
                        pipeline_layers_per_stage: Optional[tuple[int, ...]] = None,
                        pipeline_rank: int = 0) -> list[RankParameter]:
        """What ``module.parameters()`` yields on that pipeline rank after the strategy's pipeline split."""
        if pipeline_parallel_size == 1:
            return [RankParameter(entry, False) for entry in self.entries]
        if self.blocks is None:
            raise ValueError("pipeline_parallel_size > 1 needs the model to define pipeline_blocks().")
        layout = PipelineLayout(num_layers=self.num_layers, pipeline_parallel_size=pipeline_parallel_size,
                                virtual_pipeline_size=virtual_pipeline_size, layers_per_stage=pipeline_layers_per_stage)
        contents = stage_contents(self.blocks, layout.stage_layers(), layout.stages_of_rank(pipeline_rank))
        prefix = self.blocks.root + "." if self.blocks.root else ""

        def kept(name: str) -> bool:  # the split only prunes the root; names outside it stay
            return not name.startswith(prefix) or contents.keeps(name[len(prefix):])

        present = {name for entry in self.entries for name in entry.names if kept(name)}
        ordered = dict.fromkeys(entry for name, entry in self.traversal if name in present)
        return [RankParameter(entry, split_across_stages(entry.names, present)) for entry in ordered]

    @cached_property
    def total_parameters(self) -> int:
        return sum(entry.numel for entry in self.entries)


def optimizer_state_bytes_per_element(module: Any) -> tuple[int, str]:
    """Bytes of optimizer state per fp32 element the optimizer steps on, and the optimizer's name: the module's own
    ``configure_optimizers()`` optimizer, stepped once on a small fp32 parameter (AdamW: two fp32 moments, 8),
    or AdamW when ``configure_optimizers`` needs a Trainer it does not have."""
    optimizer_class, defaults = torch.optim.AdamW, {}
    try:
        configured = module.configure_optimizers()
    except Exception:  # noqa: BLE001 (it may read self.trainer; the planner has none)
        configured = None
    if isinstance(configured, dict):
        configured = configured.get("optimizer")
    if isinstance(configured, (list, tuple)) and configured:
        configured = configured[0]
    if isinstance(configured, torch.optim.Optimizer):
        optimizer_class, defaults = type(configured), dict(configured.defaults)
    accepted = inspect.signature(optimizer_class.__init__).parameters
    probe = nn.Parameter(torch.zeros(4))
    optimizer = optimizer_class([probe], **{k: v for k, v in defaults.items() if k in accepted})
    probe.grad = torch.ones(4)
    optimizer.step()
    state = [v for v in optimizer.state[probe].values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return sum(v.element_size() * v.numel() for v in state) // probe.numel(), optimizer_class.__name__
