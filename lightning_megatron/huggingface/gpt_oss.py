"""Hugging Face ``GptOssForCausalLM`` (OpenAI's gpt-oss) <-> our GPT: the Llama mapping (``llama.py``) with GPT-OSS's
config fields, attention sinks and experts.

GPT-OSS is a Llama-shaped Mixture of Experts in every layer with these pieces of its own, each a ``GPTConfig`` field:

* attention sinks (``self_attn.sinks``, one logit per head in the softmax's denominator): ``attention_sinks``;
* biases on q, k, v and o (``attention_bias``) and none elsewhere but the router and the experts:
  ``add_attention_bias``, ``MoEConfig.router_bias``, ``MoEConfig.add_bias_linear``;
* alternating sliding (``sliding_window``, 128) and full attention layers (``layer_types``);
* YaRN rotary scaling (``RopeScaling(rope_type="yarn")``);
* the clamped SwiGLU of its experts (``activation="clamped_swiglu"``, alpha 1.702 and limit 7.0; other
  ``swiglu_alpha``/``swiglu_limit`` values are refused by name);
* routing by a softmax over the top-k logits, which is ``score_function="softmax"`` with ``normalize_topk=True``.

Its experts are stored stacked, in checkpoints as in memory: ``mlp.experts.gate_up_proj`` ``[E, h, 2f]`` (``x @ W``:
transposed against ``nn.Linear``) with the gate and up columns *interleaved* (even columns gate, odd up), its bias
``gate_up_proj_bias`` ``[E, 2f]``, and ``down_proj`` ``[E, f, h]`` with ``down_proj_bias`` ``[E, h]``. Ours are
``experts.{e}.fc`` (``[gate; up]`` rows) and ``experts.{e}.proj``: :class:`InterleavedGateUp` converts one expert's
slice, and the stacks are ``Stacked(written=True)``, so an export writes them stacked as the checkpoints are.

The published checkpoints store the experts quantised to MXFP4 (``quantization_config``), which we do not compute:
such a directory is refused by name; load it with ``transformers`` dequantising
(``GptOssForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True))``), then convert the
model or its ``save_pretrained`` directory. ``router_aux_loss_coef`` is read as in Mixtral (``mixtral.py``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from lightning_megatron.huggingface.llama import (DECODER_PIECES, FROM_FIELDS, Dialect, ExpertNames, Fields,
                                                  dense_layer_problems)
from lightning_megatron.huggingface.mapping import Rule, Shape, Stacked, Transform, Transpose
from lightning_megatron.models.gpt import GPTConfig
from lightning_megatron.models.mlp import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT
from lightning_megatron.models.moe import MoEConfig

EXPERTS = "model.layers.{i}.mlp.experts"


class InterleavedGateUp(Transform):
    """Our expert's ``fc`` (``[gate; up]`` rows, ``[2f, h]``; its bias ``[2f]``) <-> one expert's slice of GPT-OSS's
    ``gate_up_proj`` (``[h, 2f]``, gate and up columns interleaved; its bias ``[2f]``, interleaved alike)."""

    def to_hf(self, tensor: Tensor) -> tuple[Tensor, ...]:
        gate, up = tensor.chunk(2)
        interleaved = torch.stack((gate, up), dim=1).reshape(tensor.shape)
        return (interleaved.t().contiguous() if tensor.dim() == 2 else interleaved,)

    def to_ours(self, tensors: Sequence[Tensor]) -> Tensor:
        tensor = tensors[0].t() if tensors[0].dim() == 2 else tensors[0]
        return torch.cat((tensor[0::2], tensor[1::2])).contiguous()

    def hf_shapes(self, shape: Shape) -> tuple[Shape, ...]:
        return (shape[::-1],)


def _expert_rules(config: GPTConfig) -> tuple[list[Rule], list[Stacked]]:
    """Every expert's ``fc`` and ``proj`` <-> its slice of the layer's stacked tensors (names of the rules only)."""
    rules = []
    for e in range(config.moe.num_experts):
        ours, theirs = f"blocks.{{i}}.mlp.experts.{e}", f"{EXPERTS}.{e}"
        rules += [Rule(f"{ours}.fc.weight", (f"{theirs}.gate_up_proj",), InterleavedGateUp()),
                  Rule(f"{ours}.fc.bias", (f"{theirs}.gate_up_proj_bias",), InterleavedGateUp()),
                  Rule(f"{ours}.proj.weight", (f"{theirs}.down_proj",), Transpose()),
                  Rule(f"{ours}.proj.bias", (f"{theirs}.down_proj_bias",), Transpose())]
    stacked = [Stacked(f"{EXPERTS}.{name}", (f"{EXPERTS}.{{e}}.{name}",), written=True)
               for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")]
    return rules, stacked


def _default_layer_types(layers: int) -> list[str]:
    """transformers' GPT-OSS default: even layers sliding, odd layers full."""
    return ["sliding_attention" if (index + 1) % 2 else "full_attention" for index in range(layers)]


def _gpt_oss_fields(fields: Fields, problems: list[str]) -> dict[str, Any]:
    if fields.get("quantization_config"):
        method = fields["quantization_config"].get("quant_method", "?")
        problems.append(f"quantization_config (quant_method={method!r}): the experts are stored quantised, which our "
                        f"GPT does not compute; load it dequantised, GptOssForCausalLM.from_pretrained(path, "
                        f"quantization_config=transformers.Mxfp4Config(dequantize=True)), and convert that model "
                        f"(or its save_pretrained directory)")
    for name, ours in (("swiglu_alpha", CLAMPED_SWIGLU_ALPHA), ("swiglu_limit", CLAMPED_SWIGLU_LIMIT)):
        if float(fields[name]) != ours:
            problems.append(f"{name}={fields[name]}: our clamped SwiGLU has GPT-OSS's {ours}")
    moe = MoEConfig(num_experts=fields["num_local_experts"], top_k=fields["num_experts_per_tok"],
                    score_function="softmax", normalize_topk=True,
                    aux_loss_coeff=float(fields["router_aux_loss_coef"]), router_bias=True, add_bias_linear=True)
    window = fields["sliding_window"]
    types = tuple(fields.get("layer_types") or _default_layer_types(fields["num_hidden_layers"]))
    if window is None and "sliding_attention" in types:
        types = ("full_attention",) * len(types)  # transformers' mask: no window, every key
    windows = {} if window is None else {"sliding_window": int(window), "layer_types": types}
    return {"add_attention_bias": bool(fields["attention_bias"]), "moe": moe, **windows}


def _gpt_oss_hf_fields(config: GPTConfig, problems: list[str]) -> dict[str, Any]:
    if config.add_bias_linear:
        problems.append("add_bias_linear=True: GptOssForCausalLM has biases on the attention (add_attention_bias), the "
                        "router and the experts, not on every linear layer")
    if config.add_qkv_bias and not config.add_attention_bias:
        problems.append("add_qkv_bias=True without add_attention_bias: GPT-OSS's attention_bias puts biases on q, k, v "
                        "and o together")
    moe = config.moe
    if moe is None:  # named by the checks every dialect shares
        return {}
    problems += dense_layer_problems(config, "GPT-OSS")
    for name, value, theirs in (("normalize_topk", moe.normalize_topk, "softmax over the top-k logits"),
                                ("router_bias", moe.router_bias, "a router bias"),
                                ("add_bias_linear", moe.add_bias_linear, "biases on the experts")):
        if not value:
            problems.append(f"moe.{name}=False: GPT-OSS has {theirs}")
    types = [config.attention_type(index) for index in range(config.num_layers)]
    return {"intermediate_size": config.moe_ffn_size, "head_dim": config.head_dim,
            "attention_bias": config.add_attention_bias, "sliding_window": config.sliding_window,
            "layer_types": types, "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "router_aux_loss_coef": moe.aux_loss_coeff, "output_router_logits": False,
            "swiglu_alpha": CLAMPED_SWIGLU_ALPHA, "swiglu_limit": CLAMPED_SWIGLU_LIMIT}


GPT_OSS = Dialect(
    model_type="gpt_oss", architecture="GptOssForCausalLM",
    defaults={"vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
              "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
              "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "num_local_experts": 128,
              "num_experts_per_tok": 4, "router_aux_loss_coef": 0.001, "swiglu_alpha": CLAMPED_SWIGLU_ALPHA,
              "swiglu_limit": CLAMPED_SWIGLU_LIMIT, "attention_bias": True, "layer_types": None,
              "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}},
    read_fields=_gpt_oss_fields, write_fields=_gpt_oss_hf_fields,
    experts=ExpertNames("mlp", router="router", rules=_expert_rules),
    pieces={**DECODER_PIECES, "activation": "clamped_swiglu", "attention_sinks": True,
            "add_attention_bias": FROM_FIELDS})
FAMILY = GPT_OSS.family()

gpt_oss_config_from_hf = GPT_OSS.config_from_hf
hf_config_from_gpt_oss = GPT_OSS.hf_config
