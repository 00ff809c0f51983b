"""Bytes each rank sends in a training step, by process group and collective: the one formula behind the planner's
communication times (``plan.step_time``) and the measured-to-formula table of ``python -m benchmarks.memory formulas``.

A collective of ``n`` ranks over a tensor of ``B`` bytes (all-gather: the gathered tensor; reduce-scatter: its
input) costs each rank, in a bandwidth-optimal ring algorithm (NCCL's), :data:`RING_SHARE` of ``B``: an all-reduce
``2 (n - 1) / n`` (a reduce-scatter, then an all-gather), an all-gather or a reduce-scatter ``(n - 1) / n``, an
all-to-all what leaves for the other ranks, ``(n - 1) / n`` when tokens are routed evenly; a send its tensor.

Per micro-batch of ``T = micro_batch_size * seq_length / cp`` tokens a rank, with ``X = T h w`` (``w``: the compute
dtype's bytes) and ``L`` its layers, sends (Megatron-Core's collectives; ``q = tp`` under sequence parallelism):

===========  ===================================================================================================
group        collectives per micro-batch (plus per step)
===========  ===================================================================================================
tp           each layer: forward two all-reduces of ``X`` (the row-parallel outputs), backward two (the column
             inputs' gradients); under sequence parallelism each becomes an all-gather and a reduce-scatter of the
             same ``X``, and backward gathers each column layer's input again (it saves its own chunk); the
             embedding's output (all-reduce; SP: reduce-scatter, backward all-gather), the head's input (backward
             all-reduce; SP: all-gather, backward reduce-scatter and gather again), the vocab-parallel
             cross-entropy's three ``[T]`` fp32 all-reduces (max, target logit, sum of exponentials). Full
             recomputation runs a layer's forward collectives again but the last (``plan.flops``: the checkpoint
             stops before the MLP's output projection). Per step under SP: the all-reduce of the
             sequence-parallel parameters' gradients (norms, row layers' biases). Multi-head latent attention:
             its latents (``r_q + r_kv + r`` channels) enter the region in place of attention's input (an all-reduce
             of their gradient; SP: gathered once and kept, their gradient reduce-scattered), and under SP its
             replicated down projections and latent norms join the per-step all-reduce.
cp           ring: each layer's keys and values go ``cp - 1`` hops forward and ``cp - 1`` again in backward with
             their gradients' ``cp`` hops: ``2 (3 cp - 2)`` sends of ``T g d w`` (``g``: this rank's key/value
             heads), ``2 (cp - 1)`` more where the core is recomputed; all-gather attention: the keys and values
             all-gathered (``2`` of ``cp T g d w``; again where recomputed), their gradients reduce-scattered.
pp           each of the rank's stages sends its output forward (but the last) and its input's gradient back (but
             the first): ``T h w / q`` each.
ep           each MoE layer: four all-to-alls of the ``T top_k`` routed token copies (dispatch and combine, forward
             and backward), ``T top_k h w``, of which ``(ep - 1) / ep`` leaves the rank when routing is even, and
             one all-gather of the ``num_experts`` token counts (int64) of every ep rank.
dp           per step over ``dp x cp`` replicas: ZeRO-0 all-reduces the gradient buffers (expert parameters' over
             their ``dp / ep`` replicas), ZeRO-1 reduce-scatters them and all-gathers the updated parameters,
             ZeRO-2 reduce-scatters every micro-batch; ZeRO-3 (FSDP2) all-gathers every layer in forward and again
             in backward (the root group, embedding, final norm and head, stays gathered) in the compute dtype
             and reduce-scatters the fp32 gradients, every micro-batch; under expert parallelism the experts'
             over their ``dp / ep`` replicas.
===========  ===================================================================================================

Scalars (token counts, the gradient norm, the non-finite flag, the loss totals the pipeline broadcasts) are left out:
a few bytes a step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

from lightning_megatron.parallel.shards import padded_size
from lightning_megatron.plan.flops import pipeline_rank_layers
from lightning_megatron.plan.layout import Layout, Workload
from lightning_megatron.plan.shape import ModelShape

#: The share of a collective's tensor that each of ``n`` ranks sends, ring algorithms.
RING_SHARE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "send": lambda n: 1.0}
GROUPS = ("tp", "cp", "pp", "ep", "dp", "edp")  # edp: an expert's data-parallel replicas (dp / ep)


def ring_sent(kind: str, n: int, full_bytes: float) -> float:
    """Bytes one of ``n`` ranks sends for a ``kind`` collective over ``full_bytes`` (see :data:`RING_SHARE`)."""
    return RING_SHARE[kind](n) * full_bytes


@dataclass(frozen=True)
class Collective:
    """``calls`` collectives of one kind per step over a group, each over a tensor of ``full_bytes``; ``sent``: the
    bytes this rank sends for all of them."""

    group: str
    kind: str
    calls: float
    full_bytes: float
    sent: float
    what: str


def group_sizes(layout: Layout) -> dict[str, int]:
    return {"tp": layout.tensor_parallel_size, "cp": layout.context_parallel_size,
            "pp": layout.pipeline_parallel_size, "ep": layout.expert_parallel_size, "dp": layout.replica_size,
            "edp": layout.expert_data_parallel_size * layout.context_parallel_size}


def step_collectives(shape: ModelShape, layout: Layout, workload: Workload, model_state: dict[str, int], *,
                     pipeline_rank: int = 0, context_parallel_attention: str = "ring",
                     routed_away: Optional[float] = None) -> list[Collective]:
    """The collectives of one training step on a rank of ``pipeline_rank`` (the module docstring's table).

    ``model_state``: the rank's ``model_state_bytes`` (``Planner.model_state_bytes``: its gradient buffers and
    parameters); ``context_parallel_attention``: the strategy's (``"ring"`` or ``"all_gather"``); ``routed_away``:
    the share of the routed token copies that leave the rank (``None``: even routing, ``(ep - 1) / ep``)."""
    if context_parallel_attention not in ("ring", "all_gather"):
        raise ValueError(f"context_parallel_attention={context_parallel_attention!r} is not 'ring' or 'all_gather' "
                         f"(the strategy's choices).")
    sizes = group_sizes(layout)
    out: list[Collective] = []

    def add(group: str, kind: str, calls: float, full_bytes: float, what: str, sent_share: Optional[float] = None):
        if calls and full_bytes and sizes[group] > 1:
            share = RING_SHARE[kind](sizes[group]) if sent_share is None else sent_share
            out.append(Collective(group, kind, calls, full_bytes, calls * share * full_bytes, what))

    tp, cp, pp, ep = (sizes[name] for name in ("tp", "cp", "pp", "ep"))
    sp = layout.sequence_parallel
    w, h = workload.compute_bytes, shape.hidden_size
    m = layout.micro_batches(workload)
    tokens = layout.micro_batch_size * workload.seq_length / cp
    layers = pipeline_rank_layers(shape, layout, pipeline_rank)
    moe_layers = shape.moe_layers * layers / shape.num_layers
    first, last = pipeline_rank == 0, pipeline_rank == pp - 1
    mode = layout.activation_checkpointing
    x = tokens * h * w

    # ---- tensor parallel
    mla = shape.mla
    if sp and mla is not None:  # the latents enter once (kept gathered) in place of attention's input
        latents = tokens * _latent_width(mla) * w
        recomputed = (2, 1) if mode == "full" else (0, 0)
        add("tp", "all_gather", m * layers * (4 + recomputed[0]), x, "layers' column inputs")
        add("tp", "all_gather", m * layers, latents, "attention's latents")
        add("tp", "reduce_scatter", m * layers * (3 + recomputed[1]), x, "layers' row outputs")
        add("tp", "reduce_scatter", m * layers, latents, "attention's latents' gradient")
    elif sp:
        recomputed = (2, 1) if mode == "full" else (0, 0)  # all-gathers, reduce-scatters of the recomputed forward
        # Forward and backward 2 all-gathers each, and backward gathers the 2 column layers' inputs again.
        add("tp", "all_gather", m * layers * (6 + recomputed[0]), x, "layers' column inputs")
        add("tp", "reduce_scatter", m * layers * (4 + recomputed[1]), x, "layers' row outputs")
        add("tp", "reduce_scatter", m * first, x, "embedding output")
        add("tp", "all_gather", m * first, x, "embedding output's gradient")
        add("tp", "all_gather", m * last * 2, x, "head input (forward, again in backward)")
        add("tp", "reduce_scatter", m * last, x, "head input's gradient")
        # The sequence-parallel parameters: each norm's weight (and LayerNorm's bias), the row layers' biases.
        per_norm = h * (1 if shape.rms_norm else 2)
        row_biases = 2 * h if getattr(shape.config, "add_bias_linear", False) else 0
        replicated = layers * (shape.norms_per_layer * per_norm + row_biases) + last * per_norm
        if mla is not None:  # the replicated down projections and the latents' norms
            down = _latent_width(mla) - mla.qk_rope_head_dim
            replicated += layers * (h * _latent_width(mla) + down * (per_norm // h))
        add("tp", "all_reduce", 1, replicated * workload.parameter_bytes, "sequence-parallel parameters' gradients")
    elif mla is not None:  # backward sums the latents' gradient over the heads' ranks, not the hidden state's
        add("tp", "all_reduce", m * layers * (3 + (mode == "full")), x, "layers")
        add("tp", "all_reduce", m * layers, tokens * _latent_width(mla) * w, "attention's latents' gradient")
        add("tp", "all_reduce", m * (first + last), x, "embedding output, head input's gradient")
    else:
        add("tp", "all_reduce", m * layers * (4 + (mode == "full")), x, "layers")
        add("tp", "all_reduce", m * (first + last), x, "embedding output, head input's gradient")
    add("tp", "all_reduce", m * last * 3, tokens * 4, "vocab-parallel cross-entropy")

    # ---- context parallel
    kv = tokens * max(shape.query_groups, tp) // tp * shape.head_dim * w  # one of K, V
    if mla is not None:  # every head's key and value, padded to the kernel's width
        kv = tokens * shape.num_heads // tp * shape.attention_width * w
    recomputed_core = mode != "none"
    if context_parallel_attention == "all_gather":
        add("cp", "all_gather", m * layers * 2 * (1 + recomputed_core), cp * kv, "keys, values")
        add("cp", "reduce_scatter", m * layers * 2, cp * kv, "their gradients")
    else:
        add("cp", "send", m * layers * 2 * (3 * cp - 2 + recomputed_core * (cp - 1)), kv, "ring of keys, values")

    # ---- pipeline
    stages = pp * layout.virtual_pipeline_size
    sends = sum((stage < stages - 1) + (stage > 0) for stage in range(pipeline_rank, stages, pp))
    add("pp", "send", m * sends, x / (tp if sp else 1), "stage outputs, input gradients")

    # ---- expert parallel
    fold = tp // layout.expert_tensor_parallel  # whole experts: each tp rank dispatches 1/tp of the copies
    add("ep", "all_to_all", m * moe_layers * 4, tokens * shape.top_k * h * w / fold, "routed tokens",
        sent_share=routed_away)
    add("ep", "all_gather", m * moe_layers, ep * shape.num_experts * 8, "tokens per expert")

    # ---- data parallel (dp x cp replicas)
    expert = _expert_gradient_bytes(shape, layout, workload, layers)
    gradients = model_state["gradients"]
    if layout.zero_stage == 0:
        add("dp", "all_reduce", 1, gradients - expert, "gradients")
        add("edp", "all_reduce", 1, expert, "expert gradients")
    elif layout.zero_stage in (1, 2):
        full = gradients * (sizes["dp"] if layout.zero_stage == 2 else 1)  # ZeRO-2 keeps its slice only
        add("dp", "reduce_scatter", m if layout.zero_stage == 2 else 1, full, "gradients")
        add("dp", "all_gather", 1, full, "updated parameters")
    else:  # the experts' fp32 shards over their edp replicas, the rest over dp x cp
        n = sizes["dp"]
        experts = expert / workload.parameter_bytes  # elements of the rank's experts, whole
        dense_shards = model_state["parameters"] - 4 * experts / sizes["edp"]
        parameters = dense_shards * n / 4 * w  # fp32 shards, gathered in the compute dtype
        root = _root_parameter_elements(shape, layout, workload, first, last) * w
        add("dp", "all_gather", m, 2 * parameters - root, "layers (forward, backward), root group (once)")
        add("dp", "reduce_scatter", m, (model_state["gradients"] - 4 * experts / sizes["edp"]) * n, "fp32 gradients")
        add("edp", "all_gather", m, 2 * experts * w, "experts (forward, backward)")
        add("edp", "reduce_scatter", m, 4 * experts, "experts' fp32 gradients")
    return out


def sent_by_group(collectives: list[Collective]) -> dict[str, float]:
    """Bytes sent per group."""
    sent: dict[str, float] = defaultdict(float)
    for collective in collectives:
        sent[collective.group] += collective.sent
    return dict(sent)


def _latent_width(mla) -> int:
    """Channels per token that enter multi-head latent attention's tensor-parallel region: the query latent (when
    there is one), the key/value latent and the shared rotary key (``models.latent_attention``)."""
    return (mla.q_lora_rank or 0) + mla.kv_lora_rank + mla.qk_rope_head_dim


def _expert_gradient_bytes(shape: ModelShape, layout: Layout, workload: Workload, layers: int) -> float:
    """This rank's expert parameters' gradient bytes (its ``num_experts / ep`` experts of its MoE layers)."""
    if not shape.moe_layers or layout.expert_parallel_size == 1:
        return 0.0
    matrices = 3 if shape.gated_mlp else 2
    per_expert = matrices * shape.hidden_size * shape.expert_ffn_size / layout.expert_tensor_parallel
    local = shape.num_experts // layout.expert_parallel_size
    return shape.moe_layers * layers / shape.num_layers * local * per_expert * workload.parameter_bytes


def _root_parameter_elements(shape: ModelShape, layout: Layout, workload: Workload, first: bool, last: bool) -> float:
    """Elements of ZeRO-3's root group on the rank: the embedding (first stage), the final norm and the head (last)."""
    tp, h = layout.tensor_parallel_size, shape.hidden_size
    vocab = padded_size(shape.vocab_size, tp, workload.pad_vocab_to_multiple_of) / tp
    tied = getattr(shape.config, "tie_embeddings", False)
    return vocab * h * first + (h + (0 if tied and first else vocab * h)) * last
