"""The time of a layer's GEMMs by their shapes: why a small GEMM reaches less of the peak than a large one.

A GEMM ``(m x k) @ (k x n)`` runs as output tiles of ``GEMM_TILE`` elements, one per streaming multiprocessor at
a time, in *waves* of ``streaming_multiprocessors`` tiles; the last wave is partly empty. With the tile count
falling anywhere between two whole waves, the expected waste is half a wave, so a GEMM of ``w = m n / (tile x
SMs)`` waves runs at ``w / (w + 1/2)`` of the rate of a large one (NVIDIA's "Matrix Multiplication Background"
guide calls this wave quantization). That factor times ``matmul_efficiency`` (what large GEMMs sustain: the
calibrated constant) is a GEMM's efficiency; it has no free constant: the SM counts are the data sheets', the tile
(128 x 256, the large bf16 tile of CUTLASS's and cuBLAS's Ampere and Hopper kernels) an assumption. ``k`` does
not enter: every tile runs the same ``k`` loop.

Each linear layer runs three GEMMs a micro-batch: forward ``(T x in) @ (in x out)``, the input's gradient
``(T x out) @ (out x in)`` and the weight's ``(out x T) @ (T x in)``: output tiles ``T out``, ``T in`` and ``out in``.
A layer's linears on a tensor-parallel rank: ``qkv`` (``h -> (a + 2g) d / tp``), ``proj`` (``a d / tp -> h``), the
MLP's ``fc`` (``h -> 2 f / tp`` gated, ``f / tp`` else) and ``proj`` (``f / tp -> h``); an MoE layer's experts
each see ``T k ep / E`` tokens (their share of the expert group's) and its router ``h -> E``.
"""

from __future__ import annotations

from typing import Optional

from lightning_megatron.plan.hardware import Hardware
from lightning_megatron.plan.shape import ModelShape

GEMM_TILE = 128 * 256  # output elements of one thread block's tile


def wave_efficiency(m: float, n: float, hardware: Hardware) -> float:
    """The fraction of a large GEMM's rate that a GEMM with an ``m x n`` output reaches (the module docstring)."""
    waves = m * n / (GEMM_TILE * hardware.streaming_multiprocessors)
    return waves / (waves + 0.5)


def linear_seconds(tokens: float, inputs: float, outputs: float, rate: float, hardware: Hardware, *,
                   passes: float = 1.0) -> tuple[float, float]:
    """Seconds of one linear layer's forward GEMM (times ``passes``: a recomputed forward runs it again) and of
    its two backward GEMMs, at ``rate`` FLOP/s for large GEMMs."""
    flops = 2 * tokens * inputs * outputs
    forward = flops / (rate * wave_efficiency(tokens, outputs, hardware))
    backward = flops / (rate * wave_efficiency(tokens, inputs, hardware)) + flops / (
        rate * wave_efficiency(outputs, inputs, hardware))
    return passes * forward, backward


def layer_linears(shape: ModelShape, tensor_parallel_size: int, expert_parallel_size: int, tokens: float, *,
                  expert_tensor_parallel_size: Optional[int] = None) -> list[tuple[float, float, float, float]]:
    """``(tokens, inputs, outputs, count)`` of an average layer's linears on a tensor-parallel rank (``count``:
    the share of layers that have it, times how many there are). Multi-head latent attention's down projections are
    replicated (counted on every token: under sequence parallelism they run on a chunk), its up projections split
    by heads. ``expert_tensor_parallel_size`` (None: tp): over how many tp ranks an expert is split; 1 keeps experts
    whole, the tp ranks dispatching a share of the assignments each."""
    h, d, tp = shape.hidden_size, shape.head_dim, tensor_parallel_size
    etp = expert_tensor_parallel_size or tp
    mla = shape.mla
    if mla is None:
        linears = [(tokens, h, (shape.num_heads + 2 * shape.query_groups) * d / tp, 1.0),
                   (tokens, shape.num_heads * d / tp, h, 1.0)]
    else:
        heads = shape.num_heads / tp
        queries = ([(tokens, h, heads * mla.qk_head_dim, 1.0)] if mla.q_lora_rank is None else
                   [(tokens, h, mla.q_lora_rank, 1.0), (tokens, mla.q_lora_rank, heads * mla.qk_head_dim, 1.0)])
        linears = [*queries, (tokens, h, mla.kv_lora_rank + mla.qk_rope_head_dim, 1.0),
                   (tokens, mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), 1.0),
                   (tokens, heads * mla.v_head_dim, h, 1.0)]
    gate = 2 if shape.gated_mlp else 1
    dense = shape.dense_layers / shape.num_layers
    if dense:
        linears += [(tokens, h, gate * shape.ffn_size / tp, dense), (tokens, shape.ffn_size / tp, h, dense)]
    if shape.moe_layers:
        moe = shape.moe_layers / shape.num_layers
        expert_tokens = tokens * shape.top_k * expert_parallel_size / shape.num_experts / (tp // etp)
        local_experts = shape.num_experts / expert_parallel_size
        f = shape.expert_ffn_size / etp
        linears += [(tokens, h, shape.num_experts, moe), (expert_tokens, h, gate * f, moe * local_experts),
                    (expert_tokens, f, h, moe * local_experts)]
        if shape.shared_expert_size:
            s = shape.shared_expert_size / tp
            linears += [(tokens, h, gate * s, moe), (tokens, s, h, moe)]
    return linears
