"""Hugging Face ``Qwen3MoeForCausalLM`` (Qwen3-30B-A3B, Qwen3-235B-A22B) <-> our GPT with Mixture-of-Experts layers:
the Llama mapping (``llama.py``) with Qwen3's attention and Qwen3-MoE's config fields.

Attention is Qwen3's (``qwen3.py``): an RMSNorm over every query and key head (``qk_layernorm``), heads
``head_dim`` wide whatever ``hidden_size / num_attention_heads`` is (``kv_channels``), no biases. An MoE layer
routes by softmax to ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts (``moe_intermediate_size`` wide),
renormalising the chosen weights only with ``norm_topk_prob`` (``MoEConfig.normalize_topk``; the published models
set it), with no shared expert. Which layers are MoE is Qwen2-MoE's rule (``qwen2_moe.sparse_layer_pattern``: not
in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``); the others are dense MLPs ``intermediate_size``
wide. Checkpoints store each expert as ``mlp.experts.{e}.gate_proj``/``up_proj``/``down_proj`` and the router as
``mlp.gate``; ``transformers`` 5 holds the experts stacked in memory (``mlp.experts.gate_up_proj``
``[E, 2f, h]``, ``mlp.experts.down_proj``), which reading accepts too, and an export writes the per-expert tensors,
as ``save_pretrained`` does.

``transformers`` 5 calls the expert count ``num_local_experts`` in memory and in the ``config.json`` it writes; the
published configs (and ``transformers`` 4) spell it ``num_experts``: both are read, ``num_experts`` is written.
The sliding window (``use_sliding_window``, off in the published models) slides in every layer, as
``transformers`` 5 applies it (it ignores ``max_window_layers``); an export writes ``max_window_layers: 0`` with a
window, so that ``transformers`` 4, which reads it, slides in every layer too.

The load-balancing loss: ``router_aux_loss_coef`` is read as ``MoEConfig.aux_loss_coeff`` (an export writes it back,
with ``output_router_logits: false``), as for Mixtral and Qwen2-MoE, but the two losses differ. ``transformers``
adds, when ``output_router_logits``, one term for the whole batch and model: ``coef * E * sum_e f_e * P_e``, with
``f_e`` the expert's top-k assignments and ``P_e`` its summed softmax scores, both pooled over every token and every
MoE layer and divided by tokens x layers (so ``f`` sums to ``top_k``: ``coef * top_k`` at even routing). Ours is
Megatron-Core's, per sequence and per layer (``models/router.py``): ``coef`` per MoE layer at even routing, so the
same coefficient weighs balance ``layers / top_k`` times more here (6x for Qwen3-30B-A3B), and balancing each
layer's own routing rather than the model's pooled one. The language-model loss is the same either way.
"""

from __future__ import annotations

from typing import Any

from lightning_megatron.huggingface.llama import Dialect, ExpertNames, Fields
from lightning_megatron.huggingface.qwen2_moe import sparse_layer_fields, sparse_layer_pattern
from lightning_megatron.models.gpt import GPTConfig
from lightning_megatron.models.moe import MoEConfig


def _qwen3_moe_fields(fields: Fields, problems: list[str]) -> dict[str, Any]:
    if fields["attention_bias"]:
        problems.append("attention_bias=True: Qwen3-MoE's biases on q, k, v and o without the MLP's are neither our "
                        "add_bias_linear (every linear layer) nor add_qkv_bias (q, k and v only)")
    experts = fields.get("num_local_experts", fields["num_experts"])  # transformers 5's spelling, else the Hub's
    if not experts:
        problems.append(f"num_experts={experts}: every layer is dense; read it as model_type='qwen3'")
        return {}
    moe = MoEConfig(num_experts=experts, top_k=fields["num_experts_per_tok"],
                    ffn_hidden_size=fields["moe_intermediate_size"], layer_freq=sparse_layer_pattern(fields),
                    score_function="softmax", normalize_topk=bool(fields["norm_topk_prob"]),
                    aux_loss_coeff=float(fields["router_aux_loss_coef"]))
    window = fields["sliding_window"] if fields["use_sliding_window"] else None
    return {"moe": moe, **({} if window is None else {"sliding_window": int(window)})}


def _qwen3_moe_hf_fields(config: GPTConfig, problems: list[str]) -> dict[str, Any]:
    if config.qkv_bias:
        problems.append(f"add_bias_linear={config.add_bias_linear}, add_qkv_bias={config.add_qkv_bias}: "
                        f"Qwen3MoeForCausalLM as published has no biases")
    if config.layer_types is not None:
        problems.append(f"layer_types={list(config.layer_types)}: every Qwen3MoeForCausalLM layer slides, or none "
                        f"does; export with model_type='qwen2_moe' (a window per layer type)")
    moe = config.moe
    if moe is None:  # named by the checks every dialect shares
        return {}
    window = config.sliding_window
    # head_dim always: transformers' default is hidden_size / num_attention_heads, the published models' is not
    return {"head_dim": config.head_dim, "attention_bias": False, "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k, "moe_intermediate_size": config.moe_ffn_size,
            "norm_topk_prob": moe.normalize_topk, "router_aux_loss_coef": moe.aux_loss_coeff,
            "output_router_logits": False, **sparse_layer_fields(config), "use_sliding_window": window is not None,
            "sliding_window": window, "max_window_layers": 0 if window is not None else config.num_layers}


QWEN3_MOE = Dialect(
    model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM",
    defaults={"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
              "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 32768,
              "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096, "decoder_sparse_step": 1,
              "mlp_only_layers": [], "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128,
              "norm_topk_prob": False, "router_aux_loss_coef": 0.001},
    read_fields=_qwen3_moe_fields, write_fields=_qwen3_moe_hf_fields, experts=ExpertNames("mlp"), qk_norm=True)
FAMILY = QWEN3_MOE.family()

qwen3_moe_config_from_hf = QWEN3_MOE.config_from_hf
hf_config_from_qwen3_moe = QWEN3_MOE.hf_config
