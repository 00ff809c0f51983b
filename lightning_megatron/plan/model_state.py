"""A rank's model-state bytes, as ``strategy.model_state_bytes`` reports them after the first step.

The same keys (``optim.main_params.MODEL_STATE_KEYS``) and, byte for byte, the same numbers: the rank's
parameters come from the inventory (its shards, as the strategy builds them), its gradient buckets from
``optim.grad_sync.cut_buckets`` and ``bucket_numel`` (the functions the ``GradientSynchronizer`` lays its
buffers out with, called on meta tensors of the rank's parameters), the fp32 main parameters from
``optim.main_params.uses_main_params`` and the owned slice of each bucket. The paths are the strategy's:

* one replica (dp x cp = 1) without fp32 main parameters: plain ``param.grad`` (``LocalGradients``);
* ZeRO 0-2: flat gradient buckets in the parameters' dtype (padded to a multiple of the group under ZeRO;
  ZeRO-2 keeps only this rank's slice), fp32 main copies of this rank's owned slices unless they are views
  of fp32 parameters, and the optimizer's state for those slices;
* ZeRO-3: FSDP2's dim-0 chunk of every (fp32) parameter, its gradient and its optimizer state; a frozen
  parameter's chunk only, in the parameter dtype. Chunks over dp x cp, an expert's over its expert-data-parallel
  group (``dp / ep`` ranks; ``tp x dp / ep`` with whole experts on each tp rank, ``expert_tensor_parallel_size=1``,
  whose experts the inventory enters whole).

Optimizer state is ``optimizer_state_bytes_per_element`` per element stepped (AdamW: 8).

**Where the bytes live** (:func:`placement`; the report counts them wherever they are). With Ψ' this rank's
owned elements (``optimizer_state / state bytes per element``) and Adam's 12 bytes of main parameter and
moments per owned element:

==============================  =========================  ================================  ===============
tier                            device                     host RAM                          disk
==============================  =========================  ================================  ===============
none                            everything                 0                                 0
``offload_optimizer="cpu"``     parameters + gradients     main + state 12Ψ' + fp32 grads    0
  (ZeRO 0-2)                                               4Ψ' (+ 16-bit early copies 2Ψ'
                                                           at ZeRO 0/1)
``offload_optimizer="nvme"``    parameters + gradients     the pool                          main + state
                                                                                             + fp32 grads
``offload_parameters="cpu"``    0 (gathered layers:        parameters + gradients + state    0
  (ZeRO-3)                      buffers)
==============================  =========================  ================================  ===============

The fp32 host gradients (``MainParamOptimizer.prepare_step`` copies each owned gradient to its main
parameter's device and dtype) live in persistent host buffers (``offload.host_staging``) that the report does
not show; the ``"cpu"`` tier's host memory holds them, and at ZeRO 0/1 with 16-bit parameters also the 16-bit
copies that each bucket sends to the host as soon as its reduction is launched (2Ψ'; buckets with partial sums,
a few norms under sequence parallelism, keep the late copy, so this is an upper bound), the ``"nvme"`` tier keeps them in a file of its own
(``offload.nvme``). ZeRO-3's parameters have no ``"nvme"`` tier (``OffloadSettings.check`` refuses it). The
``"nvme"`` tier walks its files through a pool of 3 tiles (read ahead, step,
write behind) of ``1 + state tensors`` buffers of ``offload_buffer_mb`` each (:func:`nvme_pool_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from lightning_megatron.offload.settings import DEFAULT_BUFFER_MB, OffloadSettings
from lightning_megatron.offload.tiled_step import pool_bytes
from lightning_megatron.optim.grad_sync import bucket_numel, cut_buckets
from lightning_megatron.optim.main_params import uses_main_params
from lightning_megatron.optim.main_params import MODEL_STATE_KEYS
from lightning_megatron.plan.inventory import RankParameter
from lightning_megatron.plan.layout import Layout, Workload

DTYPES = {2: torch.bfloat16, 4: torch.float32}
#: Host RAM a training process takes besides the model state it offloads (Python, torch, CUDA's host side, pinned
#: staging buffers, the data loader): a stated allowance, like the GPU's ``activations.FRAMEWORK_BYTES``.
HOST_PROCESS_BYTES = 4 * 2**30


def rank_model_state_bytes(parameters: Sequence[RankParameter], layout: Layout, workload: Workload, *,
                           state_bytes_per_element: int, data_rank: int = 0, context_rank: int = 0) -> dict[str, int]:
    """``strategy.model_state_bytes`` of the rank at (``data_rank``, ``context_rank``) holding ``parameters``. A
    QLoRA base (``entry.stored_bytes``) is its NF4 pieces, on every replica alike (no parameter: ZeRO-3 leaves it)."""
    quantized = sum(p.entry.stored_bytes for p in parameters if p.entry.stored_bytes is not None)
    state = _dense_model_state_bytes([p for p in parameters if p.entry.stored_bytes is None], layout, workload,
                                     state_bytes_per_element=state_bytes_per_element, data_rank=data_rank,
                                     context_rank=context_rank)
    return {**state, "parameters": state["parameters"] + quantized}


def _dense_model_state_bytes(parameters: Sequence[RankParameter], layout: Layout, workload: Workload, *,
                             state_bytes_per_element: int, data_rank: int, context_rank: int) -> dict[str, int]:
    config = layout
    replicas = config.replica_size
    replica_rank = data_rank * config.context_parallel_size + context_rank
    trainable = [p for p in parameters if p.entry.requires_grad]
    if layout.zero_stage == 3:
        # FSDP2 shards dim 0 of every parameter over the replicas, torch.chunk's way: the trained ones in fp32 (the
        # main parameters), frozen ones (a LoRA base) in the parameter dtype (``preparation.shard_zero3``); the
        # experts over their expert-data-parallel group under expert parallelism (``optim.zero3.shard_experts``).
        ep = config.expert_parallel_size
        expert_rank = config.expert_slot(data_rank, 0) // ep  # tp rank 0's (its expert-data-parallel rank)
        chunk = lambda p: (_fsdp_chunk(p.entry.shape, config.expert_data_parallel_size, expert_rank)  # noqa: E731
                           if ep > 1 and p.entry.expert else _fsdp_chunk(p.entry.shape, replicas, replica_rank))
        grads = sum(chunk(p) for p in trainable)
        frozen = sum(chunk(p) for p in parameters if not p.entry.requires_grad)
        return {"parameters": 4 * grads + workload.parameter_bytes * frozen, "gradients": 4 * grads,
                "main_parameters": 0, "optimizer_state": state_bytes_per_element * grads}
    element = workload.parameter_bytes
    params = [_meta_parameter(p, element) for p in parameters]
    stepped = [param for param in params if param.requires_grad]
    parameter_bytes = sum(p.numel() * element for p in params)
    offload = layout.offload_optimizer != "none"
    main = uses_main_params(stepped, layout.zero_stage, OffloadSettings(layout.offload_optimizer))
    if replicas == 1 and not main:  # LocalGradients: param.grad, the optimizer on the parameters themselves
        grads = sum(p.numel() for p in stepped)
        return {"parameters": parameter_bytes, "gradients": grads * element, "main_parameters": 0,
                "optimizer_state": state_bytes_per_element * grads}
    ep = config.expert_parallel_size
    group_of = (lambda p: "experts" if p.expert_parallel else "dense") if ep > 1 else (lambda p: "dense")
    sizes = {"dense": replicas, "experts": config.expert_data_parallel_size}
    ranks = {"dense": replica_rank, "experts": config.expert_slot(data_rank, 0) // ep}
    own_bucket = {id(p) for p in stepped if p.pipeline_tied}
    gradient_bytes = owned_elements = 0
    for bucket in cut_buckets(stepped, bucket_bytes=int(workload.bucket_size_mb * 2**20), group_of=group_of,
                              own_bucket=own_bucket):
        total = sum(p.numel() for p in bucket)
        group = group_of(bucket[0])
        numel, shard = bucket_numel(total, sizes[group], layout.zero_stage)
        gradient_bytes += (shard if layout.zero_stage == 2 else numel) * element
        start = ranks[group] * shard if layout.zero_stage else 0
        owned_elements += max(0, min(start + shard, total) - start)  # the padding is owned by nobody
    shares = element == 4 and not offload  # fp32 pieces are views of the parameters
    return {"parameters": parameter_bytes, "gradients": gradient_bytes,
            "main_parameters": 0 if (not main or shares) else 4 * owned_elements,
            "optimizer_state": state_bytes_per_element * owned_elements}


@dataclass(frozen=True)
class Placement:
    """A rank's bytes by where they live: the model state on the ``device``, and the offload tiers' ``host`` RAM
    (offloaded state, fp32 host gradients, the ``"nvme"`` pool) and ``disk`` (the ``"nvme"`` tier's files)."""

    device: int
    host: int
    disk: int


def placement(state: dict[str, int], layout: Layout, *, state_bytes_per_element: int,
              buffer_mb: float = DEFAULT_BUFFER_MB, gradient_bytes_per_element: int = 4, resident: int = 0) -> Placement:
    """Where ``state`` (``rank_model_state_bytes``) lives under ``layout``'s offload tier (the module's table).
    ``gradient_bytes_per_element``: the parameters' (and so the gradient buckets') element size. ``resident``: bytes
    of ``state["parameters"]`` that stay on the device under every tier (a QLoRA base: no parameter, which ZeRO-3's
    parameter offload does not move)."""
    tier = layout.offload_tier
    if tier == "none":
        return Placement(sum(state[key] for key in MODEL_STATE_KEYS), 0, 0)
    pool = nvme_pool_bytes(state_bytes_per_element, buffer_mb) if tier == "nvme" else 0
    if layout.zero_stage == 3:  # FSDP's fp32 shards are the main parameters; their gradients are fp32 on the host
        stored = state["parameters"] - resident + state["optimizer_state"]
        return Placement(resident, state["gradients"] + (stored if tier == "cpu" else pool),
                         stored if tier == "nvme" else 0)
    stored = state["main_parameters"] + state["optimizer_state"]
    owned = state["optimizer_state"] // state_bytes_per_element
    host_gradients = 4 * owned  # "nvme": in a file of their own
    if tier == "cpu":
        early = gradient_bytes_per_element * owned if layout.zero_stage < 2 and gradient_bytes_per_element < 4 else 0
        return Placement(gpu_bytes(state, layout), host_gradients + early + stored, 0)
    return Placement(gpu_bytes(state, layout), pool, stored + host_gradients)


def gpu_bytes(state: dict[str, int], layout: Layout) -> int:
    """The part of ``state`` in GPU memory: all of it, less what the offload tier keeps off the device."""
    if layout.offload_tier == "none":
        return sum(state[key] for key in MODEL_STATE_KEYS)
    return 0 if layout.zero_stage == 3 else state["parameters"] + state["gradients"]


def nvme_pool_bytes(state_bytes_per_element: int, buffer_mb: float = DEFAULT_BUFFER_MB) -> int:
    """The ``"nvme"`` tier's host buffers (``offload.tiled_step.pool_bytes``): 3 tiles (read ahead, step, write
    behind), each a buffer of ``buffer_mb`` MiB for the fp32 main parameters and one per fp32 state tensor (AdamW: 2)."""
    return pool_bytes(buffer_mb, [4] * (1 + state_bytes_per_element // 4))


def _fsdp_chunk(shape: tuple[int, ...], world: int, rank: int) -> int:
    """Elements of rank ``rank``'s FSDP2 shard of a tensor of ``shape``: chunks of ``ceil(dim0 / world)`` rows, the
    last ranks' shorter or empty."""
    if not shape:
        return 1 if rank == 0 else 0
    rows = shape[0]
    chunk = math.ceil(rows / world)
    mine = max(0, min(chunk, rows - rank * chunk))
    return mine * math.prod(shape[1:])


def _meta_parameter(parameter: RankParameter, element: int) -> nn.Parameter:
    """A meta tensor standing for the rank's parameter (size, dtype, tags) for the bucket layout functions."""
    entry = parameter.entry
    param = nn.Parameter(torch.empty(entry.shape, dtype=DTYPES[element], device="meta"),
                         requires_grad=entry.requires_grad)
    param.expert_parallel = entry.expert
    param.pipeline_tied = parameter.pipeline_tied
    return param
