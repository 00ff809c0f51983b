"""Activation recomputation: keep fewer activations for backward and recompute the rest there.

``mode="full"`` keeps only the input of each matched layer and runs the layer's forward
again in backward (one more forward per step). ``mode="selective"`` recomputes only the parts
of each matched layer that the model declares in ``recompute_plan()`` (module-name patterns
mapped to ``"selective"``, as ``tensor_parallel_plan()`` maps them to styles). Our models declare
the attention core (``dropout(softmax(q k^T)) v``, a
:class:`~lightning_megatron.models.attention.CoreAttention`): its activations grow with
the square of the sequence length, its FLOPs are a few percent of the layer's
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models").
The model says *what*, this module only matches names, so it imports no model.

Both use ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` on the matched module's
``forward`` rather than wrapping the module in another one, so module and parameter names
(checkpoint keys, initialisation seeds, plan patterns) do not change.

Dropout masks. A recomputed forward must draw exactly the masks the original forward drew.
``preserve_rng_state=True`` (torch's default) restores the default generator, but torch does
not know the per-tensor-parallel-rank stream of :class:`TensorParallelRNG`; see
:class:`_ReplayTracker` for how it is replayed. (Selective recomputation alone would not
need the replay: the attention core runs inside attention's ``fork()``, where the per-rank
stream is the default generator, and contains no fork of its own. Every checkpoint gets
the same treatment, so that no case rests on that.)
"""

from __future__ import annotations

import types
from functools import partial
from typing import Optional

from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from lightning_megatron.parallel.names import name_matches
from lightning_megatron.parallel.random import TensorParallelRNG
from lightning_megatron.transforms.regional_compile import compiled_function

MODES = ("none", "full", "selective")
#: What a ``recompute_plan()`` may map a pattern to (``"full"`` always means the whole matched layer).
PLAN_MODES = ("selective",)


def apply_activation_checkpointing(
    module: nn.Module, *, mode: str, layer_pattern: str, rng: Optional[TensorParallelRNG] = None
) -> nn.Module:
    """Recompute the activations of the layers matching ``layer_pattern`` in backward; returns ``module``.

    ``layer_pattern`` names the transformer layers as in a tensor-parallel plan (``*`` matches
    one name component); ``mode="selective"`` recomputes, inside each of them, the submodules that
    ``module.recompute_plan()`` maps to ``"selective"`` (names relative to ``module``). Pass the ``rng``
    that ``parallelize`` was given, so that recomputed dropout on the per-rank stream repeats the original masks.
    Apply it after ``parallelize`` (layers it swaps would lose the recomputation) and before splitting for the
    pipeline (every rank then matches the same layers and fails alike on a bad pattern). ``mode="none"``
    returns ``module`` untouched.

    Example::

        parallelize(model, model.tensor_parallel_plan(), state, rng=rng)
        apply_activation_checkpointing(model, mode="selective", layer_pattern="model.blocks.*", rng=rng)
    """
    if mode not in MODES:
        raise ValueError(f"Unknown activation checkpointing mode {mode!r}. Valid modes: {', '.join(map(repr, MODES))}.")
    if mode == "none":
        return module
    layers = [(name, layer) for name, layer in module.named_modules() if name and name_matches(layer_pattern, name)]
    if not layers:
        raise ValueError(
            f"layer_pattern {layer_pattern!r} matches no submodule of {type(module).__name__} ('*' matches one name "
            f"component, e.g. 'model.blocks.*'). Check it against `[n for n, _ in model.named_modules()]`."
        )
    targets = layers if mode == "full" else _selective_targets(module, layers)
    context_fn = noop_context_fn if rng is None else partial(_tracker_contexts, rng)
    for name, target in targets:
        _checkpoint_forward(target, name, context_fn)
    return module


def _selective_targets(module: nn.Module, layers: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The submodules of the matched layers that ``module.recompute_plan()`` names; each layer must have one."""
    plan = module.recompute_plan() if hasattr(module, "recompute_plan") else {}
    unknown = {pattern: mode for pattern, mode in plan.items() if mode not in PLAN_MODES}
    if unknown:
        raise ValueError(f"{type(module).__name__}.recompute_plan() maps {unknown}; a pattern maps to one of "
                         f"{', '.join(map(repr, PLAN_MODES))} (mode='full' recomputes whole layers).")
    found = []
    for name, layer in layers:
        parts = [(f"{name}.{sub}", m) for sub, m in layer.named_modules()
                 if sub and any(name_matches(pattern, f"{name}.{sub}") for pattern in plan)]
        if not parts:
            raise ValueError(
                f"mode='selective' recomputes what {type(module).__name__}.recompute_plan() names inside each "
                f"matched layer ({sorted(plan) or 'it declares none'}), but {name} ({type(layer).__name__}) has none. "
                f"Declare recompute_plan() (e.g. {{'blocks.*.attn.core_attention': 'selective'}}), or use mode='full'."
            )
        found.extend(parts)
    return found


def _checkpoint_forward(module: nn.Module, name: str, context_fn) -> None:
    """Make ``module.forward`` a checkpointed call of its class's forward.

    Only ``forward`` is recomputed, not ``module(...)``: the module's own hooks (e.g. the fork
    into the per-rank stream that ``parallelize`` registers on a sequence-parallel layer) run
    once, around the checkpointed call, and are not re-entered in backward. Hooks of its
    submodules (attention's fork) do run again; :class:`_ReplayTracker` makes them behave as
    they did in the forward. Bound as a method so that a deep copy calls its own module. A forward
    compiled by regional compilation is what gets checkpointed (recomputation runs the compiled code).
    """
    forward = compiled_function(module) or type(module).forward
    if "forward" in vars(module) and forward is type(module).forward:
        raise ValueError(
            f"{name} ({type(module).__name__}) already has its own `forward` attribute; was activation "
            f"checkpointing applied twice? Apply it once, to a model built without it."
        )

    def checkpointed(self, *args, **kwargs):
        return checkpoint(forward, self, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    module.forward = types.MethodType(checkpointed, module)


class _RecordTracker:
    """Forward context: remembers the tracker's state as the checkpointed forward starts."""

    def __init__(self, rng: TensorParallelRNG) -> None:
        self.rng = rng
        self.state: Optional[tuple] = None

    def __enter__(self) -> None:
        self.state = self.rng.get_state()

    def __exit__(self, *exc_info) -> None:
        return None


class _ReplayTracker:
    """Recompute context: the tracker as the forward found it, then back to where backward found it.

    Why both halves are needed, for a GPT layer:

    - With sequence parallelism the whole layer runs inside ``fork()`` (its pre-hook entered
      the fork before the checkpoint started), so every dropout draws from the swapped-in
      stream and attention's own fork is a no-op. Backward runs outside any fork: unless the
      recomputation is marked as inside one again, attention's fork hook swaps in the
      tracker's *current* stream and draws other masks.
    - Without it, the layer runs outside the fork and attention's fork swaps in the stream
      saved in the tracker; by backward, later layers and micro-batches have advanced it.
    - Either way the recomputation draws from the tracker; unless it is put back afterwards,
      the next forward's per-rank masks shift by one layer's worth of draws.

    This needs two context managers that checkpoint enters at different times (the forward,
    the recomputation), which is what ``context_fn`` offers; a wrapper around the function
    could not tell the original forward from its recomputation. A class rather than a
    generator context manager, because a second backward (``retain_graph=True``) recomputes,
    and so enters it, again.
    """

    def __init__(self, record: _RecordTracker) -> None:
        self.record = record
        self.resume: Optional[tuple] = None

    def __enter__(self) -> None:
        self.resume = self.record.rng.get_state()
        self.record.rng.set_state(self.record.state)

    def __exit__(self, *exc_info) -> None:
        self.record.rng.set_state(self.resume)


def _tracker_contexts(rng: TensorParallelRNG) -> tuple[_RecordTracker, _ReplayTracker]:
    record = _RecordTracker(rng)
    return record, _ReplayTracker(record)
