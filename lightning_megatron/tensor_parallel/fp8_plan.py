"""Which layers run their GEMMs in FP8: every column- and row-parallel linear of the plan (attention's qkv and
output, the MLP's, the experts'), except the output head and the modules named by ``exclude``.

What stays in high precision, and why (Megatron-Core's and torchtitan's choices):

* the output head (``VocabParallelHead``, also the chunked loss's): the logits' softmax is sensitive to the
  error, and its GEMM is the one with the vocabulary as a dimension, rarely a multiple of 16 per rank;
* anything that is not a plan linear: embeddings, norms, attention's softmax, the MoE router (its own
  ``F.linear`` in fp32), the loss;
* LoRA adapters (by name: ``parallel.names.is_adapter_name``): a few ``r``-wide GEMMs, whose fp32 training is the
  point of keeping them apart from the frozen base (the base layers they adapt may still run in FP8);
* what ``exclude`` names, by ``fnmatch`` pattern on the module's name (``*`` matches across dots), e.g.
  ``("blocks.0.*", "blocks.31.*")`` for Megatron-Core's ``first_last_layers_bf16``.

Applied after ``parallelize`` (the layers exist, their weights still on meta) and before the pipeline split, so
every rank checks every layer and refuses alike.
"""

from __future__ import annotations

import fnmatch
from typing import Optional, Sequence

from torch import nn

from lightning_megatron.parallel.names import is_adapter_name
from lightning_megatron.parallel.shards import shard_of
from lightning_megatron.parallel.state import ParallelState
from lightning_megatron.tensor_parallel.fp8 import Fp8Gemms, Fp8Recipe, check_fp8_shape, require_torchao
from lightning_megatron.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelHead
from lightning_megatron.tensor_parallel.overlap import FP8_OVERLAP_REFUSAL


def check_fp8_options(fp8: Optional[str], exclude: Sequence[str], tp_comm_overlap: bool) -> Optional[Fp8Recipe]:
    """The recipe named by ``fp8`` (``None``: off), refusing what does not compose; before any process starts."""
    if isinstance(exclude, str):  # (a string is a sequence of one-letter patterns)
        raise ValueError(f"fp8_exclude takes a list of module-name patterns, got the string {exclude!r}: write "
                         f"fp8_exclude=[{exclude!r}].")
    if fp8 is None:
        if exclude:
            raise ValueError(f"fp8_exclude={list(exclude)} names layers to keep out of FP8, but fp8=None: set fp8 to "
                             f"'tensorwise' or 'rowwise', or drop fp8_exclude.")
        return None
    recipe = Fp8Recipe.named(fp8)
    if tp_comm_overlap:
        raise ValueError(FP8_OVERLAP_REFUSAL)
    require_torchao()  # installed? (told now, not after the launch)
    return recipe


def convert_to_fp8(module: nn.Module, recipe: Optional[Fp8Recipe], state: ParallelState,
                   exclude: Sequence[str] = ()) -> list[str]:
    """Give each column/row-parallel linear of ``module`` (but the head and ``exclude``) FP8 GEMMs whose scales are
    reduced over the groups that split its tensors; returns the converted layers' names. Each layer keeps its
    weight's FP8 cast from one optimizer step to the next, but under ZeRO-3 (``fp8_weights``: there it would hold
    an FP8 copy of every layer that ZeRO-3 frees after each use)."""
    if recipe is None:
        return []
    require_torchao()  # now, not first inside a compiled layer
    unused = set(exclude)
    converted = []
    size = state.config.tensor_parallel_size
    for name, layer in module.named_modules():
        if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)) or is_adapter_name(name):
            continue
        matched = {pattern for pattern in exclude if fnmatch.fnmatchcase(name, pattern)}
        unused -= matched  # a pattern naming the head is not unused: the head stays in high precision anyway
        if matched or isinstance(layer, VocabParallelHead):
            continue
        local_out, local_in = layer.weight.shape
        check_fp8_shape(name, local_in, local_out, size)
        _check_not_replicated(name, layer, size)
        cuts = "output" if isinstance(layer, ColumnParallelLinear) else "input"
        layer.gemms = Fp8Gemms(recipe, layer.group, cuts, token_group=state.context_parallel_group,
                               cache_weights=state.config.zero_stage < 3)
        converted.append(name)
    if unused:
        raise ValueError(f"fp8_exclude patterns {sorted(unused)} match no column- or row-parallel linear of "
                         f"{type(module).__name__}; names look like {converted[:3]} (fnmatch patterns, '*' matches "
                         f"across dots).")
    if not converted:
        raise ValueError(f"fp8={recipe.name!r} found no column- or row-parallel linear to run in FP8 in "
                         f"{type(module).__name__} (fp8_exclude={list(exclude)}): exclude fewer layers, set "
                         f"fp8=None, or check that its tensor_parallel_plan() names its linears.")
    return converted


def _check_not_replicated(name: str, layer: nn.Module, tensor_parallel_size: int) -> None:
    """Refuse a layer whose output rows some ranks share (grouped-query attention's key/value rows when tp exceeds the
    groups): each replica's output gradient there is a part of the whole, summed only after the GEMMs, and FP8 casts of
    parts (their amax, their rounding) are not the cast of their sum, so the numbers would depend on tp."""
    shard = shard_of(layer.weight)
    shared = [segment for segment in shard.segments() if len(segment.holders) > 1] if shard is not None else []
    if shared:
        raise ValueError(
            f"FP8 cannot run {name} at tensor_parallel_size={tensor_parallel_size}: ranks {list(shared[0].holders)} "
            f"share its output rows {shared[0].start}..{shared[0].start + shared[0].size - 1} (key/value heads "
            f"replicated because tp exceeds the key/value groups), and each holds only a part of their gradient, "
            f"which FP8 would cast part by part. Keep it in high precision (fp8_exclude=[{name!r}] or '*.attn.qkv'), "
            f"or use a tensor_parallel_size that divides the number of key/value groups.")


def describe_fp8(module: nn.Module, recipe: Fp8Recipe) -> str:
    """One line for the log: which of this rank's linears run in FP8, in which formats."""
    layers = [m for name, m in module.named_modules()
              if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and not is_adapter_name(name)]
    fp8 = sum(layer.gemms.fp8 for layer in layers)
    formats = {_format_name(recipe.input_dtype), _format_name(recipe.grad_dtype)}
    adapters = " and LoRA adapters" if any(is_adapter_name(name) for name, _ in module.named_modules()) else ""
    return (f"FP8 ({recipe.name} scaling, {' / '.join(sorted(formats))}): {fp8} of this rank's {len(layers)} parallel "
            f"linears run their GEMMs in float8; the others (the output head, fp8_exclude) and everything else "
            f"(embeddings, norms, attention, router, loss{adapters}, weights, optimizer) stay in high precision.")


def _format_name(dtype) -> str:
    return str(dtype).removeprefix("torch.float8_")
