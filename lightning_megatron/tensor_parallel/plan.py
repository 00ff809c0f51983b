"""``parallelize(module, plan)``: turn a plain PyTorch model into a tensor-parallel one.

A model states *what* can be split by returning a plan from ``tensor_parallel_plan()``:
module-name patterns (``*`` matches one name component) mapped to styles (a string, or one
of the objects of ``tensor_parallel.styles``):

==================== =====================================================================
style                effect
==================== =====================================================================
``"column"``         ``nn.Linear`` -> :class:`ColumnParallelLinear`, output features cut into
                     tp contiguous blocks. Assumes the output is independent units in an order
                     any rank reads locally the same way: whole heads of a head-major
                     ``[head, (q, k, v), head_dim]`` qkv, an MLP's hidden features. Wrong (and
                     silently so) for ``[q | k | v]`` or ``[gate | up]``: rank 0 would get all
                     of q and part of k; use ``PackedColumn`` there
``PackedColumn(n)``  ``nn.Linear`` whose output is ``n`` equal chunks (or a tuple of sizes)
                     ``[c0 | c1 | ...]``, read with ``y.chunk(n, -1)``/``split``: each rank
                     holds its ``1/tp`` of every chunk, in order (weight and bias)
``QueryGroupColumn(heads, groups)`` grouped-query attention's qkv fused by query group
                     (``[group, (q heads, k, v), head_dim]``; MHA when groups == heads): whole
                     groups per rank when tp divides groups (as ``"column"``); with tp a
                     multiple of groups, a share of one group's q heads plus its k and v,
                     replicated on that group's ranks (their gradients summed over them)
``KeyValueHeads(groups)`` the key or value projection alone, split as ``QueryGroupColumn``
                     splits its rows of the fused qkv (a LoRA adapter per projection)
``"row"``            ``nn.Linear`` -> :class:`RowParallelLinear` (input features split)
``"column_gather_output"`` ``nn.Linear`` -> :class:`ColumnParallelLinear` whose output is all-gathered
                     (every rank then holds the whole output: for a model that reads it whole,
                     e.g. a norm over all heads; transformers' ``colwise_gather_output``)
``"row_split_input"`` ``nn.Linear`` -> :class:`RowParallelLinear` that takes a whole, replicated
                     input and keeps its own slice (transformers' ``rowwise_split_input``)
``"vocab"``          ``nn.Embedding`` -> :class:`VocabParallelEmbedding`, ``nn.Linear`` ->
                     :class:`VocabParallelHead` (logits stay split), ``nn.CrossEntropyLoss``
                     -> :class:`VocabParallelCrossEntropy`, :class:`Argmax` ->
                     :class:`VocabParallelArgmax`
``"sequence_scatter"`` the module's output enters the sequence-parallel region: it is split
                     along the sequence when sequence parallelism is on
``"sequence_parallel"`` the module runs on sequence chunks when sequence parallelism is on:
                     its replicated parameters get their gradients summed over tp, and its
                     dropout draws from the per-rank stream
``"replicated_with_grad_allreduce"`` the module's parameters are replicated but each rank
                     applies them to its own heads only (a per-head q/k norm's gain): their
                     gradients are partial sums, summed over tp with or without sequence
                     parallelism (transformers' name for the same style)
``"sharded_dropout"`` the module's dropout acts on tensor-parallel shards (local attention
                     heads), so it draws from the per-rank stream
``"sequence_gather"`` the module's input leaves the sequence-parallel region: it is
                     all-gathered along the sequence when sequence parallelism is on, for a
                     replicated module that needs every position (BERT's pooler reads [CLS])
``InsideRegion(s)``  split a Linear as ``s`` (``"column"``, ``"row"``, ``PackedColumn``) without
                     communicating: an enclosing module enters and leaves the region (an MoE
                     layer's experts; ``tensor_parallel.region``)
``"experts_region"`` the module (an MoE layer) gets a ``TensorParallelRegion`` as its ``region``:
                     it enters the region once for all its experts and leaves it once
``"per_head"``       names a *parameter*, not a module: one entry per query head (GPT-OSS's
                     attention sinks), split along dim 0 into tp contiguous blocks as the
                     column-parallel query heads are (rank ``r`` holds heads ``[r H/tp, (r+1) H/tp)``,
                     also when grouped-query attention replicates the key/value heads); each
                     rank's gradient is its heads' own, so nothing is summed over tp
==================== =====================================================================

Swapped layers keep the parameter names of the layers they replace, so a parameter's
global name (and hence its initial value and its checkpoint key) does not depend on
the layout. Tied parameters (GPT's input and output embeddings) stay tied.

A swapped layer also keeps what was attached to the layer it replaces: its child modules,
its forward hooks (pre-hooks, hooks, with their kwargs and always-call flags: the same
dicts, so their handles still remove them), the public attributes set on it beyond its
class's own settings, and its parameters' ``requires_grad``. That is how a LoRA adapter
survives the swap (``peft.lora``: the children ``lora_a``/``lora_b``, the hook adding their
update, ``lora_scale``, the frozen base); the plan may name those children too
(``peft.plan`` does), and they are swapped inside the new layer.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Mapping, Optional, Union

import torch
from torch import nn

from lightning_megatron.parallel.names import name_matches
from lightning_megatron.parallel.random import TensorParallelRNG
from lightning_megatron.parallel.shards import make_shard, new_parameter, shard_of
from lightning_megatron.parallel.state import ParallelState
from lightning_megatron.tensor_parallel.argmax import Argmax, VocabParallelArgmax
from lightning_megatron.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from lightning_megatron.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    mark_sequence_parallel_grad,
)
from lightning_megatron.tensor_parallel.mappings import gather_sequence_to_replicated, scatter_to_sequence
from lightning_megatron.tensor_parallel.overlap import SequenceParallelLinear
from lightning_megatron.tensor_parallel.region import InsideRegion, TensorParallelRegion
from lightning_megatron.tensor_parallel.styles import LAYOUT_STYLES, KeyValueHeads, PackedColumn, QueryGroupColumn

SWAP_STYLES = ("column", "row", "vocab", "column_gather_output", "row_split_input")
REGION_STYLES = ("sequence_scatter", "sequence_parallel", "replicated_with_grad_allreduce", "sharded_dropout",
                 "sequence_gather", "experts_region")
PARAMETER_STYLES = ("per_head",)
STYLES = SWAP_STYLES + REGION_STYLES + PARAMETER_STYLES
Style = Union[str, PackedColumn, QueryGroupColumn, KeyValueHeads]


def _is_swap(style: Style) -> bool:
    if isinstance(style, InsideRegion):
        return True
    return isinstance(style, LAYOUT_STYLES) or style in SWAP_STYLES


def _styles_by_module(module: nn.Module, plan: Mapping[str, Style]) -> dict[str, list[Style]]:
    found: dict[str, list[Style]] = {}
    for pattern, style in plan.items():
        if not isinstance(style, (*LAYOUT_STYLES, InsideRegion)) and not (isinstance(style, str) and style in STYLES):
            raise ValueError(f"Unknown tensor-parallel style {style!r} for {pattern!r}. Valid styles: "
                             f"{', '.join(STYLES)}, PackedColumn(...), QueryGroupColumn(...), "
                             f"KeyValueHeads(...).")
        if style in PARAMETER_STYLES:
            continue  # a parameter's style (_per_head_parameters)
        names = [name for name, _ in module.named_modules() if name and name_matches(pattern, name)]
        if not names:
            raise ValueError(
                f"The tensor-parallel plan entry {pattern!r} matches no submodule of {type(module).__name__}. "
                f"Check the name against `[n for n, _ in model.named_modules()]`."
            )
        for name in names:
            found.setdefault(name, []).append(style)
    return found


def _per_head_parameters(module: nn.Module, plan: Mapping[str, Style]) -> list[str]:
    """The names of the parameters the plan's ``"per_head"`` entries match."""
    found: dict[str, None] = {}
    for pattern, style in plan.items():
        if not (isinstance(style, str) and style == "per_head"):
            continue
        names = [name for name, _ in module.named_parameters() if name_matches(pattern, name)]
        if not names:
            raise ValueError(f"The tensor-parallel plan entry {pattern!r} ({style!r}) matches no parameter of "
                             f"{type(module).__name__}. Check the name against `[n for n, _ in model.named_parameters()]`.")
        found.update(dict.fromkeys(names))
    return list(found)


def _split_by_heads(module: nn.Module, name: str, group) -> None:
    """Replace the parameter ``name`` (one entry per query head) by this rank's contiguous block of its heads, tagged
    with its shard (its initial value, checkpoint key and global shape stay the global parameter's)."""
    owner_name, _, param_name = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    param = getattr(owner, param_name)
    shard = make_shard(group, dim=0, global_shape=tuple(param.shape))
    if param.is_meta:
        local = new_parameter(shard, None, device="meta", dtype=param.dtype)
    else:
        local = nn.Parameter(shard.local_slice(param.detach()).clone())
        local.tensor_shard = shard
    local.requires_grad_(param.requires_grad)
    setattr(owner, param_name, local)


def _swap(old: nn.Module, style: Style, name: str, state: ParallelState, vocab_multiple: int,
          sequence_linear: Optional[SequenceParallelLinear]) -> nn.Module:
    group, sequence_parallel = state.tensor_parallel_group, state.config.sequence_parallel
    factory_kwargs = {"device": "meta"}
    linear_kwargs = dict(factory_kwargs, sequence_linear=sequence_linear)
    if isinstance(old, nn.Linear) and isinstance(style, InsideRegion):
        # A row-parallel layer inside a region leaves its bias out (its outputs are partial sums until the region is
        # left): the enclosing module adds it once, after leaving (an MoE layer's experts: models.moe).
        new = _swap(old, style.style, name, state, vocab_multiple, sequence_linear)
        new.communicates = False
        return new
    if isinstance(old, nn.Linear) and isinstance(style, LAYOUT_STYLES):
        rank_ranges = style.rank_ranges(old.out_features, state.config.tensor_parallel_size, name=name)
        return ColumnParallelLinear(old.in_features, old.out_features, old.bias is not None, group=group,
                                    sequence_parallel=sequence_parallel, rank_ranges=rank_ranges, **linear_kwargs)
    if isinstance(old, nn.Linear) and style in ("column_gather_output", "row_split_input"):
        if sequence_parallel:
            raise ValueError(f"{name}: style {style!r} computes on whole, replicated activations, which sequence "
                             f"parallelism splits along the sequence; use sequence_parallel=False.")
        layer = ColumnParallelLinear if style == "column_gather_output" else RowParallelLinear
        gathered = {"gather_output": True} if style == "column_gather_output" else {"split_input": True}
        return layer(old.in_features, old.out_features, old.bias is not None, group=group, **gathered,
                     **linear_kwargs)
    if isinstance(old, nn.Linear) and style in ("column", "row", "vocab"):
        has_bias = old.bias is not None
        if style == "column":
            return ColumnParallelLinear(old.in_features, old.out_features, has_bias, group=group,
                                        sequence_parallel=sequence_parallel, **linear_kwargs)
        if style == "row":
            return RowParallelLinear(old.in_features, old.out_features, has_bias, group=group,
                                     sequence_parallel=sequence_parallel, **linear_kwargs)
        return VocabParallelHead(old.in_features, old.out_features, has_bias, group=group,
                                 sequence_parallel=sequence_parallel, pad_to_multiple_of=vocab_multiple,
                                 **linear_kwargs)
    if isinstance(old, nn.Embedding) and style == "vocab":
        if old.padding_idx is not None or old.max_norm is not None or old.sparse:
            raise ValueError(f"{name}: VocabParallelEmbedding supports plain embeddings only (no padding_idx, max_norm, sparse).")
        return VocabParallelEmbedding(old.num_embeddings, old.embedding_dim, group=group,
                                      pad_to_multiple_of=vocab_multiple, **factory_kwargs)
    if isinstance(old, nn.CrossEntropyLoss) and style == "vocab":
        if old.weight is not None or old.label_smoothing:
            raise ValueError(f"{name}: the vocab-parallel cross-entropy supports no class weights or label smoothing.")
        return VocabParallelCrossEntropy(group=group, ignore_index=old.ignore_index, reduction=old.reduction)
    if isinstance(old, Argmax) and style == "vocab":
        return VocabParallelArgmax(group=group)
    raise ValueError(
        f"{name}: style {style!r} cannot be applied to {type(old).__name__}. 'column', 'row', "
        f"'column_gather_output', 'row_split_input', PackedColumn and QueryGroupColumn take nn.Linear; "
        f"'vocab' takes nn.Embedding, nn.Linear (the output head), nn.CrossEntropyLoss or Argmax."
    )


_FORWARD_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                       "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _carry_attachments(old: nn.Module, new: nn.Module, name: str) -> None:
    """Give ``new`` the children, forward hooks and public attributes attached to ``old`` (module docstring): those
    that are not its class's own settings (its ``__init__`` arguments, which the new layer has in its own way)."""
    clashes = [child for child in old._modules if child in new._modules]
    if clashes:
        raise ValueError(f"{name}: the parallel layer replacing {type(old).__name__} has children {clashes} of its "
                         f"own, so the ones attached to the layer cannot be kept; rename them.")
    for child_name, child in old.named_children():
        new.add_module(child_name, child)
    for hooks in _FORWARD_HOOK_DICTS:
        if getattr(old, hooks):
            setattr(new, hooks, getattr(old, hooks))
    own_settings = inspect.signature(type(old).__init__).parameters  # nn.Embedding's padding_idx is not attached
    for key, value in vars(old).items():
        if not key.startswith("_") and key not in own_settings and key not in vars(new) and not hasattr(type(new), key):
            setattr(new, key, value)


def _copy_existing_values(old: nn.Module, new: nn.Module) -> None:
    """A module built with real weights (not on meta) keeps them: each rank takes its shard. Frozen parameters
    (``requires_grad=False``, a LoRA base) stay frozen either way."""
    for param_name, new_param in new.named_parameters(recurse=False):
        old_param = getattr(old, param_name)
        new_param.requires_grad_(old_param.requires_grad)
        if old_param.is_meta:
            continue
        shard = shard_of(new_param)
        values = old_param.detach() if shard is None else shard.local_slice(old_param.detach())
        setattr(new, param_name, nn.Parameter(values.clone(), requires_grad=old_param.requires_grad))
        if shard is not None:
            getattr(new, param_name).tensor_shard = shard
        if getattr(new_param, "sequence_parallel_grad", False):
            mark_sequence_parallel_grad(getattr(new, param_name))


def _run_in_fork(module: nn.Module, rng: TensorParallelRNG) -> None:
    """Wrap the module's forward in the per-rank random stream.

    The hooks swap generator states, Python state that ``torch.compile`` cannot put in a graph: traced, dynamo
    breaks at ``torch.get_rng_state`` without being able to resume inside the hook (the whole layer falls back
    to eager), and the always-called hook's id becomes a guard, so every layer would compile again. Kept out of
    tracing (``torch.compiler.disable``), they run eagerly between the compiled graphs, the dropout inside
    those graphs draws from the stream they swapped in, and identical layers share one compiled code
    (``transforms.regional_compile``).
    """
    stack: list[contextlib.ExitStack] = []

    @torch.compiler.disable
    def enter(_module, _args):
        exits = contextlib.ExitStack()
        exits.enter_context(rng.fork())
        stack.append(exits)

    @torch.compiler.disable
    def leave(_module, _args, _output):
        stack.pop().close()

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def _scatter_output(group) -> Callable:
    def hook(_module, _args, output):
        return scatter_to_sequence(output, group)

    return hook


def _gather_input(group) -> Callable:
    def hook(_module, args):
        return (gather_sequence_to_replicated(args[0], group), *args[1:])

    return hook


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


def parallelize(
    module: nn.Module,
    plan: Mapping[str, Style],
    state: ParallelState,
    *,
    rng: Optional[TensorParallelRNG] = None,
    pad_vocab_to_multiple_of: int = 128,
    sequence_linear: Optional[SequenceParallelLinear] = None,
) -> nn.Module:
    """Apply ``plan`` to ``module`` in place for the layout in ``state``; returns ``module``.

    ``sequence_linear``: how the swapped column, row and vocab-head linears communicate under sequence
    parallelism (default: in turn; ``overlap.OverlappedSequenceParallelLinear`` overlaps it with their GEMMs).

    Example::

        plan = {"attn.qkv": PackedColumn(3), "attn.proj": "row", "mlp.fc": "column", "mlp.proj": "row"}
        parallelize(model, plan, state)

    With ``expert_tensor_parallel_size=1`` the experts' ``InsideRegion`` entries (``experts=True``) are left out:
    each tp rank holds whole experts (``expert_parallel``); the MoE layer still enters and leaves its region.
    """
    if state.config.whole_experts:
        plan = {pattern: style for pattern, style in plan.items()
                if not (isinstance(style, InsideRegion) and style.experts)}
    styles, per_head = _styles_by_module(module, plan), _per_head_parameters(module, plan)
    tied: dict[int, list[tuple[str, str]]] = {}
    for module_name, owner in module.named_modules(remove_duplicate=False):
        for param_name, param in owner.named_parameters(recurse=False):
            tied.setdefault(id(param), []).append((module_name, param_name))

    for name, module_styles in styles.items():
        swap_styles = [s for s in module_styles if _is_swap(s)]
        if len(swap_styles) > 1:
            raise ValueError(f"{name} has more than one layer style in the plan: {swap_styles}.")
        if swap_styles:
            old = module.get_submodule(name)
            new = _swap(old, swap_styles[0], name, state, pad_vocab_to_multiple_of, sequence_linear)
            _copy_existing_values(old, new)
            _carry_attachments(old, new, name)
            _set_submodule(module, name, new)
    if state.tensor_parallel_group is not None:  # before any tag: the split parameters' gradients are whole
        for name in per_head:
            _split_by_heads(module, name, state.tensor_parallel_group)

    for names in tied.values():
        if len(names) < 2:
            continue
        first_module, first_param = names[0]
        shared = getattr(module.get_submodule(first_module), first_param)
        for module_name, param_name in names[1:]:
            owner = module.get_submodule(module_name)
            tie = getattr(owner, param_name)
            split_apart = None not in (shard_of(tie), shard_of(shared)) and shard_of(tie) != shard_of(shared)
            if tie.shape != shared.shape or split_apart:
                raise ValueError(
                    f"{module_name}.{param_name} is tied to {first_module}.{first_param} but the plan splits them "
                    f"differently ({tuple(tie.shape)} vs {tuple(shared.shape)}): give both the same style."
                )
            setattr(owner, param_name, shared)

    group, sequence_parallel = state.tensor_parallel_group, state.config.sequence_parallel
    for name, module_styles in styles.items():
        target = module.get_submodule(name)
        if "sequence_scatter" in module_styles and sequence_parallel:
            target.register_forward_hook(_scatter_output(group))
        if "sequence_gather" in module_styles and sequence_parallel:
            target.register_forward_pre_hook(_gather_input(group))
        if "experts_region" in module_styles and group is not None:
            target.region = TensorParallelRegion(group, sequence_parallel)
        if ("sequence_parallel" in module_styles and sequence_parallel) or \
                ("replicated_with_grad_allreduce" in module_styles and group is not None):
            for param in target.parameters():
                if shard_of(param) is None:
                    mark_sequence_parallel_grad(param)  # the tag optim.partial_grads sums over tp
        forks = "sharded_dropout" in module_styles or ("sequence_parallel" in module_styles and sequence_parallel)
        if forks and rng is not None:
            _run_in_fork(target, rng)
    return module
