"""Regional compilation: ``torch.compile`` of each transformer layer (``Megatron3DStrategy(compile=...)``).

Only the ``pipeline_blocks()`` layers are compiled, not the whole model: they are where the time goes, they are
identical, and one compiled code serves them all (the layers of one class share one compiled function, whose
guards see parameters as inputs), so compile time does not grow with depth. The embedding, head and loss (the
vocab-parallel layers), the pipeline schedule and the gradient hooks stay eager.

What dynamo makes of the rest of a layer (torch 2.13, measured on a 2-layer GPT, gloo):

- The tensor-parallel operators (``tensor_parallel.mappings``: f, g, the sequence-parallel all-gather and
  reduce-scatter) are autograd functions calling ``torch.distributed`` collectives: dynamo traces them,
  forward and backward, into the layer's graphs without a break.
- The per-rank dropout stream's fork (``tensor_parallel.plan._run_in_fork``) is kept out of tracing and runs
  eagerly: attention's enter and leave hooks each break the graph, three graphs a layer at every layout
  (measured at tp1 x dp2, tp2 + sequence parallelism, pp2: 3 graphs for 4 layers, no recompilation). Traced,
  the fork would break inside a hook, where dynamo cannot resume (the layer falls back to eager), and the
  always-called hook's id would be a guard: every layer compiled again, and past torch's recompile limit (8)
  the rest run eagerly.

Compiled dropout draws other masks than eager dropout (inductor and AOT's decompositions use their own random
ops), from the same per-rank streams; with dropout off the compiled model computes the eager model's function.

Where in :mod:`lightning_megatron.strategy.preparation`: after the tensor-parallel swaps (the compiled forward runs the
swapped layers; compilation is lazy, at the first call, so it traces whatever the layer holds then) and before
activation recomputation, which then checkpoints the compiled forward. The other order (torchtitan's: compile
the checkpointed layer) makes dynamo trace ``checkpoint`` as a higher-order op whose body must have no graph
break, and whose ``context_fn`` must be a selective-checkpoint policy; ours replays the per-rank stream in
Python and the body breaks at the fork, so dynamo would run the whole layer eagerly (measured: no graph at
all). Inside the checkpoint, recomputation runs the compiled forward again and the stream's replay stays
eager. Before ZeRO-3's ``fully_shard`` (FSDP's hooks gather the layer's parameters eagerly, around the
compiled forward) and the pipeline split (every rank checks the layers alike; dropped layers never compile).
"""

from __future__ import annotations

import inspect
import types
import weakref
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.names import name_matches
from lightning_megatron.pipeline.layout import SCHEDULE_SPECS

COMPILE_ARGUMENTS = tuple(name for name in inspect.signature(torch.compile).parameters if name != "model")
_COMPILED: "weakref.WeakSet[Callable]" = weakref.WeakSet()  # what compile_layers made (recomputation wraps them)


def compile_options(compile: Union[bool, Mapping[str, Any], None]) -> Optional[dict[str, Any]]:
    """The strategy's ``compile`` argument checked: ``None`` when off, else the keyword arguments of
    ``torch.compile`` (``{}`` for ``True``)."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return {}
    if not isinstance(compile, Mapping):
        raise ValueError(f"compile must be True, False or a dict of torch.compile arguments (e.g. "
                         f"{{'backend': 'aot_eager'}} or {{'mode': 'max-autotune-no-cudagraphs'}}), got {compile!r}.")
    unknown = sorted(set(compile) - set(COMPILE_ARGUMENTS))
    if unknown:
        raise ValueError(f"compile={dict(compile)!r}: {', '.join(map(repr, unknown))} is not an argument of "
                         f"torch.compile; use {', '.join(map(repr, COMPILE_ARGUMENTS))}.")
    if compile.get("fullgraph"):
        raise ValueError("compile={'fullgraph': True} cannot work: the per-rank dropout stream is swapped in eagerly "
                         "around each attention (one graph break per layer). Leave fullgraph out.")
    _refuse_cuda_graphs(compile)
    return dict(compile)


# torch.compile's modes that capture CUDA graphs, and the mode that does the same work without them.
_CUDA_GRAPH_MODES = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def _refuse_cuda_graphs(compile: Mapping[str, Any]) -> None:
    """Refuse what makes inductor capture CUDA graphs (``mode`` reduce-overhead or max-autotune, or
    ``options={"triton.cudagraphs": True}``). A captured graph replays its kernels on static buffers with the RNG
    state it was captured with, while our layers are compiled in pieces with eager code between them that a
    replay does not see: attention's hooks swap the per-rank dropout stream in and out, the tensor-parallel
    collectives run on the process group's own streams, and a pipeline schedule keeps several micro-batches'
    activations alive that the next replay of the same graph would overwrite. None of that is verified under
    capture, so it is refused; the non-graph modes do the same kernel selection. Checked in the strategy's
    constructor, so every rank refuses before any collective."""
    reason = ("it captures CUDA graphs around each layer, whose replays reuse static buffers and the captured RNG "
              "state, while the per-rank dropout stream is swapped in eagerly around attention and the "
              "tensor-parallel collectives and pipeline micro-batches hold on to those buffers")
    mode = compile.get("mode")
    if mode in _CUDA_GRAPH_MODES:
        raise ValueError(f"compile={{'mode': {mode!r}}} is not supported: {reason}. Use "
                         f"{{'mode': {_CUDA_GRAPH_MODES[mode]!r}}}, the same without CUDA graphs.")
    if (compile.get("options") or {}).get("triton.cudagraphs"):
        raise ValueError(f"compile={{'options': {{'triton.cudagraphs': True}}}} is not supported: {reason}. Leave "
                         f"triton.cudagraphs out.")


def check_compile_layout(config: ParallelConfig, activation_checkpointing: str, pipeline_schedule: str = "1f1b") -> None:
    """Refuse, before any process group exists, what regional compilation does not support."""
    if config.pipeline_parallel_size > 1 and SCHEDULE_SPECS[pipeline_schedule].split_backward:
        raise ValueError(
            f"compile with pipeline_schedule={pipeline_schedule!r} is not supported: a compiled layer's backward is one "
            f"graph that computes input and weight gradients together, so the schedule's split into an input-gradient "
            f"and a later weight-gradient pass would run it twice (torch refuses the combination too). Use "
            f"interleaved_1f1b (or 1f1b) with compile, or compile=False.")
    if activation_checkpointing == "selective":
        raise ValueError(
            "compile with activation_checkpointing='selective' is not supported: the checkpointed attention core "
            "lies inside the compiled layer, where dynamo makes the checkpoint a graph op that cannot replay the "
            "per-rank dropout stream. Use activation_checkpointing='full' (it recomputes the compiled layer) or "
            "'none'.")
    for name in ("context_parallel_size", "expert_parallel_size"):
        if getattr(config, name) != 1:
            raise ValueError(
                f"compile with {name}={getattr(config, name)} is not supported yet: the ring attention's send/recv "
                f"and the experts' uneven all-to-all have not been verified under torch.compile. Set compile=False "
                f"or {name}=1.")


def compile_layers(module: nn.Module, layer_pattern: str, options: Mapping[str, Any]) -> int:
    """Make the forward of every layer matching ``layer_pattern`` a compiled one; returns how many functions
    were compiled (one per layer class).

    Only ``forward`` is compiled, not ``module(...)``: the layer's own hooks (the per-rank stream's fork,
    FSDP's parameter gathering) stay eager around it. Parameter and module names do not change (no
    ``OptimizedModule`` wrapper): checkpoints, initial values and plans still find them.
    """
    layers = [(name, layer) for name, layer in module.named_modules() if name and name_matches(layer_pattern, name)]
    if not layers:
        raise ValueError(f"layer_pattern {layer_pattern!r} matches no submodule of {type(module).__name__}.")
    compiled: dict[type, Callable] = {}
    for name, layer in layers:
        if "forward" in vars(layer):
            raise ValueError(f"{name} ({type(layer).__name__}) already has its own `forward` attribute; compile "
                             f"the layers of a model built without one (before activation recomputation).")
        cls = type(layer)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward, **options)
            _COMPILED.add(compiled[cls])
        layer.forward = types.MethodType(compiled[cls], layer)
    return len(compiled)


def compiled_function(module: nn.Module) -> Optional[Callable]:
    """The compiled function behind ``module.forward`` if :func:`compile_layers` made it, else ``None``."""
    function = getattr(vars(module).get("forward"), "__func__", None)
    return function if function is not None and function in _COMPILED else None
