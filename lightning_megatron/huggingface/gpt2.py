"""Hugging Face GPT-2 (``GPT2LMHeadModel``) <-> our GPT with GPT-2's pieces (LayerNorm, learned positions, GELU).

The tensors differ in two ways only: ``Conv1D`` stores weights ``[in, out]`` (ours are ``nn.Linear``'s
``[out, in]``), and the fused ``c_attn`` output is ``[q; k; v]`` while ours is head-major.

Example::

    gpt = GPT.from_hf("path/to/gpt2")           # a save_pretrained directory or a GPT2LMHeadModel
    gpt.to_hf("exported")                        # loads with GPT2LMHeadModel.from_pretrained("exported")
"""

from __future__ import annotations

import re
from typing import Any, Collection, Mapping, Optional, Union

from lightning_megatron.huggingface.family import Family
from lightning_megatron.huggingface.io import config_fields
from lightning_megatron.huggingface.mapping import (
    GPT2QKV,
    TRANSPOSE,
    StateDictMapping,
    Texts,
    Tie,
    check_extra_fields,
    pair,
    raise_problems,
    state_dict_shapes,
)
from lightning_megatron.models.gpt import GPT, GPTConfig, GPTModel

# Both are 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), torch's gelu(approximate="tanh").
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
# GPT2Config switches whose other value describes a model ours does not compute (GPT-2's defaults).
SUPPORTED_SWITCHES = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                      "reorder_and_upcast_attn": False, "add_cross_attention": False, "tie_word_embeddings": True}
# GPT2Config's defaults for the fields read here: older transformers write only the fields
# that differ from them into config.json.
GPT2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
    "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
    "layer_norm_epsilon": 1e-5, **SUPPORTED_SWITCHES,
}
# Our GPTConfig's pieces that GPT-2 has (its defaults); any other value has no GPT-2 equivalent.
GPT2_PIECES = {"normalization": "LayerNorm", "position_embedding_type": "learned_absolute", "activation": "gelu",
               "rope_scaling": None, "add_bias_linear": True, "tie_embeddings": True, "norm_position": "pre",
               "embedding_multiplier": None, "final_logit_softcapping": None}
GPT2_END_OF_TEXT = 50256
TIED_WHY = "our GPT ties them, as GPT-2 does"
_MASK_BUFFER = re.compile(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)")  # causal masks in old checkpoints


# ----------------------------------------------------------------------------- configs
def gpt_config_from_hf(hf_config: Union[Mapping[str, Any], Any]) -> GPTConfig:
    """Our ``GPTConfig`` for a ``GPT2Config`` (or its ``to_dict()``, or a parsed ``config.json``).

    Raises ``ValueError`` naming every field that describes a model ours cannot compute.
    """
    fields = dict(GPT2_DEFAULTS, **config_fields(hf_config))
    problems = []
    if fields.get("model_type", "gpt2") != "gpt2":
        problems.append(f"model_type={fields['model_type']!r}: only GPT-2 ('gpt2') checkpoints convert")
    if fields["activation_function"] not in TANH_GELUS:
        problems.append(f"activation_function={fields['activation_function']!r}: our MLP uses the tanh GELU, "
                        f"one of {TANH_GELUS}")
    for name, supported in SUPPORTED_SWITCHES.items():
        if bool(fields[name]) != supported:
            problems.append(f"{name}={fields[name]!r}: our GPT supports only {supported}")
    if fields["embd_pdrop"] != fields["resid_pdrop"]:
        problems.append(f"embd_pdrop={fields['embd_pdrop']} differs from resid_pdrop={fields['resid_pdrop']}: our "
                        f"GPTConfig has one `dropout` for both; set them equal")
    raise_problems(problems, what="This Hugging Face config cannot be converted to our GPT")
    return GPTConfig(
        vocab_size=fields["vocab_size"],
        max_seq_length=fields["n_positions"],
        hidden_size=fields["n_embd"],
        num_layers=fields["n_layer"],
        num_heads=fields["n_head"],
        ffn_hidden_size=fields["n_inner"],
        dropout=fields["resid_pdrop"],
        attention_dropout=fields["attn_pdrop"],
        layer_norm_eps=fields["layer_norm_epsilon"],
    )


def _check_gpt2_shaped(config: GPTConfig) -> None:
    problems = [f"{name}={getattr(config, name)!r} (GPT-2 has {value!r})" for name, value in GPT2_PIECES.items()
                if getattr(config, name) != value]
    if config.query_groups != config.num_heads:
        problems.append(f"num_query_groups={config.num_query_groups} (GPT-2 has multi-head attention: None)")
    raise_problems(problems, what="This GPTConfig has no Hugging Face GPT-2 equivalent",
                   fix="A config with RMSNorm, rotary positions and SwiGLU exports to the Llama family instead "
                       "(model_type 'llama', 'mistral' or 'qwen2').")


def hf_config_from_gpt(config: GPTConfig, **extra_fields: Any) -> dict[str, Any]:
    """The ``GPT2Config`` fields (a JSON-ready dict, ``transformers.GPT2Config(**fields)``) of our ``config``.

    ``extra_fields`` adds fields that do not describe the architecture, e.g. your tokenizer's
    ``eos_token_id``; by default ``bos_token_id``/``eos_token_id`` are GPT-2's ``<|endoftext|>``
    (50256) when the vocabulary has it, else ``None``.
    """
    _check_gpt2_shaped(config)
    architecture = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.max_seq_length,
        "n_embd": config.hidden_size,
        "n_layer": config.num_layers,
        "n_head": config.num_heads,
        "n_inner": config.ffn_hidden_size,
        "activation_function": "gelu_new",
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.attention_dropout,
        "layer_norm_epsilon": config.layer_norm_eps,
        **SUPPORTED_SWITCHES,
    }
    check_extra_fields(architecture, extra_fields, config=config)
    end_of_text = GPT2_END_OF_TEXT if config.vocab_size > GPT2_END_OF_TEXT else None
    return {**architecture, "bos_token_id": end_of_text, "eos_token_id": end_of_text, **extra_fields}


# ----------------------------------------------------------------------------- state dicts
def gpt2_mapping(config: GPTConfig) -> StateDictMapping:
    """Our ``GPTModel`` names <-> ``GPT2LMHeadModel``'s."""
    _check_gpt2_shaped(config)
    layer = "transformer.h.{i}"
    return StateDictMapping.build(
        state_dict_shapes(GPTModel, config), num_layers=config.num_layers,
        first=[*pair("embedding.wte", "transformer.wte"), *pair("embedding.wpe", "transformer.wpe")],
        layer=[*pair("blocks.{i}.ln_1", f"{layer}.ln_1"),
               *pair("blocks.{i}.attn.qkv", f"{layer}.attn.c_attn", GPT2QKV(config.num_heads)),
               *pair("blocks.{i}.attn.proj", f"{layer}.attn.c_proj", TRANSPOSE),
               *pair("blocks.{i}.ln_2", f"{layer}.ln_2"),
               *pair("blocks.{i}.mlp.fc", f"{layer}.mlp.c_fc", TRANSPOSE),
               *pair("blocks.{i}.mlp.proj", f"{layer}.mlp.c_proj", TRANSPOSE)],
        last=pair("ln_f", "transformer.ln_f"),
        our_ties=[Tie("lm_head.weight", "embedding.wte.weight", TIED_WHY)],
        their_ties=[Tie("lm_head.weight", "transformer.wte.weight", TIED_WHY)],
        texts=Texts(hf="The Hugging Face GPT-2 state dict", ours="The GPT state dict",
                    hf_fix="Pass the config that belongs to these weights (gpt_config_from_hf(model.config))."),
    )


def _hf_name(name: str) -> Optional[str]:
    """``GPT2Model`` names (``h.0...``, as the original ``gpt2`` checkpoint stores them) get the
    ``GPT2LMHeadModel`` prefix; old causal-mask buffers are dropped."""
    name = name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"
    return None if _MASK_BUFFER.fullmatch(name) else name


def _config_from_hf(fields: Mapping[str, Any], weight_names: Collection[str]) -> GPTConfig:
    return gpt_config_from_hf(fields)


FAMILY = Family(model_type="gpt2", config_class=GPTConfig, lightning_module=GPT, config_from_hf=_config_from_hf,
                hf_config=hf_config_from_gpt, mapping=gpt2_mapping, hf_name=_hf_name,
                expected="a transformers GPT2LMHeadModel")

# The functional API: full (unsharded) state dicts and directories.
gpt_state_dict_from_hf = FAMILY.state_dict_from_hf  # accepts GPT2Model names; lm_head.weight may be absent (tied)
hf_state_dict_from_gpt = FAMILY.hf_state_dict
read_hf_gpt2 = FAMILY.read
