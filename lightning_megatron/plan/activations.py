"""Activation memory per GPU: Korthikanti et al. 2022's accounting, term by term for this package's layers.

Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer Models", 2022) count, per
layer and token, the tensors autograd keeps for backward: ``34 h`` bytes at 16 bits for a GPT-2 layer
(layer norms 4h, attention 11h, MLP 19h) plus ``5 a s`` for the materialised scores, divided by ``t``
where tensor and sequence parallelism split them, ``2 h`` under full recomputation. Our layers keep
different tensors (flash attention: no ``s x s`` scores, but its output and log-sum-exp; no dropout mask
when dropout is off; SwiGLU's gate and up; rotary's rotated queries and keys; grouped-query key/value
heads), so the terms are this package's, counted in elements per token (``w`` bytes each, the compute
dtype, unless noted) for tensor-parallel size ``t`` and ``q = t`` under sequence parallelism, else 1:

==================================  =====================================  ==============================
tensor (who keeps it)               elements per token                     split by
==================================  =====================================  ==============================
norm inputs (2 norms; 4 sandwiched)  ``2 h`` (+ fp32 mean/rstd per norm)    ``q``
qkv input, fc input                 ``2 h``                                ``q`` (under SP only the sequence
                                                                           chunk is kept, gathered again in
                                                                           backward)
q, k, v (SDPA's inputs)             ``(a + 2 g) d``: the ``qkv`` output,   ``t``
                                    or with rotary the rotated q, k and a
                                    compact v (the ``qkv`` output is
                                    freed; cos/sin are not kept)
attention output + log-sum-exp      ``a d`` (+ ``a`` fp32)                 ``t``; recomputed: selective
proj input                          ``a d``                                ``t``
MLP (GELU: fc out, GELU out)        ``2 f``; SwiGLU ``4 f`` (gate|up, silu,    ``t``
                                    product)
MoE MLP (instead)                   ``top_k (3 h + MLP of f_e)``: the        ``t`` (the experts')
                                    arrived copies, the returned ones and
                                    their weighted view; the router's
                                    fp32 ``2 E + 2 top_k + 2`` and int64
                                    ``4 top_k`` (scores, ids, indices)
dropout masks (dropout > 0)         ``2 h`` bytes                          ``q``
q/k norms (``qk_layernorm``)        ``(a + g) d`` fp32 inputs and ``w``    ``t``
                                    outputs, an fp32 rstd per head
soft-capped attention               ``a s`` tanh outputs (``w``), fp32     ``t``; recomputed: selective
(``attn_logit_softcapping``)        softmax and ``w`` probabilities, ``s``
                                    mask bytes, ``2 (a - g) d`` repeated
                                    keys/values; no log-sum-exp
==================================  =====================================  ==============================

Multi-head latent attention (``GPTConfig.mla``) keeps, in place of the ``q, k, v`` and attention rows: its latents'
norms (as the layer's, on ``r_q + r_kv`` channels, split by ``q``), the latents and the shared rotary key that
enter the tensor-parallel region (``r_q + r_kv + r``, not split: every rank's heads read them), the kernel's ``q, k,
v`` and output on heads padded to the wider of ``qk_head_dim`` and ``v_head_dim`` (``/ t``), and ``proj``'s input
(``a v / t``).

Sliding windows change what attention computes, not what it keeps: no term here (``plan.flops`` counts them).

RMSNorm (``models.norms``, unfused) keeps more than the fused LayerNorm: its input in fp32 (``4 h`` bytes per norm)
besides the normalised input (``h``, the ``norm inputs`` row) and rstd. The zero-centred RMSNorm (Gemma's, ``(1 + w)``
applied in fp32) keeps its normalised input in fp32 (``4 h`` bytes, not ``w h``), the q/k norms' too. Sandwich norms
(``norm_position="sandwich"``) are two more norms per layer, on the attention's and the MLP's outputs (under SP their
sequence chunk).

Full recomputation keeps only each layer's input (``h / q``). The first pipeline stage adds the
embedding's token ids (8 bytes); the last the final norm's input, the head's input, the logits
(``V / t``) and the vocab-parallel cross-entropy's fp32 softmax (with final-logit soft-capping also the ``tanh``'s
output, ``V / t`` in the compute dtype), or with the chunked loss (``loss_chunk_tokens``)
the final norm's input and output and two fp32 numbers per token, the logits living one chunk at a time.

Pipelining holds several micro-batches at once: under 1F1B pipeline rank ``r`` of ``p`` holds
``min(p - r, m)`` micro-batches of its layers; interleaved 1F1B (``v`` virtual stages) Megatron's warmup
``2 (p - r - 1) + (v - 1) p + 1`` virtual stages, i.e. ``that / v`` micro-batches of all its layers; GPipe
all ``m``. Without pipelining one micro-batch (``micro_batch_size``) is alive at a time.

The peak comes in backward, on top of what is kept: the gradient of the residual stream and of the
layer being differentiated, and under full recomputation that layer's recomputed activations.
"""

from __future__ import annotations

from typing import Optional

from lightning_megatron.parallel.shards import padded_size
from lightning_megatron.pipeline.layout import SCHEDULE_SPECS, rank_of_stage
from lightning_megatron.plan.hardware import GIB
from lightning_megatron.plan.layout import Layout, Workload
from lightning_megatron.plan.shape import ModelShape

#: CUDA context, cuBLAS and NCCL workspaces, allocator slack: a stated allowance, not a prediction.
FRAMEWORK_BYTES = 2 * GIB


def layer_saved_bytes(shape: ModelShape, layout: Layout, w: int, mode: Optional[str] = None, *,
                      seq_length: Optional[int] = None) -> float:
    """Bytes per token one layer keeps for backward (the table in the module docstring); ``mode``: the
    recomputation (default: the layout's); ``seq_length``: the sequence, which soft-capped attention's kept scores
    grow with (needed only then)."""
    t = layout.tensor_parallel_size
    q = t if layout.sequence_parallel else 1
    h, a, g, d = shape.hidden_size, shape.num_heads, shape.query_groups, shape.head_dim
    kv_heads = max(g, t)  # key/value heads are replicated when tp exceeds them
    mode = mode or layout.activation_checkpointing
    if mode == "full":
        return h / q * w
    n = shape.norms_per_layer
    normed = 4 if shape.zero_centered_norms else w  # the bytes of a norm's normalised input, which its gain's product keeps
    norms = n * (h * normed + (4 if shape.rms_norm else 8)) / q
    inputs = 2 * h * w / q  # the column layers' inputs: under SP their sequence chunk (tensor_parallel.sequence_column)
    qkv = (a + 2 * kv_heads) * d / t * w
    attention_out = a * d / t * w  # the flash kernel's output, a view of which proj keeps
    lse = a / t * 4 if mode == "none" else 0.0
    mlp = _mlp_saved(shape, t, layout.expert_tensor_parallel) * w + _router_saved_bytes(shape)
    masks = 2 * h / q if shape.dropout > 0 else 0.0
    # RMSNorm (models.norms) also keeps its input in fp32 (4 bytes; besides the normalised input in ``norms``).
    norm_fp32_inputs = n * h * 4 / q if shape.rms_norm else 0.0
    # Per-head q/k RMSNorms (Qwen3's): each keeps its fp32 input and normalised output and an rstd per head
    # (measured in bf16; in fp32 the input is a view that keeps the whole qkv output alive, a little more).
    qk_norms = (a + kv_heads) / t * (d * (4 + normed) + 4) if shape.qk_norm else 0.0
    if shape.softcap and mode != "selective":
        qkv, lse = qkv + _softcapped_extra(shape, t, w, seq_length), 0.0
    if shape.mla is not None:
        qkv, attention_out = _latent_attention_saved(shape, t, q, w, mode, normed), 0.0
    return norm_fp32_inputs + norms + inputs + qkv + attention_out + lse + mlp + masks + qk_norms


def _latent_attention_saved(shape: ModelShape, t: int, q: int, w: int, mode: str, normed: float) -> float:
    """Bytes per token multi-head latent attention (``models.latent_attention``) keeps besides the layer's input:
    the latents' norms (as the layer's norms: an fp32 input under RMSNorm, the normalised input, the rstd; on the
    sequence chunk under SP), the latents and the rotary key entering the tensor-parallel region (``r_q + r_kv + r``,
    whole sequence: the up projections and rotary keep views of it), the kernel's ``q, k, v`` of this rank's heads
    padded to the wider width (a ``v`` that needs no padding is a view of ``kv_up``'s output, whose keys it keeps
    too), its output (kept by the kernel, not under recomputation) and ``proj``'s input (the output cut to
    ``v_head_dim``, made contiguous)."""
    mla, heads, width = shape.mla, shape.num_heads / t, shape.attention_width
    latents = [mla.kv_lora_rank] + ([] if mla.q_lora_rank is None else [mla.q_lora_rank])
    per_norm = 4 if shape.rms_norm else 8
    norms = sum(r * (normed + (4 if shape.rms_norm else 0)) + per_norm for r in latents) / q
    entered = (sum(latents) + mla.qk_rope_head_dim) * w
    values = width if mla.v_head_dim < mla.qk_head_dim else mla.qk_nope_head_dim + mla.v_head_dim
    kernel = heads * (2 * width + values + (width if mode == "none" else 0)) * w
    return norms + entered + kernel + heads * mla.v_head_dim * w


def _softcapped_extra(shape: ModelShape, t: int, w: int, seq_length: Optional[int]) -> float:
    """What soft-capped attention (``models.softcap``) keeps beyond the flash path's ``q, k, v`` and output, per token:
    for each of its ``a / t`` heads and ``s`` keys the tanh's output (``w``), the fp32 softmax's and the probabilities
    in ``w`` (the same tensor in fp32), the ``s`` booleans of the mask (one per query and key, shared by the heads),
    and keys and values repeated for every query head (``2 (a - g) d``, grouped-query); no log-sum-exp."""
    if seq_length is None:
        raise ValueError("Soft-capped attention keeps its [s, s] scores: layer_saved_bytes needs seq_length.")
    a, d = shape.num_heads / t, shape.head_dim
    kv_heads = max(shape.query_groups, t) / t
    scores = a * seq_length * (w + 4 + (w if w != 4 else 0)) + seq_length
    return scores + 2 * (a - kv_heads) * d * w


def _mlp_saved(shape: ModelShape, t: int, etp: Optional[int] = None) -> float:
    """Elements per token an MLP keeps: GELU fc's output and the GELU's (2 f); SwiGLU the gate|up output, the
    SiLU's and the product (4 f; the SiLU's input is a view of gate|up; measured on ``models.mlp.GatedMLP``). An MoE
    layer's experts keep that of each of the ``top_k`` copies of a token, and the layer the copies that arrive, the
    ones that come back and their weighted view (``3 h`` each; measured on ``models.moe.MoE``)."""
    per_width = 4 if shape.gated_mlp else 2
    if not shape.moe_layers:
        return per_width * shape.ffn_size / t
    dense = per_width * shape.ffn_size / t
    etp = etp or t  # whole experts (etp 1): each tp rank takes 1/t of the copies, at the experts' whole width
    moe = shape.top_k * etp / t * (3 * shape.hidden_size + per_width * shape.expert_ffn_size / etp) \
        + per_width * shape.shared_expert_size / t
    return (shape.dense_layers * dense + shape.moe_layers * moe) / shape.num_layers


def _router_saved_bytes(shape: ModelShape) -> float:
    """Bytes per token an average layer's router keeps (MoE layers only): fp32 scores and probabilities
    (``2 E``), the chosen weights (twice) and two per-token sums; int64 expert ids and the dispatch's indices. A
    sigmoid router also keeps the sum its scores are normalised by; group-limited routing (``models.router``) the
    indices of each group's two best scores and of the kept groups (int64) and the groups' mask (bool), measured."""
    per_moe_layer = (2 * shape.num_experts + 2 * shape.top_k + 2) * 4 + 4 * shape.top_k * 8
    per_moe_layer += 4 * shape.sigmoid_router
    if shape.router_groups:
        per_moe_layer += (2 * shape.router_groups + shape.router_group_topk) * 8 + shape.router_groups
    return per_moe_layer * shape.moe_layers / shape.num_layers


def _mlp_gradient(shape: ModelShape, t: int) -> float:
    """Elements per token of the widest gradient an MLP's backward makes (fc's output's)."""
    width = shape.expert_ffn_size * shape.top_k if shape.moe_layers else shape.ffn_size
    return (2 if shape.gated_mlp else 1) * width / t


def in_flight(layout: Layout, workload: Workload, pipeline_rank: int) -> float:
    """Micro-batches (in units of the rank's whole layer set) whose activations the rank holds at its peak."""
    pp = layout.pipeline_parallel_size
    if pp == 1:
        return 1.0
    micro_batches = layout.micro_batches(workload)
    if layout.pipeline_schedule == "gpipe":
        return float(micro_batches)
    if layout.virtual_pipeline_size > 1:
        vpp = layout.virtual_pipeline_size
        virtual = 2 * (pp - pipeline_rank - 1) + (vpp - 1) * pp + 1
        return min(virtual, micro_batches * vpp) / vpp
    return float(min(pp - pipeline_rank, micro_batches))


def activation_bytes(shape: ModelShape, layout: Layout, workload: Workload, *, pipeline_rank: int = 0) -> int:
    """Peak bytes of activations (and the transients at the peak) on that pipeline rank."""
    w = workload.compute_bytes
    t, pp = layout.tensor_parallel_size, layout.pipeline_parallel_size
    q = t if layout.sequence_parallel else 1
    h = shape.hidden_size
    tokens = layout.micro_batch_size * workload.seq_length / layout.context_parallel_size
    first, last = pipeline_rank == 0, pipeline_rank == pp - 1
    vocab = padded_size(shape.vocab_size, t, workload.pad_vocab_to_multiple_of) / t  # this rank's logits
    # Gradients reach buffers, or accumulate over passes, so the head's weight gradient is made apart from them.
    grad_apart = layout.data_parallel_size * layout.context_parallel_size > 1 or layout.micro_batches(workload) > 1
    head, loss, last_output = _head_and_loss(shape, tokens, vocab, h, w, q, grad_apart) if last else (0.0, 0.0, 0.0)
    seq = workload.seq_length
    flight = in_flight(layout, workload, pipeline_rank)
    layers = shape.num_layers / pp * layer_saved_bytes(shape, layout, w, seq_length=seq) + (8.0 if first else 0.0)
    kept = tokens * layers * flight
    chunked = pp > 1 and layout.virtual_pipeline_size > 1 and SCHEDULE_SPECS[layout.pipeline_schedule].placement != "v"
    if chunked and last:
        # Interleaved: the head and the loss belong to the last virtual stage, whose 1F1B holds one micro-batch at a
        # time; every other chunk in flight keeps its output (torch's stage, for its backward). (simulate: the 70B's
        # last stage was planned 2.3 GiB over.)
        chunks = flight * layout.virtual_pipeline_size
        kept += tokens * (head + last_output + h * w / q * max(0.0, chunks - 1))
    else:
        kept += tokens * head * flight
        if pp > 1:  # torch's pipeline stage keeps each in-flight micro-batch's output for its backward
            kept += tokens * (last_output if last else h * w / q) * flight * (layout.virtual_pipeline_size if chunked else 1)
    backward = 2 * h * w / q + _mlp_gradient(shape, t) * w  # the residual stream's gradient, the MLP's
    if layout.activation_checkpointing == "full":
        backward += layer_saved_bytes(shape, layout, w, mode="none", seq_length=seq)  # the layer being recomputed
    posted = posted_receive_bytes(layout, workload, pipeline_rank, boundary=tokens * h * w / q)
    return int(kept + max(loss, tokens * (backward - head)) + posted)


def posted_receive_bytes(layout: Layout, workload: Workload, pipeline_rank: int, boundary: float) -> float:
    """Receive buffers posted ahead of their use: a multi-stage schedule under ``overlap_p2p_comm`` (the default)
    posts each receive as early as its action table allows, up to ``pp`` micro-batches ahead for each input of a
    local stage that is not the first and each output gradient of one that is not the last (our stages make a
    micro-batch's buffers when its receive is posted: ``pipeline/runner.py``). ``boundary``: a micro-batch's hidden
    states between two stages, in bytes. Exact on rank 0 of the measured interleaved layouts, 3 buffers over on rank 1."""
    pp, schedule = layout.pipeline_parallel_size, layout.pipeline_schedule
    if pp == 1 or SCHEDULE_SPECS[schedule].virtual == "one":
        return 0.0
    num_stages = pp * (2 if SCHEDULE_SPECS[schedule].placement == "v" else layout.virtual_pipeline_size)
    stages = [stage for stage in range(num_stages) if rank_of_stage(stage, pp, schedule) == pipeline_rank]
    receives = sum(stage != 0 for stage in stages) + sum(stage != num_stages - 1 for stage in stages)
    return receives * min(layout.micro_batches(workload), pp) * boundary


def _head_and_loss(shape: ModelShape, tokens: float, vocab: float, h: int, w: int, q: int,
                   grad_apart: bool) -> tuple[float, float, float]:
    """The last stage's ``(kept bytes per token, the loss's transient bytes, the stage output's bytes per token
    beyond those)``. Unchunked: the final norm's and the head's inputs and the fp32 log-softmax are kept, two more
    fp32 ``[tokens, V/t]`` temporaries come at the loss (three with 16-bit logits: their fp32 copy), and the stage's
    output is the logits. Chunked
    (``loss_chunk_tokens``, ``tensor_parallel.chunked_cross_entropy``): the final norm's input and output (the loss's
    input, also the stage's output), the logits' maximum and sum of exponentials (fp32) and, under sequence
    parallelism, the targets regrouped by rank (int64); the transient is three fp32 chunks of logits in the forward
    (under sequence parallelism ``chunk / q`` tokens of every rank, gathered), two in the backward next to the head's
    weight gradient where it is made apart (``grad_apart``: before the dp buckets or the ``.grad`` accumulated over
    passes take it; else it is the ``.grad``, model state): beside one chunk it is no longer small. Final-logit
    soft-capping keeps the ``tanh``'s output unchunked (``V / t`` in the compute dtype) and adds a third fp32 chunk to
    the chunked backward (the cap's slope, ``1 - tanh^2``)."""
    chunk = getattr(shape.config, "loss_chunk_tokens", None)
    if not chunk:  # the head keeps its input's chunk under SP; 16-bit logits are copied to fp32 first (simulate)
        transient = tokens * (8 + (4 if w < 4 else 0)) * vocab
        return 2 * h * w / q + vocab * 4 + (vocab * w if shape.logit_softcap else 0), transient, vocab * w
    rows = q * min(max(1, chunk // q), tokens / q)
    backward = (12 if shape.logit_softcap else 8) * vocab * rows
    transient = max(12 * vocab * rows, backward + (vocab * h * w if grad_apart else 0))
    return 2 * h * w / q + 8 + (8 if q > 1 else 0), transient, 0.0


def buffer_bytes(shape: ModelShape, layout: Layout, workload: Workload, model_state: dict[str, int]) -> int:
    """What a GPU holds besides model states and activations: ``FRAMEWORK_BYTES``, ZeRO-2's two full-size
    gradient buckets in flight, and ZeRO-3's gathered layers (this one and the prefetched next, in the compute
    dtype, and one layer's fp32 gradients before their reduce-scatter)."""
    extra = FRAMEWORK_BYTES
    if layout.zero_stage == 2:
        extra += 2 * int(workload.bucket_size_mb * 2**20)
    if layout.zero_stage == 3:
        replicas = layout.replica_size
        layer_elements = model_state["parameters"] / 4 * replicas * layout.pipeline_parallel_size / shape.num_layers
        extra += int(layer_elements * (2 * workload.compute_bytes + 4))
    return extra


