"""Hugging Face ``Qwen3ForCausalLM`` <-> our GPT: the Llama mapping (``llama.py``) plus Qwen3's two pieces.

Qwen3 is Llama-shaped with an RMSNorm over every query and key head before rotary positions
(``self_attn.q_norm``/``k_norm``, one gain of ``head_dim`` channels shared by the heads: our
``GPTConfig.qk_layernorm``) and heads wider than ``hidden_size / num_attention_heads`` (``head_dim`` 128
at every published size: our ``kv_channels``). Its ``attention_bias`` (false in the published models)
puts biases on q, k, v and o but none on the MLP, which our biases (all linear layers, or qkv alone) cannot
express: refused by name. Its sliding window (``use_sliding_window``, off in the published models) converts as
Qwen2's (``llama.windows_by_layer_type``). An export writes ``attention_bias: false``.
"""

from __future__ import annotations

from typing import Any

from lightning_megatron.huggingface.llama import Dialect, Fields, windows_by_layer_type, windows_to_layer_types
from lightning_megatron.models.gpt import GPTConfig


def _qwen3_fields(fields: Fields, problems: list[str]) -> dict[str, Any]:
    if fields["attention_bias"]:
        problems.append("attention_bias=True: Qwen3's biases on q, k, v and o without the MLP's are neither our "
                        "add_bias_linear (every linear layer) nor add_qkv_bias (q, k and v only)")
    return windows_by_layer_type(fields)


def _qwen3_hf_fields(config: GPTConfig, problems: list[str]) -> dict[str, Any]:
    if config.qkv_bias:
        problems.append(f"add_bias_linear={config.add_bias_linear}, add_qkv_bias={config.add_qkv_bias}: "
                        f"Qwen3ForCausalLM as published has no biases")
    # head_dim always: Qwen3Config's default (128) is not hidden_size / num_attention_heads
    return {"head_dim": config.head_dim, "attention_bias": False, **windows_to_layer_types(config)}


QWEN3 = Dialect(
    model_type="qwen3", architecture="Qwen3ForCausalLM",
    defaults={"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
              "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28},
    read_fields=_qwen3_fields, write_fields=_qwen3_hf_fields, qk_norm=True)
FAMILY = QWEN3.family()

qwen3_config_from_hf = QWEN3.config_from_hf
hf_config_from_qwen3 = QWEN3.hf_config
