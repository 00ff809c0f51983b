"""Cut a model down to this rank's pipeline stages, keeping global parameter names.

The root model keeps only the layers of this rank's stages (``blocks.7`` stays ``blocks.7``)
and drops the embedding unless it runs the first stage and the head unless it runs the
last. A ``StageModule`` is a thin forward-only view over one stage's submodules: it is
what ``torch.distributed.pipelining`` drives, while the root stays what Lightning, the
optimizer and checkpoints see.

Tied parameters split across stages (GPT's input embedding on the first stage, output
head on the last) become two copies that start equal (the copy is initialised under the
original's name) and stay equal (their gradients are summed over the embedding group).
"""

from __future__ import annotations

from itertools import chain
from typing import Sequence

from torch import nn

from lightning_megatron.pipeline.blocks import PipelineBlocks


def _set_submodule(root: nn.Module, name: str, value) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, value)


class StageModule(nn.Module):
    """One pipeline stage: the first modules (if first), some layers, the last modules (if last)."""

    def __init__(self, firsts: Sequence[nn.Module], layers: Sequence[nn.Module], lasts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.firsts, self.layers, self.lasts = nn.ModuleList(firsts), nn.ModuleList(layers), nn.ModuleList(lasts)

    def forward(self, *inputs):
        x = inputs[0] if len(inputs) == 1 else inputs
        for module in chain(self.firsts, self.layers, self.lasts):
            x = module(*x) if isinstance(x, tuple) else module(x)
        return x


def split_for_pipeline(
    root: nn.Module, blocks: PipelineBlocks, stage_layers: list[list[int]], local_stages: list[int]
) -> list[StageModule]:
    """Remove from ``root`` what this rank's ``local_stages`` do not run; return their ``StageModule``s."""
    num_stages = len(stage_layers)
    has_first, has_last = 0 in local_stages, num_stages - 1 in local_stages
    names_of: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)

    layers = root.get_submodule(blocks.layers)
    if not isinstance(layers, nn.ModuleDict):
        raise TypeError(
            f"{blocks.layers} must be an nn.ModuleDict keyed by layer index so that a stage keeps global names; "
            f"got {type(layers).__name__}."
        )
    local_layers = {str(i) for stage in local_stages for i in stage_layers[stage]}
    for key in list(layers.keys()):
        if key not in local_layers:
            del layers[key]
    if not has_first:
        for name in blocks.first:
            _set_submodule(root, name, None)
    if not has_last:
        for name in (*blocks.last, blocks.loss):
            _set_submodule(root, name, None)

    present = {name for name, _ in root.named_parameters(remove_duplicate=False)}
    for name, param in root.named_parameters():
        original = names_of[id(param)]
        if len(original) > 1 and any(other not in present for other in original):
            param.pipeline_tied = True  # its partner lives on another stage: sum their gradients
            if name != original[0]:
                param.tied_names = (name, original[0])  # initialise as the original; count it once in norms

    def modules(names: Sequence[str]) -> list[nn.Module]:
        return [root.get_submodule(n) for n in names]

    return [
        StageModule(
            modules(blocks.first) if stage == 0 else [],
            [layers[str(i)] for i in stage_layers[stage]],
            modules(blocks.last) if stage == num_stages - 1 else [],
        )
        for stage in local_stages
    ]
