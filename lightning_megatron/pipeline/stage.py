"""Cut a model down to this rank's pipeline stages, keeping global parameter names.

The root model keeps only the layers of this rank's stages (``blocks.7`` stays ``blocks.7``)
and drops the embedding unless it runs the first stage and the head unless it runs the
last. A ``StageModule`` is a thin forward-only view over one stage's submodules: it is
what ``torch.distributed.pipelining`` drives, while the root stays what Lightning, the
optimizer and checkpoints see.

Tied parameters split across stages (GPT's input embedding on the first stage, output
head on the last) become two copies that start equal (the copy is initialised under the
original's name) and stay equal (their gradients are summed over the embedding group).
When both stages run on one rank (the V placement of ZB-V and DualPipeV) the parameter stays
one tensor used by two stages: each stage's backward accumulates into it, so it is tagged
``pipeline_stage_uses = 2`` for the gradient buckets that count arrivals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Container, Sequence

import torch
from torch import nn

from lightning_megatron.pipeline.blocks import PipelineBlocks


def _set_submodule(root: nn.Module, name: str, value) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, value)


class StageModule(nn.Module):
    """One pipeline stage: ``root.embed`` (if first), some layers, ``root.head`` or ``root.loss_head`` (if last).

    Only the stage's own layers are registered as submodules; the root, which holds the
    embedding and head and implements the protocol, is referenced, not registered.
    """

    def __init__(self, root: nn.Module, layers: Sequence[nn.Module], *, is_first: bool, is_last: bool,
                 root_modules: Sequence[nn.Module] = ()) -> None:
        super().__init__()
        object.__setattr__(self, "root", root)
        object.__setattr__(self, "root_modules", tuple(root_modules))  # the root's first/last-stage modules it runs
        self.layers = nn.ModuleList(layers)
        self.is_first, self.is_last = is_first, is_last

    def stage_parameters(self) -> list[nn.Parameter]:
        """Every parameter this stage's forward uses: its layers' and those of the root's embedding (first stage)
        or head (last stage), which the root owns. A split backward (zero-bubble schedules) computes the weight
        gradients of exactly these; ``parameters()`` would miss the root's."""
        params = [p for module in (self.layers, *self.root_modules) for p in module.parameters()]
        return list(dict.fromkeys(params))

    def forward(self, *inputs, **side):
        """What the schedule runs: the last stage returns what ``root.pipeline_loss`` takes (``root.loss_head``
        where the root has one, e.g. a loss that applies the head itself, else ``root.head``)."""
        return self.run(inputs, side, getattr(self.root, "loss_head", self.root.head))

    def logits(self, *inputs, **side):
        """What generation and prediction run: the last stage returns ``root.head``'s output (the logits)."""
        return self.run(inputs, side, self.root.head)

    def run(self, inputs: tuple, side: dict, head):
        x = self.root.embed(*inputs, **side) if self.is_first else inputs[0]
        if not self.is_first and x.requires_grad:
            # This gradient is sent to the previous stage, and torch's pipelining sizes the receiving buffer from
            # its layout; P2P needs it contiguous, but the first layer's backward may leave any strides (RMSNorm's
            # elementwise backward of a sequence-parallel all-gather's transposed gradient does).
            x.register_hook(torch.Tensor.contiguous)
        layer_kwargs = self.root.layer_kwargs(**side)
        for layer in self.layers:
            x = layer(x, **layer_kwargs)
        return head(x, **side) if self.is_last else x


@dataclass(frozen=True)
class StageContents:
    """What a rank keeps of the root model for its pipeline stages: the keys of its layers in the
    ``blocks.layers`` dict, and the first/last-stage submodules it drops. The planner asks it which
    parameters a rank holds without building the rank."""

    layers: str  # the ModuleDict's name, relative to the root
    layer_keys: frozenset[str]
    dropped: tuple[str, ...]

    def keeps(self, name: str) -> bool:
        """Whether the parameter (or submodule) ``name``, relative to the root, stays on this rank."""
        prefix = self.layers + "."
        if name.startswith(prefix):
            return name[len(prefix):].split(".", 1)[0] in self.layer_keys
        return not any(name == drop or name.startswith(drop + ".") for drop in self.dropped)


def stage_contents(blocks: PipelineBlocks, stage_layers: list[list[int]], local_stages: list[int]) -> StageContents:
    num_stages = len(stage_layers)
    dropped = (() if 0 in local_stages else tuple(blocks.first)) + \
        (() if num_stages - 1 in local_stages else tuple(blocks.last))
    keys = frozenset(str(i) for stage in local_stages for i in stage_layers[stage])
    return StageContents(blocks.layers, keys, dropped)


def split_across_stages(names: Sequence[str], present: Container[str]) -> bool:
    """A parameter registered under several ``names`` (a tied embedding) some of which another rank holds: its
    gradient is summed with that rank's copy (``pipeline_tied``)."""
    return len(names) > 1 and any(name not in present for name in names)


def split_for_pipeline(
    root: nn.Module, blocks: PipelineBlocks, stage_layers: list[list[int]], local_stages: list[int]
) -> list[StageModule]:
    """Remove from ``root`` what this rank's ``local_stages`` do not run; return their ``StageModule``s."""
    num_stages = len(stage_layers)
    contents = stage_contents(blocks, stage_layers, local_stages)
    names_of: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)

    layers = root.get_submodule(blocks.layers)
    if not isinstance(layers, nn.ModuleDict):
        raise TypeError(
            f"{blocks.layers} must be an nn.ModuleDict keyed by layer index so that a stage keeps global names; "
            f"got {type(layers).__name__}."
        )
    for key in list(layers.keys()):
        if key not in contents.layer_keys:
            del layers[key]
    for name in contents.dropped:
        _set_submodule(root, name, None)

    present = {name for name, _ in root.named_parameters(remove_duplicate=False)}
    for name, param in root.named_parameters():
        original = names_of[id(param)]
        if split_across_stages(original, present):
            param.pipeline_tied = True  # its partner lives on another stage: sum their gradients
            if name != original[0]:
                param.tied_names = (name, original[0])  # initialise as the original; count it once in norms

    def root_modules(names: Sequence[str]) -> list[nn.Module]:
        found = []
        for name in names:
            module = root
            for part in name.split("."):
                module = getattr(module, part, None)
            if isinstance(module, nn.Module):  # a model may leave an optional block out (None)
                found.append(module)
        return found

    stages = [
        StageModule(root, [layers[str(i)] for i in stage_layers[stage]], is_first=stage == 0,
                    is_last=stage == num_stages - 1,
                    root_modules=(root_modules(blocks.first) if stage == 0 else [])
                    + (root_modules(blocks.last) if stage == num_stages - 1 else []))
        for stage in local_stages
    ]
    uses: dict[int, int] = {}
    for stage in stages:
        for param in stage.stage_parameters():
            uses[id(param)] = uses.get(id(param), 0) + 1
    for param in root.parameters():
        if uses.get(id(param), 1) > 1:
            param.pipeline_stage_uses = uses[id(param)]
    return stages
