"""FLOPs per rank of a training step: the model FLOPs (``models.flops``, Narayanan et al. 2021) shared out over the
ranks that do the work, and what the rank's kernels execute on top of them.

Per token, forward, for the whole layer (``/ tp`` on a rank): the GEMMs outside attention's core
(:func:`layer_gemm_flops`: ``qkv``, ``proj``, the MLP's or the router's and experts' matrices) and the core's
``Q K^T`` and ``P V`` (:func:`attention_core_flops`). A rank of pipeline rank ``r`` runs its stages' layers on the
``T = global_batch / dp * seq_length / cp`` tokens of its step, and the last stage the logits (``2 h V / tp``).

* **model** FLOPs (:attr:`RankFlops.model`): ``3 T (layers (gemm + core) + logits) / tp``, the whole ``s x s``
  score matrix as Megatron-LM and PaLM count it. Summed over the ranks: ``models.flops.gpt_flops_per_batch``.
* **recomputation**: ``"selective"`` runs the attention core's forward again in backward; ``"full"`` the layer's
  forward but its last GEMM: ``torch.utils.checkpoint`` stops recomputing once every tensor the backward needs is
  back, and no backward needs a dense layer's output (the MLP's down projection, whose input it saved).
* **executed** (:attr:`RankFlops.executed`), as ``torch.utils.flop_counter`` counts the kernels: flash attention's
  backward computes the scores again (``2.5 x`` the core's forward, not ``2 x``); a causal kernel counts its
  whole block; under context parallelism (ring or all-gather, ``context_parallel.blocks``) a rank computes its own
  block causally and only the needed half of each other rank's, ``(cp + 1) / (2 cp)`` of the ``T x s`` scores.
* **multi-head latent attention** (``GPTConfig.mla``): the low-rank projections in place of ``qkv``
  (``models.flops.latent_attention_flops``), scores over ``qk_head_dim`` and values over ``v_head_dim`` channels;
  executed, the kernel runs on heads padded to the wider of the two (``models.latent_attention``).
* **sliding windows** (``GPTConfig.sliding_window``): a sliding layer's queries see at most ``window`` keys, and the
  model FLOPs count ``min(window, s)`` keys per query, the whole band as Megatron counts the whole matrix
  (:func:`attention_core_parts`); executed, a sliding layer counts that band whatever the context-parallel split
  (the back ends skip tiles outside the window; tile granularity left out).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_megatron.models.flops import attended_keys, latent_attention_flops
from lightning_megatron.plan.layout import Layout, Workload
from lightning_megatron.plan.shape import ModelShape

#: FlashAttention's backward: the gradients of ``Q K^T`` and ``P V`` (2 x forward) and the scores again (0.5 x).
FLASH_BACKWARD = 2.5


def layer_gemm_flops(shape: ModelShape) -> float:
    """Forward GEMM FLOPs per token of an average layer, outside attention's core (the whole layer's, not /tp)."""
    h, d = shape.hidden_size, shape.head_dim
    qkv = 2 * h * (shape.num_heads + 2 * shape.query_groups) * d
    proj = 2 * shape.num_heads * d * h
    if shape.mla is not None:  # the low-rank projections (models.flops)
        qkv, _, proj = latent_attention_flops(shape.mla, h, shape.num_heads)
    matrices = 3 if shape.gated_mlp else 2
    dense_mlp = matrices * 2 * h * shape.ffn_size
    moe_mlp = (2 * h * shape.num_experts + shape.top_k * matrices * 2 * h * shape.expert_ffn_size
               + matrices * 2 * h * shape.shared_expert_size + (2 * h if shape.shared_expert_gate else 0))
    mlp = (shape.dense_layers * dense_mlp + shape.moe_layers * moe_mlp) / shape.num_layers
    return qkv + proj + mlp


def attention_core_flops(shape: ModelShape, seq_length: int, *, skip_masked_half: bool = False) -> float:
    """Forward FLOPs per token of ``Q K^T`` and ``P V`` of an average layer (not /tp); ``skip_masked_half``: a causal
    flash kernel's actual work (the planner's timing), else the whole score matrix (the model FLOPs' count)."""
    return sum(attention_core_parts(shape, seq_length, skip_masked_half=skip_masked_half))


def attention_core_parts(shape: ModelShape, seq_length: int, *, skip_masked_half: bool = False) -> tuple[float, float]:
    """:func:`attention_core_flops` as ``(full-attention layers' share, sliding layers' share)``: a sliding layer's
    queries see at most ``sliding_window`` keys (``models.flops.attended_keys``)."""
    half = skip_masked_half and shape.causal
    per_key = 2 * shape.num_heads * (shape.qk_head_dim + shape.v_head_dim) / shape.num_layers
    full = (shape.num_layers - shape.sliding_layers) * attended_keys(seq_length, causal_half=half)
    sliding = shape.sliding_layers * attended_keys(seq_length, shape.sliding_window, causal_half=half)
    return per_key * full, per_key * sliding


def pipeline_rank_layers(shape: ModelShape, layout: Layout, pipeline_rank: int) -> int:
    """Layers the pipeline rank runs (its stages': rank ``r`` holds stages ``r, r + pp, ...``)."""
    pp = layout.pipeline_parallel_size
    counts = layout.pipeline_layers_per_stage
    if counts is None:
        return shape.num_layers // pp
    return sum(counts[pipeline_rank::pp])


@dataclass(frozen=True)
class RankFlops:
    """One rank's FLOPs of one training step (see the module docstring)."""

    model: float
    recomputation: float
    executed: float


def rank_step_flops(shape: ModelShape, layout: Layout, workload: Workload, *, pipeline_rank: int = 0) -> RankFlops:
    """The model FLOPs, the recomputation and the executed FLOPs of a rank of ``pipeline_rank``."""
    tp, cp = layout.tensor_parallel_size, layout.context_parallel_size
    tokens = workload.global_batch_size // layout.data_parallel_size * workload.seq_length / cp
    layers = pipeline_rank_layers(shape, layout, pipeline_rank)
    last = pipeline_rank == layout.pipeline_parallel_size - 1
    gemm = layer_gemm_flops(shape) / tp
    core_full, core_sliding = (part / tp for part in attention_core_parts(shape, workload.seq_length))
    core = core_full + core_sliding
    logits = 2 * shape.hidden_size * shape.vocab_size / tp if last else 0.0
    model = 3 * tokens * (layers * (gemm + core) + logits)
    mode = layout.activation_checkpointing
    down_projection = 2 * shape.ffn_size * shape.hidden_size * shape.dense_layers / shape.num_layers / tp
    recomputed_gemm = gemm - down_projection if mode == "full" else 0.0
    recomputed_core = core if mode != "none" else 0.0
    recomputation = tokens * layers * (recomputed_gemm + recomputed_core)
    computed_blocks = (cp + 1) / (2 * cp) if shape.causal and cp > 1 else 1.0
    padded = 2 * shape.attention_width / (shape.qk_head_dim + shape.v_head_dim)  # MLA's kernel runs padded heads
    core_executed = (core_full * computed_blocks + core_sliding) * padded * (1 + FLASH_BACKWARD + (mode != "none"))
    executed = tokens * (layers * (3 * gemm + recomputed_gemm + core_executed) + 3 * logits)
    return RankFlops(model, recomputation, executed)

