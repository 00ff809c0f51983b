"""The tensor-parallel plan of LoRA adapters, read off the plan of the layers they adapt.

An adapted layer computes ``W x + scale * B (A x)`` (``peft.lora``). When the plan splits ``W``, the adapter must
be split so that ``B (A x)`` lands on each rank exactly where that rank's part of ``W x`` is, with no
communication beyond what a column- or row-parallel layer already does:

================================  ===============================================  ===============================
base layer's style                ``lora_a`` (``[r, in]``)                         ``lora_b`` (``[out, r]``)
================================  ===============================================  ===============================
column (``"column"``,             replicated: every rank needs all ``r`` of          split by output exactly as the
``PackedColumn``,                 ``A x``; ``"sequence_parallel"``: under SP it      base (the same style object, so
``QueryGroupColumn``)             runs on the sequence chunk, and its gradient is    the same rank ranges, replicated
                                  summed over tp                                     key/value rows included); a
                                                                                     column layer, which under SP
                                                                                     all-gathers its ``r``-wide input
a fused layer's projections       each projection's ``A``: as above                  each projection's ``B`` by the
(``"canonical"`` adapters)                                                           projection's own style
                                                                                     (``part_styles()``: ``q``, ``gate``,
                                                                                     ``up`` ``"column"``, ``k``/``v``
                                                                                     ``KeyValueHeads``): the rows of
                                                                                     the fused output the rank holds
``"row"``                         split by input (``"row"``): a row-parallel         replicated, ``"sequence_parallel"``
                                  layer whose ``r``-wide partial output is           (under SP it runs on the
                                  all-reduced (reduce-scattered under SP)            sequence chunk)
================================  ===============================================  ===============================

The extra traffic is ``r`` wide, next to the base layer's ``in`` or ``out``. The adapter's dropout (``lora_dropout``)
draws from the stream its input needs: a row-parallel layer's input is split over tp (``"sharded_dropout"``: the
per-rank stream); a column-parallel layer's is a sequence chunk under SP (``"sequence_parallel"``: per-rank) and
replicated without it (the default stream, which every rank draws alike). A column-parallel layer inside a module
that runs on the per-rank stream (attention's ``qkv`` in ``"sharded_dropout"`` attention) would draw its replicated
mask from the per-rank stream, so that case is refused at tp > 1 without SP.

Layers whose input and output are whole on every rank (``"column_gather_output"``, ``"row_split_input"``: every rank
computes what follows or precedes them alike) keep whole adapters, replicated, whose gradients are then the same on
every rank. Layers the plan does not split stay replicated, and so do their adapters (exactly as their base weights: the plan's
``"sequence_parallel"`` on an enclosing module sums their gradients alike). A base the plan splits another way (the
vocabulary head, an expert inside an MoE region) is refused: narrow the LoRA targets.
"""

from __future__ import annotations

from typing import Mapping

from torch import nn

from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.names import name_matches
from lightning_megatron.peft.adapters import adapted_layers
from lightning_megatron.tensor_parallel.plan import SWAP_STYLES
from lightning_megatron.tensor_parallel.region import InsideRegion
from lightning_megatron.tensor_parallel.styles import LAYOUT_STYLES


def _is_column(style: object) -> bool:
    return style == "column" or isinstance(style, LAYOUT_STYLES)


def _styles_of(plan: Mapping[str, object], name: str) -> list[object]:
    return [style for pattern, style in plan.items() if name_matches(pattern, name)]


def _enclosing_styles(plan: Mapping[str, object], name: str) -> list[object]:
    parts = name.split(".")
    return [style for end in range(1, len(parts)) for style in _styles_of(plan, ".".join(parts[:end]))]


def adapter_plan(module: nn.Module, plan: Mapping[str, object], config: ParallelConfig) -> dict[str, object]:
    """``plan`` with entries for every LoRA adapter of ``module`` (the same plan unchanged when it has none).

    ``module`` carries its adapters already (``peft.lora.apply_lora``, before ``parallelize``); ``plan`` is its
    ``tensor_parallel_plan()`` with names relative to it; ``config``: the layout (for what it refuses). Raises a
    ``ValueError`` naming the layer for a base layer no adapter split follows.

    Example::

        parallelize(model, adapter_plan(model, model.tensor_parallel_plan(), state.config), state)
    """
    extended = dict(plan)
    for name in adapted_layers(module):
        # The layer's own swap style (parallelize refuses more than one); region styles say nothing of its split.
        styles = [style for style in _styles_of(plan, name) if not isinstance(style, str) or style in SWAP_STYLES]
        if not styles:
            continue  # not split: the adapter stays replicated with its base
        style = styles[0]
        if isinstance(style, InsideRegion) or style == "vocab":
            raise ValueError(
                f"LoRA cannot adapt {name}: the tensor-parallel plan splits it as {style!r}, and adapters follow "
                f"only column- and row-parallel layers ('column', 'row', PackedColumn, QueryGroupColumn). Narrow the "
                f"LoRA targets so that they leave out {name} (e.g. targets=['*.attn.qkv', '*.mlp.fc']).")
        layer = module.get_submodule(name)
        dropout = getattr(layer, "lora_dropout", None) is not None
        if style in ("column_gather_output", "row_split_input"):
            continue  # the layer's input and output are whole on every rank: its adapter stays replicated alike
        if not _is_column(style):
            extended.update({f"{name}.lora_a": "row", f"{name}.lora_b": "sequence_parallel"})
            if dropout:
                extended[f"{name}.lora_dropout"] = "sharded_dropout"
            continue
        if isinstance(layer.lora_b, nn.ModuleDict):  # an adapter per projection of a fused layer
            if style != layer.lora_layout:
                raise ValueError(f"LoRA adapted the projections of {name} as laid out by {layer.lora_layout!r}, but "
                                 f"the tensor-parallel plan splits it as {style!r}; the adapters need the layout "
                                 f"they were attached by (apply LoRA to the model whose plan this is).")
            part_styles = dict(zip(layer.lora_parts, style.part_styles()))
            for part in layer.lora_b:
                extended.update({f"{name}.lora_a.{part}": "sequence_parallel",
                                 f"{name}.lora_b.{part}": part_styles[part]})
        else:
            extended.update({f"{name}.lora_a": "sequence_parallel", f"{name}.lora_b": style})
        if dropout:
            _check_replicated_dropout(name, _enclosing_styles(plan, name), config)
            extended[f"{name}.lora_dropout"] = "sequence_parallel"
    return extended


def tensor_parallel_plan_of(module: nn.Module, config: ParallelConfig) -> dict[str, object]:
    """What ``parallelize`` applies to ``module``: its ``tensor_parallel_plan()`` (none: empty) and its adapters'."""
    plan = module.tensor_parallel_plan() if hasattr(module, "tensor_parallel_plan") else {}
    return adapter_plan(module, plan, config)


def _check_replicated_dropout(name: str, enclosing: list[object], config: ParallelConfig) -> None:
    """A column-parallel layer's input is replicated over tp without SP, so its adapter's dropout mask must be the
    same on every rank; inside a ``"sharded_dropout"`` module it would come from the per-rank stream."""
    if config.tensor_parallel_size > 1 and not config.sequence_parallel and "sharded_dropout" in enclosing:
        raise ValueError(
            f"LoRA dropout on {name} at tensor_parallel_size={config.tensor_parallel_size} without sequence "
            f"parallelism: {name} is column-parallel, so its input is replicated over the tensor-parallel ranks and "
            f"its dropout mask must be the same on all of them, but it runs inside a module whose dropout draws from "
            f"the per-rank stream. Set sequence_parallel=True, LoRA dropout=0, or leave {name} out of the targets.")
