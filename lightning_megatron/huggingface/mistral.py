"""Hugging Face ``MistralForCausalLM`` <-> our GPT: the Llama mapping (``llama.py``), with Mistral's config fields.

Mistral has no biases and no ``attention_bias``/``mlp_bias`` fields. Its ``sliding_window`` (4096 in
Mistral-7B-v0.1, ``null`` from v0.3) slides in every layer: ``GPTConfig.sliding_window``, written back as it is.
"""

from __future__ import annotations

from typing import Any

from lightning_megatron.huggingface.llama import Dialect, Fields, window_of_every_layer, window_to_every_layer
from lightning_megatron.models.gpt import GPTConfig


def _mistral_fields(fields: Fields, problems: list[str]) -> dict[str, Any]:
    return window_of_every_layer(fields)


def _mistral_hf_fields(config: GPTConfig, problems: list[str]) -> dict[str, Any]:
    if config.qkv_bias:
        problems.append(f"add_bias_linear={config.add_bias_linear}, add_qkv_bias={config.add_qkv_bias}: "
                        f"MistralForCausalLM has no biases; export with model_type='llama' (add_bias_linear) or "
                        f"'qwen2' (add_qkv_bias)")
    return {"head_dim": config.head_dim, **window_to_every_layer(config, "MistralForCausalLM", problems)}


MISTRAL = Dialect(
    model_type="mistral", architecture="MistralForCausalLM",
    defaults={"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
              "sliding_window": 4096},
    read_fields=_mistral_fields, write_fields=_mistral_hf_fields)
FAMILY = MISTRAL.family()

mistral_config_from_hf = MISTRAL.config_from_hf
hf_config_from_mistral = MISTRAL.hf_config
