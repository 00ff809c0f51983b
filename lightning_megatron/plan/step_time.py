"""A step's time from a roofline: what each GPU computes and moves, at the rates the hardware sustains.

For the slowest pipeline rank and one micro-batch of ``T = micro_batch_size * seq_length / cp`` tokens:

* **compute**: the GEMMs of its layers' linears (``qkv``, ``proj``, the MLP's or the experts' matrices, each
  ``/ tp``; forward, and backward's two GEMMs of the same FLOPs; the forward again under ``full`` recomputation or
  ``Workload.recomputed_gemm_share`` of it) and the logits on the last rank, each at ``matmul_efficiency`` of the
  dense peak times its shape's wave efficiency (``plan.gemm``), the linears at the FP8 peak and ``fp8_efficiency``
  under ``Workload.fp8``; attention's ``Q K^T`` and ``P V`` (again under either recomputation) at
  ``attention_efficiency`` (flash kernels, which skip causal attention's masked half; materialised scores: batched
  GEMMs at ``matmul_efficiency``); plus the element-wise kernels (norms, residual adds, dropout, the activation,
  rotary, head transposes, the vocab-parallel cross-entropy, final-logit soft-capping) as bytes at ``memory_efficiency`` of the
  memory bandwidth, ``/ tp`` where sequence parallelism splits them;
* **tensor parallel**: Megatron's two all-reduces per layer forward and two backward (one more in a
  recomputed forward), or under sequence parallelism the all-gathers and reduce-scatters moving the same
  bytes and the column inputs gathered again in backward, plus the embedding's, the head's and the
  cross-entropy's, over NVLink while ``tp x cp`` fits in a node; not overlapped (this package does not), but
  under ``Workload.overlap_tensor_parallel`` (another framework's published run) overlapped with the GEMMs;
* **context parallel**: the ring's key/value blocks (forward ``cp - 1`` hops, backward ``cp - 1`` and the
  ``cp`` hops of their gradients), overlapped with the attention blocks' compute;
* **expert parallel**: the MoE layers' four all-to-alls per micro-batch (dispatch and combine, forward and
  backward), over the network when the expert group leaves the node;
* **pipeline**: one send forward and one backward of the stage's output per micro-batch and virtual
  stage (none forward from the last stage, none backward from the first), and the bubble: the step takes ``(m + (p - 1) / v)`` micro-batch times instead of ``m``;
* **data parallel**: the gradient reduction over dp x cp (all-reduce; reduce-scatter under ZeRO), which
  the strategy overlaps with the last micro-batch's backward (ZeRO-2: every micro-batch's), so only its
  excess and its last bucket show; ZeRO 1/2's all-gather of the updated parameters after the step (not
  overlapped; under ``overlap_param_gather`` overlapped with the first micro-batch's forward, its first bucket
  exposed); ZeRO-3's per-layer gathers and reduce-scatters each micro-batch, prefetched under compute;
* **optimizer**: Adam's element-wise update of the rank's owned fp32 elements at memory bandwidth, or, under an
  offload tier, on the host: the node's CPUs step all its ranks' owned elements at ``host_optimizer_rate``;
* **host transfers** (PCIe, ``host_bandwidth`` per GPU): the optimizer tiers move the owned gradients to the
  host (fp32) and the updated parameters back after the backward, not overlapped; ZeRO-3's parameter tiers
  bring the fp32 shards in for the forward and again for the backward and send the fp32 gradient shards out,
  every micro-batch, prefetched under its compute;
* **disk** (``"nvme"``, ZeRO 0-2, the node's one drive shared by its ranks): the step reads and writes the stored
  state once (main parameters and optimizer state) through the tile pool, which overlaps it with the CPU's Adam,
  so only its excess over that shows; the fp32 gradients go through a file of their own (written, then read).

The bytes and calls of every collective are ``plan.communication.step_collectives``'s (the formula
``python -m benchmarks.memory formulas`` checks against each rank's ``c10d`` ops); the pipeline's sends are those of the rank that
sends the most. Overlapped communication is hidden by at most ``overlap_efficiency`` of the compute it runs under (NCCL's
kernels slow the compute they share the GPU with). Every collective also pays ``collective_latency``. A ring collective over ``k`` ranks moves
``2 (k - 1) / k`` (all-reduce) or ``(k - 1) / k`` (all-gather, reduce-scatter) of its bytes per rank at the
group's bus bandwidth: NVLink when the group sits in a node, else the per-GPU share of the network (times the
group's members per node for a data-parallel ring, which leaves each node once per direction).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lightning_megatron.parallel.shards import padded_size
from lightning_megatron.plan.communication import Collective, step_collectives
from lightning_megatron.plan.flops import attention_core_flops, pipeline_rank_layers
from lightning_megatron.plan.gemm import layer_linears, linear_seconds
from lightning_megatron.plan.hardware import Hardware
from lightning_megatron.plan.layout import Layout, Workload
from lightning_megatron.plan.shape import ModelShape

#: Bytes per score element and 16-bit byte of a materialised attention's forward: the scores' write by Q K^T, the
#: fused scale + mask + softmax's read and write, dropout's read, write and mask, P V's read.
MATERIALIZED_SCORE_BYTES = 10
ADAM_BYTES_PER_ELEMENT = 36  # fp32 main param read + write, gradient read, two moments read + write, + slack


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step, by cause (each the part that does not overlap with compute)."""

    compute: float
    tensor_parallel: float
    context_parallel: float
    expert_parallel: float
    pipeline_p2p: float
    bubble: float
    data_parallel: float
    optimizer: float
    host_transfers: float = 0.0
    disk: float = 0.0

    @property
    def total(self) -> float:
        return sum(asdict(self).values())

    def parts(self) -> dict[str, float]:
        return asdict(self)


def step_time(shape: ModelShape, layout: Layout, workload: Workload, hardware: Hardware,
              model_state: dict[str, int], *, state_bytes_per_element: int = 8) -> StepTime:
    """The predicted step time of ``layout`` (``model_state``: the rank's ``model_state_bytes``;
    ``state_bytes_per_element``: the optimizer's, AdamW's 8 by default)."""
    tp, pp, cp, vpp = (layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.context_parallel_size,
                       layout.virtual_pipeline_size)
    w = workload.compute_bytes
    tokens = layout.micro_batch_size * workload.seq_length // cp
    micro_batches = layout.micro_batches(workload)
    slowest = _slowest_rank(shape, layout)
    layers = pipeline_rank_layers(shape, layout, slowest)
    node = hardware.gpus_per_node
    tp_link = _bandwidth(hardware, tp * cp <= node)
    flops_rate = hardware.flops(workload.sixteen_bit_compute)
    memory_rate = hardware.memory_bandwidth * hardware.memory_efficiency

    # ---- compute of one micro-batch on the slowest rank
    # Soft-capped scores (models.softcap) are materialised whatever the workload says.
    flash = workload.attention == "flash" and not shape.softcap
    core = attention_core_flops(shape, workload.seq_length, skip_masked_half=flash) / tp
    # Flash attention's fused kernels reach attention_efficiency of the peak; materialised scores are batched GEMMs.
    core_rate = hardware.peak(workload.sixteen_bit_compute) * hardware.attention_efficiency if flash else flops_rate
    vocab = padded_size(shape.vocab_size, tp, workload.pad_vocab_to_multiple_of) / tp  # this rank's logits
    recomputed_core = core if layout.activation_checkpointing != "none" else 0.0
    gemm_seconds = _gemm_seconds(shape, layout, workload, hardware, tokens, layers, vocab)
    attention = tokens * layers * (3 * core + recomputed_core)
    elementwise_forward = _layer_elementwise_bytes(shape, layout, w)
    if not flash:  # the a x s scores of each token, /tp: written, soft-maxed, dropped
        elementwise_forward += MATERIALIZED_SCORE_BYTES * shape.num_heads * workload.seq_length / tp * w / 2
    # The cross-entropy's fp32 passes over this rank's logits; soft-capping's three element-wise ops read and write
    # them once in forward, twice in backward.
    head_elementwise = (20 + (18 * w if shape.logit_softcap else 0)) * vocab
    elementwise = tokens * (layers * elementwise_forward * (3 + (layout.activation_checkpointing == "full"))
                            + head_elementwise)
    compute_mb = gemm_seconds + attention / core_rate + elementwise / memory_rate

    # ---- communication: the bytes and calls of plan.communication, per micro-batch
    collectives = step_collectives(shape, layout, workload, model_state, pipeline_rank=slowest)
    tp_bytes, tp_calls = _per_micro_batch(collectives, "tp", micro_batches)
    tp_mb = tp_bytes / tp_link + tp_calls * hardware.collective_latency  # not overlapped (this package's tp)
    if workload.overlap_tensor_parallel:  # another framework's: split into chunks under the layer's GEMMs
        tp_mb = _exposed(tp_mb, gemm_seconds, hardware)

    # ---- context parallel ring, overlapped with the attention blocks (K and V travel together: one latency a hop)
    cp_bytes, cp_calls = _per_micro_batch(collectives, "cp", micro_batches)
    attention_compute = layers * tokens * 3 * core / core_rate
    cp_mb = _exposed(cp_bytes / tp_link + cp_calls / 2 * hardware.collective_latency, attention_compute, hardware) \
        if cp > 1 else 0.0

    # ---- expert parallel all-to-alls
    ep_bytes, ep_calls = _per_micro_batch(collectives, "ep", micro_batches)
    ep_link = _bandwidth(hardware, tp * cp * layout.expert_parallel_size <= node)
    ep_mb = ep_bytes / ep_link + ep_calls * hardware.collective_latency

    # ---- pipeline point-to-point (the rank that sends the most: a middle one) and bubble
    p2p_mb = 0.0
    if pp > 1:
        link = _bandwidth(hardware, tp * cp * layout.data_parallel_size * pp <= node)
        p2p_mb = max(bytes_ / link + calls * hardware.collective_latency for bytes_, calls in (
            _per_micro_batch(step_collectives(shape, layout, workload, model_state, pipeline_rank=rank), "pp",
                             micro_batches) for rank in range(pp)))
    micro_batch_time = compute_mb + tp_mb + cp_mb + ep_mb
    compute, tensor, context, expert = (micro_batches * t for t in (compute_mb, tp_mb, cp_mb, ep_mb))
    bubble = (pp - 1) / vpp * (micro_batch_time + p2p_mb) if pp > 1 else 0.0

    # ---- data parallel and the optimizer
    data = _data_parallel(layout, workload, hardware, model_state, collectives, micro_batches, compute_mb,
                          micro_batch_time)
    owned = model_state["optimizer_state"] / state_bytes_per_element  # fp32 elements this rank steps
    if layout.offload_tier == "none":
        offloaded = (owned * ADAM_BYTES_PER_ELEMENT / memory_rate, 0.0, 0.0)
    else:
        offloaded = _offloaded_step(layout, workload, hardware, model_state, owned, micro_batches, micro_batch_time)
    return StepTime(compute, tensor, context, expert, micro_batches * p2p_mb, bubble, data, *offloaded)


def _gemm_seconds(shape: ModelShape, layout: Layout, workload: Workload, hardware: Hardware, tokens: int,
                  layers: int, vocab: float) -> float:
    """Seconds of one micro-batch's GEMMs on the slowest rank: its layers' linears (FP8 under ``workload.fp8``;
    forward again under full recomputation or ``recomputed_gemm_share``) and the 16-bit head, each at its shape's
    efficiency (``plan.gemm``)."""
    sixteen_bit = hardware.flops(workload.sixteen_bit_compute)
    layer_rate = hardware.fp8_flops() if workload.fp8 else sixteen_bit
    passes = 1 + (1.0 if layout.activation_checkpointing == "full" else workload.recomputed_gemm_share)
    seconds = 0.0
    for rows, inputs, outputs, count in layer_linears(
            shape, layout.tensor_parallel_size, layout.expert_parallel_size, tokens,
            expert_tensor_parallel_size=layout.expert_tensor_parallel):
        seconds += layers * count * sum(linear_seconds(rows, inputs, outputs, layer_rate, hardware, passes=passes))
    head = [(shape.hidden_size, vocab)] + ([(shape.hidden_size, shape.hidden_size)] if shape.head_transform else [])
    return seconds + sum(sum(linear_seconds(tokens, i, o, sixteen_bit, hardware)) for i, o in head)


def _per_micro_batch(collectives: list[Collective], group: str, micro_batches: int) -> tuple[float, float]:
    """Bytes sent and calls over ``group`` per micro-batch."""
    mine = [c for c in collectives if c.group == group]
    return sum(c.sent for c in mine) / micro_batches, sum(c.calls for c in mine) / micro_batches


def _slowest_rank(shape: ModelShape, layout: Layout) -> int:
    """The pipeline rank with the most layers (the last of them: it also runs the head)."""
    layers = [pipeline_rank_layers(shape, layout, rank) for rank in range(layout.pipeline_parallel_size)]
    return max(range(len(layers)), key=lambda rank: (layers[rank], rank))


def _exposed(communication: float, concurrent_compute: float, hardware: Hardware) -> float:
    """What shows of ``communication`` overlapped with ``concurrent_compute``: the compute hides at most
    ``overlap_efficiency`` of itself."""
    return communication - hardware.overlap_efficiency * min(communication, concurrent_compute)


def _bandwidth(hardware: Hardware, inside_node: bool) -> float:
    return hardware.intra_node_bandwidth if inside_node else hardware.inter_node_bandwidth


def _layer_elementwise_bytes(shape: ModelShape, layout: Layout, w: int) -> float:
    """Bytes per token the element-wise kernels of one layer's forward read and write (backward: twice that)."""
    tp = layout.tensor_parallel_size
    h = shape.hidden_size
    sequence_split = tp if layout.sequence_parallel else 1  # norms, residuals and dropout run on T / tp tokens
    norms = 2 * shape.norms_per_layer * h  # each norm reads and writes the hidden state
    replicated = (norms + 6 * h + (5 * h if shape.dropout > 0 else 0)) * w / sequence_split
    width = shape.ffn_size if not shape.moe_layers else shape.top_k * shape.expert_ffn_size
    activation = (3 if shape.gated_mlp else 2) * width / tp * w
    heads = (2 * (shape.num_heads + 2 * shape.query_groups) + 2 * shape.num_heads) * shape.attention_width / tp * w
    rotary = 2 * (shape.num_heads + shape.query_groups) * shape.head_dim / tp * w if shape.rotary else 0
    if shape.mla is not None:  # the rope channels of every query head and of the one shared key
        rotary = 2 * (shape.num_heads / tp + 1) * shape.mla.qk_rope_head_dim * w if shape.rotary else 0
    return replicated + activation + heads + rotary


def _data_parallel(layout: Layout, workload: Workload, hardware: Hardware, model_state: dict[str, int],
                   collectives: list[Collective], micro_batches: int, compute_mb: float,
                   micro_batch_time: float) -> float:
    """Exposed seconds of the gradient reduction and (ZeRO 1-3) the parameter gathers over dp x cp (their bytes:
    ``collectives``, ``plan.communication``'s)."""
    n = layout.replica_size
    if n == 1:
        return 0.0
    inner = layout.tensor_parallel_size * layout.context_parallel_size  # the mesh dims inside dp
    if inner * layout.data_parallel_size <= hardware.gpus_per_node:
        bandwidth = hardware.intra_node_bandwidth
    else:  # a ring with k members per node leaves each node once per direction: k times a GPU's network share
        members_per_node = max(1, min(layout.data_parallel_size, hardware.gpus_per_node // inner))
        bandwidth = min(hardware.intra_node_bandwidth, hardware.inter_node_bandwidth * members_per_node)
    latency = hardware.collective_latency
    replicas = [c for c in collectives if c.group in ("dp", "edp")]
    reduced = sum(c.sent for c in replicas if c.kind != "all_gather")
    gathered = sum(c.sent for c in replicas if c.kind == "all_gather")
    backward_window = compute_mb * 2 / 3  # the last micro-batch's backward, which the buckets overlap
    if layout.zero_stage == 3:
        per_micro_batch = (reduced + gathered) / micro_batches / bandwidth + 3 * latency
        return micro_batches * _exposed(per_micro_batch, micro_batch_time, hardware)
    reductions = micro_batches if layout.zero_stage == 2 else 1
    gradients = model_state["gradients"] * (n if layout.zero_stage == 2 else 1)
    bucket_share = min(1.0, workload.bucket_size_mb * 2**20 / gradients) if gradients else 1.0
    reduce = reduced / reductions / bandwidth
    last_bucket = bucket_share * reduce + latency
    exposed = reductions * max(last_bucket, _exposed(reduce, backward_window, hardware))
    if layout.zero_stage in (1, 2):  # the updated parameters, all-gathered after the step
        gather = gathered / bandwidth + latency
        if layout.overlap_param_gather:  # bucket by bucket under the next forward; the first one is waited for
            first_bucket = bucket_share * gathered / bandwidth
            gather = max(first_bucket + latency, _exposed(gather, compute_mb / 3, hardware))
        exposed += gather
    return exposed


def _offloaded_step(layout: Layout, workload: Workload, hardware: Hardware, model_state: dict[str, int],
                    owned: float, micro_batches: int, micro_batch_time: float) -> tuple[float, float, float]:
    """Seconds of the host's Adam, of the exposed PCIe copies and of the exposed disk traffic of an offload tier."""
    ranks_on_node = min(layout.world_size, hardware.gpus_per_node)  # they share the node's CPUs and disk
    cpu_adam = ranks_on_node * owned / hardware.host_optimizer_rate
    if layout.zero_stage == 3:  # the fp32 shards in for the forward and the backward, the gradient shards out
        pcie = (2 * model_state["parameters"] + model_state["gradients"]) / hardware.host_bandwidth
        return cpu_adam, micro_batches * _exposed(pcie, micro_batch_time, hardware), 0.0
    transfers = owned * (4 + workload.parameter_bytes) / hardware.host_bandwidth  # gradients out, parameters in
    if layout.offload_tier != "nvme":
        return cpu_adam, transfers, 0.0
    # Main parameters, optimizer state and the fp32 gradients: written and read once, tile by tile, under the step.
    stored = model_state["main_parameters"] + model_state["optimizer_state"] + 4 * owned
    rates = 1 / hardware.disk_read_bandwidth + 1 / hardware.disk_write_bandwidth
    return cpu_adam, transfers, max(0.0, ranks_on_node * stored * rates - cpu_adam)
