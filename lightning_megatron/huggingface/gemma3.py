"""Hugging Face ``Gemma3ForCausalLM`` (``model_type="gemma3_text"``) <-> our GPT: a dialect of the Llama mapping
(``llama.py``) with Gemma 3's own pieces.

Gemma 3's layers hold the Llama-shaped tensors (q/k/v/o, gate/up/down, per-head q/k norms as Qwen3's) with:

* four norms a layer (``input_layernorm``, ``post_attention_layernorm`` after attention, ``pre_feedforward_layernorm``,
  ``post_feedforward_layernorm``): our ``norm_position="sandwich"`` (``ln_1``, ``post_attn_norm``, ``ln_2``,
  ``post_mlp_norm``), every norm (q/k included) Gemma's ``(1 + w)`` RMSNorm (``"ZeroCenteredRMSNorm"``, which stores
  ``w`` as the checkpoints do);
* GeGLU with tanh GELU (``hidden_activation="gelu_pytorch_tanh"``), token embeddings scaled by
  ``sqrt(hidden_size)`` (``embedding_multiplier``), the scores by ``query_pre_attn_scalar ** -0.5``
  (``softmax_scale``; None when it is ``head_dim``, the default scale) and optionally soft-capped logits
  (``final_logit_softcapping``);
* a sliding window in the layers ``layer_types`` names (older configs: every ``sliding_window_pattern``-th layer
  full, the others sliding), each layer type with its own rotary parameters: ``rope_parameters``
  ``{"full_attention": ..., "sliding_attention": ...}`` (transformers 5) or ``rope_theta`` and ``rope_scaling``
  for full layers and ``rope_local_base_freq`` for sliding ones (transformers 4). Full layers -> ``rotary_base``
  and ``rope_scaling`` (the published 12B and 27B: linear, factor 8); sliding layers -> ``rotary_base_local``,
  which our sliding layers use without scaling.

Refused by name: ``attn_logit_softcapping`` set (transformers 5.25's ``Gemma3Attention`` does not apply it, so no
model computes it as transformers does; the published models have none: set it to null to get transformers'
numbers), ``use_bidirectional_attention``, ``attention_bias``, activations other than tanh GELU, scaled sliding
layers and rotary types we lack. Transformers computes a sliding mask in every Gemma 3 model, so a config without
``sliding_window`` is refused both ways.

The multimodal checkpoints (4B, 12B, 27B: ``model_type="gemma3"``, ``Gemma3ForConditionalGeneration``) are
refused with the few lines that save their text model as a ``Gemma3ForCausalLM`` (``convert.ELSEWHERE``).
"""

from __future__ import annotations

from typing import Any

from lightning_megatron.huggingface.llama import Dialect, Fields, rotary_parameters
from lightning_megatron.models.gpt import GPTConfig

GEMMA3_PIECES = {"normalization": "ZeroCenteredRMSNorm", "position_embedding_type": "rope", "activation": "geglu",
                 "norm_position": "sandwich", "add_attention_bias": False, "attention_sinks": False}
SANDWICH_NORMS = {"ln_1": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                  "ln_2": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0  # Gemma3TextConfig's defaults of full and sliding layers
DEFAULT_PATTERN = 6  # older configs: every 6th layer full
LAYER_TYPES = ("full_attention", "sliding_attention")


def _rope_by_layer_type(fields: Fields, problems: list[str]) -> dict[str, dict]:
    """Each layer type's rotary parameters, read as transformers 5.25's ``Gemma3TextConfig`` reads them."""
    rope = fields.get("rope_parameters") or {}
    if rope and set(rope) != set(LAYER_TYPES):
        problems.append(f"rope_parameters={rope!r}: Gemma 3's are per layer type, "
                        f"{{'full_attention': {{...}}, 'sliding_attention': {{...}}}}")
    full = {"rope_type": "default", **dict(rope.get("full_attention") or {}), **dict(fields.get("rope_scaling") or {})}
    full.setdefault("rope_theta", fields.get("rope_theta", GLOBAL_THETA))
    sliding = {"rope_type": "default", **dict(rope.get("sliding_attention") or {})}
    sliding.setdefault("rope_theta", fields.get("rope_local_base_freq", LOCAL_THETA))
    return {"full_attention": full, "sliding_attention": sliding}


def _gemma3_rotary(fields: Fields, problems: list[str]) -> dict[str, Any]:
    rope = _rope_by_layer_type(fields, problems)
    full = rotary_parameters(rope["full_attention"], "rope_parameters['full_attention']", fields, problems)
    sliding = rotary_parameters(rope["sliding_attention"], "rope_parameters['sliding_attention']", fields, problems)
    if "rope_scaling" in sliding:
        problems.append(f"rope_parameters['sliding_attention']={rope['sliding_attention']!r}: our sliding layers "
                        f"scale no rotary frequencies (rope_type 'default')")
    return {**full, **({"rotary_base_local": sliding["rotary_base"]} if "rotary_base" in sliding else {})}


def _gemma3_rotary_to_hf(config: GPTConfig) -> dict[str, Any]:
    scaling = None if config.rope_scaling is None else config.rope_scaling.hf_parameters()
    full = {"rope_type": "default", "rope_theta": config.rotary_base, **(scaling or {})}
    local = config.rotary_base_local
    sliding = full if local is None else {"rope_type": "default", "rope_theta": local}  # None: sliding layers as full
    return {"rope_parameters": {"full_attention": full, "sliding_attention": sliding},
            "rope_theta": config.rotary_base, "rope_local_base_freq": sliding["rope_theta"], "rope_scaling": scaling}


def _gemma3_fields(fields: Fields, problems: list[str]) -> dict[str, Any]:
    for name, why in (("use_bidirectional_attention", "our GPT's attention is causal"),
                      ("attention_bias", "Gemma 3 as published has no biases")):
        if fields.get(name):
            problems.append(f"{name}={fields[name]!r}: {why}")
    if fields["attn_logit_softcapping"] is not None:
        problems.append(f"attn_logit_softcapping={fields['attn_logit_softcapping']}: transformers' Gemma3ForCausalLM "
                        f"does not soft-cap its scores with it, so its numbers are no oracle for it; the published "
                        f"Gemma 3 models set null (set it to null to convert the model transformers computes)")
    window = fields["sliding_window"]
    count = fields["num_hidden_layers"]
    pattern = fields.get("sliding_window_pattern", DEFAULT_PATTERN)
    types = tuple(fields.get("layer_types") or ("sliding_attention" if (index + 1) % pattern else "full_attention"
                                                for index in range(count)))
    if window is None:
        problems.append("sliding_window=None: transformers' Gemma3ForCausalLM always builds a sliding mask")
    head_dim = fields["head_dim"] or fields["hidden_size"] // fields["num_attention_heads"]
    scalar = fields["query_pre_attn_scalar"]
    return {"sliding_window": window, "layer_types": types,
            "softmax_scale": None if scalar == head_dim else float(scalar) ** -0.5,
            "embedding_multiplier": fields["hidden_size"] ** 0.5,
            "final_logit_softcapping": fields["final_logit_softcapping"]}


def _query_pre_attn_scalar(config: GPTConfig) -> float:
    """``softmax_scale ** -2``, the integer it was read from when it is one (168, not 168.00000000000003)."""
    if config.softmax_scale is None:
        return config.head_dim
    scalar = config.softmax_scale ** -2
    return round(scalar) if abs(scalar - round(scalar)) < 1e-9 * scalar else scalar


def _gemma3_hf_fields(config: GPTConfig, problems: list[str]) -> dict[str, Any]:
    if config.qkv_bias:
        problems.append(f"add_bias_linear={config.add_bias_linear}, add_qkv_bias={config.add_qkv_bias}: "
                        f"Gemma3ForCausalLM has no biases")
    if config.embedding_multiplier != config.hidden_size ** 0.5:
        problems.append(f"embedding_multiplier={config.embedding_multiplier}: Gemma3ForCausalLM scales its embeddings "
                        f"by sqrt(hidden_size) = {config.hidden_size ** 0.5}")
    if config.sliding_window is None:
        problems.append("sliding_window=None: transformers' Gemma3ForCausalLM always builds a sliding mask; set the "
                        "window (layer_types all 'full_attention' keeps every layer full)")
    return {"head_dim": config.head_dim, "attention_bias": False, "use_bidirectional_attention": False,
            "query_pre_attn_scalar": _query_pre_attn_scalar(config), "sliding_window": config.sliding_window,
            "layer_types": [config.attention_type(index) for index in range(config.num_layers)],
            "final_logit_softcapping": config.final_logit_softcapping, "attn_logit_softcapping": None}


GEMMA3 = Dialect(
    model_type="gemma3_text", architecture="Gemma3ForCausalLM",
    defaults={"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
              "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256,
              "sliding_window": 4096, "layer_types": None, "final_logit_softcapping": None,
              "attn_logit_softcapping": None, "use_bidirectional_attention": False},
    read_fields=_gemma3_fields, write_fields=_gemma3_hf_fields, qk_norm=True, pieces=GEMMA3_PIECES,
    unexpressed={"attn_logit_softcapping": "no soft-capping of scores"},
    activation=("hidden_activation", "gelu_pytorch_tanh"), norms=SANDWICH_NORMS, rotary_from_hf=_gemma3_rotary,
    rotary_to_hf=_gemma3_rotary_to_hf)
FAMILY = GEMMA3.family()

gemma3_config_from_hf = GEMMA3.config_from_hf
hf_config_from_gemma3 = GEMMA3.hf_config
