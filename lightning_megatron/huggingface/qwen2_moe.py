"""Hugging Face ``Qwen2MoeForCausalLM`` (Qwen1.5-MoE) <-> our GPT with Mixture-of-Experts layers: the Llama mapping
(``llama.py``) with Qwen2-MoE's config fields and expert names.

An MoE layer routes by softmax to ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts
(``moe_intermediate_size`` wide), renormalising their weights only with ``norm_topk_prob``
(``MoEConfig.normalize_topk``), and adds a shared expert (``shared_expert_intermediate_size``
wide) gated per token by ``sigmoid(shared_expert_gate(x))`` (``shared_expert_size`` with
``shared_expert_gate=True``). Layer ``i`` is MoE when it is not in ``mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0``; the other layers are dense MLPs ``intermediate_size``
wide. Ours states that as ``MoEConfig.layer_freq``: 1 when every layer is MoE, else a 0/1 pattern
(Megatron-Core's integer ``k`` counts from layer 0, Qwen's step from layer ``k - 1``); an export
writes a ``decoder_sparse_step`` where one gives the pattern, else ``mlp_only_layers``.

Attention has biases on q, k and v (``qkv_bias``, true unless a ``transformers`` 5 config says
otherwise). Checkpoints store each expert as ``mlp.experts.{e}.gate_proj``/``up_proj``/``down_proj``;
``transformers`` 5 holds them stacked in memory, which reading accepts too, and an export writes the
per-expert tensors, as ``save_pretrained`` does. ``router_aux_loss_coef``, the sliding window,
``capacity_factor`` and ``z_loss_coeff`` are treated as Mixtral's (``mixtral.py``) and Qwen2's
(``qwen2.py``).
"""

from __future__ import annotations

from typing import Any, Union

from lightning_megatron.huggingface.llama import (Dialect, ExpertNames, Fields, windows_by_layer_type,
                                                  windows_to_layer_types)
from lightning_megatron.models.gpt import GPTConfig
from lightning_megatron.models.moe import MoEConfig


def sparse_layer_pattern(fields: Fields) -> Union[int, tuple[int, ...]]:
    """``MoEConfig.layer_freq`` of ``decoder_sparse_step`` and ``mlp_only_layers`` (Qwen2-MoE's and Qwen3-MoE's)."""
    step, dense = fields["decoder_sparse_step"], set(fields["mlp_only_layers"] or ())
    pattern = tuple(int(index not in dense and (index + 1) % step == 0) for index in range(fields["num_hidden_layers"]))
    return 1 if all(pattern) else pattern


def _qwen2_moe_fields(fields: Fields, problems: list[str]) -> dict[str, Any]:
    shared, normalize = fields["shared_expert_intermediate_size"], bool(fields["norm_topk_prob"])
    if not shared:
        problems.append("shared_expert_intermediate_size=0: our MoE layers have a shared expert of some width or none "
                        "(and then no shared_expert_gate)")
    moe = MoEConfig(num_experts=fields["num_experts"], top_k=fields["num_experts_per_tok"],
                    ffn_hidden_size=fields["moe_intermediate_size"], layer_freq=sparse_layer_pattern(fields),
                    score_function="softmax", normalize_topk=normalize,
                    aux_loss_coeff=float(fields["router_aux_loss_coef"]), shared_expert_size=shared,
                    shared_expert_gate=bool(shared))
    return {"add_qkv_bias": bool(fields["qkv_bias"]), "moe": moe, **windows_by_layer_type(fields)}


def sparse_layer_fields(config: GPTConfig) -> dict[str, Any]:
    """Which layers are MoE: a ``decoder_sparse_step`` where one describes them, else ``mlp_only_layers``."""
    moe = [config.is_moe_layer(index) for index in range(config.num_layers)]
    for step in range(1, config.num_layers + 1):
        if moe == [(index + 1) % step == 0 for index in range(config.num_layers)]:
            return {"decoder_sparse_step": step, "mlp_only_layers": []}
    return {"decoder_sparse_step": 1, "mlp_only_layers": [index for index, is_moe in enumerate(moe) if not is_moe]}


def _qwen2_moe_hf_fields(config: GPTConfig, problems: list[str]) -> dict[str, Any]:
    if config.add_bias_linear:
        problems.append("add_bias_linear=True: Qwen2MoeForCausalLM has biases on q, k and v at most (add_qkv_bias)")
    moe = config.moe
    if moe is None:  # named by the checks every dialect shares
        return {}
    return {"qkv_bias": config.add_qkv_bias, "num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": config.moe_ffn_size, "shared_expert_intermediate_size": moe.shared_expert_size,
            "norm_topk_prob": moe.normalize_topk, "router_aux_loss_coef": moe.aux_loss_coeff,
            "output_router_logits": False, **sparse_layer_fields(config), **windows_to_layer_types(config)}


QWEN2_MOE = Dialect(
    model_type="qwen2_moe", architecture="Qwen2MoeForCausalLM",
    defaults={"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
              "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 32768,
              "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4,
              "num_experts": 60, "norm_topk_prob": False, "router_aux_loss_coef": 0.001, "qkv_bias": True},
    read_fields=_qwen2_moe_fields, write_fields=_qwen2_moe_hf_fields, head_dim=False,
    experts=ExpertNames("mlp", shared_expert=True))
FAMILY = QWEN2_MOE.family()

qwen2_moe_config_from_hf = QWEN2_MOE.config_from_hf
hf_config_from_qwen2_moe = QWEN2_MOE.hf_config
