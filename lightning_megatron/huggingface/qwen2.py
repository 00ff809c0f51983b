"""Hugging Face ``Qwen2ForCausalLM`` <-> our GPT: the Llama mapping (``llama.py``), with Qwen2's config fields.

Qwen2 always has biases on q, k and v and nowhere else (``add_qkv_bias=True``, ``add_bias_linear=False``)
and no field for them. Its sliding window (``use_sliding_window``, off in the published models) slides in the
layers ``layer_types`` names (by default those from ``max_window_layers`` on): ``GPTConfig.sliding_window`` and
``layer_types``, written back as they are.
"""

from __future__ import annotations

from typing import Any

from lightning_megatron.huggingface.llama import Dialect, Fields, windows_by_layer_type, windows_to_layer_types
from lightning_megatron.models.gpt import GPTConfig


def _qwen2_fields(fields: Fields, problems: list[str]) -> dict[str, Any]:
    return {"add_qkv_bias": True, **windows_by_layer_type(fields)}


def _qwen2_hf_fields(config: GPTConfig, problems: list[str]) -> dict[str, Any]:
    if config.add_bias_linear or not config.add_qkv_bias:
        problems.append(f"add_bias_linear={config.add_bias_linear}, add_qkv_bias={config.add_qkv_bias}: "
                        f"Qwen2ForCausalLM has biases on q, k and v only (add_bias_linear=False, add_qkv_bias=True); "
                        f"export with model_type='llama' (add_bias_linear or no biases) or 'mistral' (no biases)")
    return windows_to_layer_types(config)


QWEN2 = Dialect(
    model_type="qwen2", architecture="Qwen2ForCausalLM",
    defaults={"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32768,
              "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    read_fields=_qwen2_fields, write_fields=_qwen2_hf_fields, head_dim=False)
FAMILY = QWEN2.family()

qwen2_config_from_hf = QWEN2.config_from_hf
hf_config_from_qwen2 = QWEN2.hf_config
