"""Conversion between our GPT and Hugging Face GPT-2, in both directions.

The core is two pure functions on full (unsharded) state dicts and two on configs; under
tensor or pipeline parallelism, gather the full state dict first
(``Megatron3DStrategy.full_state_dict()``) and convert that. The tensors differ
in two ways only: Hugging Face's ``Conv1D`` stores weights as ``[in, out]`` (ours are
``nn.Linear``'s ``[out, in]``), and its fused ``c_attn`` output is ``[q; k; v]`` while ours is
head-major ``[head, (q, k, v), head_dim]`` so that a column split hands each rank whole heads.

Directories are read and written by ``hf_io.py`` (only ``safetensors`` needed, never
``transformers``); ``hf_bert.py`` is the same for BERT and ``hf_convert.py`` picks by ``model_type``.

Example::

    gpt = GPT.from_hf("path/to/gpt2")           # a save_pretrained directory or a GPT2LMHeadModel
    gpt.to_hf("exported")                        # loads with GPT2LMHeadModel.from_pretrained("exported")
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping, Union

from torch import Tensor, nn

from lightning_megatron.checkpoint.hf_io import (
    TANH_GELUS,
    check_extra_fields,
    check_names_and_shapes,
    check_tied,
    config_fields,
    dtype_name,
    raise_problems,
    read_hf_checkpoint,
    state_dict_shapes,
    write_hf_checkpoint,
)
from lightning_megatron.models.gpt import GPTConfig, GPTModel

# How a tensor changes between the two layouts.
SAME, TRANSPOSE, QKV = "same", "transpose", "qkv"

# One transformer layer: our name -> (Hugging Face name, change).
_LAYER_NAMES = {
    "ln_1.weight": ("ln_1.weight", SAME),
    "ln_1.bias": ("ln_1.bias", SAME),
    "attn.qkv.weight": ("attn.c_attn.weight", QKV),
    "attn.qkv.bias": ("attn.c_attn.bias", QKV),
    "attn.proj.weight": ("attn.c_proj.weight", TRANSPOSE),
    "attn.proj.bias": ("attn.c_proj.bias", SAME),
    "ln_2.weight": ("ln_2.weight", SAME),
    "ln_2.bias": ("ln_2.bias", SAME),
    "mlp.fc.weight": ("mlp.c_fc.weight", TRANSPOSE),
    "mlp.fc.bias": ("mlp.c_fc.bias", SAME),
    "mlp.proj.weight": ("mlp.c_proj.weight", TRANSPOSE),
    "mlp.proj.bias": ("mlp.c_proj.bias", SAME),
}

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
GPT2_END_OF_TEXT = 50256
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


def hf_config_from_gpt(config: GPTConfig, **extra_fields: Any) -> dict[str, Any]:
    """The ``GPT2Config`` fields (a JSON-ready dict, ``transformers.GPT2Config(**fields)``) of our ``config``.

    ``extra_fields`` adds fields that do not describe the architecture, e.g. your tokenizer's
    ``eos_token_id``; by default ``bos_token_id``/``eos_token_id`` are GPT-2's ``<|endoftext|>``
    (50256) when the vocabulary has it, else ``None``.
    """
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
def _name_map(config: GPTConfig) -> dict[str, tuple[str, str]]:
    """Our parameter name -> (Hugging Face ``GPT2LMHeadModel`` name, change)."""
    names = {
        "embedding.wte.weight": ("transformer.wte.weight", SAME),
        "embedding.wpe.weight": ("transformer.wpe.weight", SAME),
        "ln_f.weight": ("transformer.ln_f.weight", SAME),
        "ln_f.bias": ("transformer.ln_f.bias", SAME),
        "lm_head.weight": ("lm_head.weight", SAME),
    }
    for index in range(config.num_layers):
        for ours, (theirs, change) in _LAYER_NAMES.items():
            names[f"blocks.{index}.{ours}"] = (f"transformer.h.{index}.{theirs}", change)
    return names


TIED_WHY = "our GPT ties them, as GPT-2 does"


def _to_ours(tensor: Tensor, change: str, heads: int) -> Tensor:
    if change == SAME:
        return tensor
    if tensor.dim() == 2:
        tensor = tensor.t()  # Conv1D [in, out] -> Linear [out, in]
    if change == QKV:
        tensor = tensor.unflatten(0, (3, heads, -1)).transpose(0, 1).flatten(0, 2)  # [q; k; v] -> head-major
    return tensor.contiguous()


def _to_hf(tensor: Tensor, change: str, heads: int) -> Tensor:
    if change == SAME:
        return tensor
    if change == QKV:
        tensor = tensor.unflatten(0, (heads, 3, -1)).transpose(0, 1).flatten(0, 2)  # head-major -> [q; k; v]
    return (tensor.t() if tensor.dim() == 2 else tensor).contiguous()


def gpt_state_dict_from_hf(hf_state_dict: Mapping[str, Tensor], config: GPTConfig) -> dict[str, Tensor]:
    """Our ``GPTModel`` state dict (full, global names) from a Hugging Face GPT-2 state dict.

    Accepts ``GPT2LMHeadModel`` names (``transformer.h.0...``) and ``GPT2Model`` ones (``h.0...``,
    as the original ``gpt2`` checkpoint stores them); ``lm_head.weight`` may be absent (it is
    tied) and old causal-mask buffers are dropped.
    """
    state = {}
    for name, value in hf_state_dict.items():
        name = name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"
        if not _MASK_BUFFER.fullmatch(name):
            state[name] = value
    if "lm_head.weight" not in state and "transformer.wte.weight" in state:
        state["lm_head.weight"] = state["transformer.wte.weight"]  # tied, so save_pretrained leaves it out
    names, shapes = _name_map(config), state_dict_shapes(GPTModel, config)
    expected = {theirs: shapes[ours] if change == SAME else shapes[ours][::-1] for ours, (theirs, change) in names.items()}
    check_names_and_shapes(state, expected, what="The Hugging Face GPT-2 state dict",
                           fix="Pass the config that belongs to these weights (gpt_config_from_hf(model.config)).")
    check_tied(state, "lm_head.weight", "transformer.wte.weight", what="The Hugging Face state dict", why=TIED_WHY)
    return {ours: _to_ours(state[theirs], change, config.num_heads) for ours, (theirs, change) in names.items()}


def hf_state_dict_from_gpt(full_state_dict: Mapping[str, Tensor], config: GPTConfig) -> dict[str, Tensor]:
    """The ``GPT2LMHeadModel`` state dict of our full ``GPTModel`` state dict (``lm_head.weight`` included, tied).

    Under tensor or pipeline parallelism, convert the gathered state dict, not a rank's own.
    """
    check_names_and_shapes(
        full_state_dict, state_dict_shapes(GPTModel, config), what="The GPT state dict",
        fix="Pass the full, unsharded state dict of a GPTModel with this config: under tensor or pipeline parallelism, "
            "gather it on every rank with Megatron3DStrategy.full_state_dict() and convert it on one.",
    )
    check_tied(full_state_dict, "lm_head.weight", "embedding.wte.weight", what="The GPT state dict", why=TIED_WHY)
    hf = {theirs: _to_hf(full_state_dict[ours], change, config.num_heads) for ours, (theirs, change) in _name_map(config).items()}
    hf["lm_head.weight"] = hf["transformer.wte.weight"]
    return hf


# ----------------------------------------------------------------------------- files
def read_hf_gpt2(model_or_dir: Union[str, os.PathLike, nn.Module]) -> tuple[GPTConfig, dict[str, Tensor]]:
    """Our config and full state dict from a ``GPT2LMHeadModel`` (or ``GPT2Model``) or a ``save_pretrained`` directory."""
    hf_config, hf_state = read_hf_checkpoint(model_or_dir, expected="a transformers GPT2LMHeadModel")
    config = gpt_config_from_hf(hf_config)
    return config, gpt_state_dict_from_hf(hf_state, config)


def write_hf_gpt2(out_dir: Union[str, os.PathLike], *, config: GPTConfig, state_dict: Mapping[str, Tensor],
                  **extra_fields: Any) -> None:
    """Write ``config.json`` and ``model.safetensors`` as ``save_pretrained`` does, from our full state dict.

    ``extra_fields`` go into ``config.json`` (see ``hf_config_from_gpt``).
    """
    hf_state = hf_state_dict_from_gpt(state_dict, config)
    del hf_state["lm_head.weight"]  # tied: save_pretrained stores the embedding only
    fields = hf_config_from_gpt(config, **{"dtype": dtype_name(hf_state["transformer.wte.weight"]), **extra_fields})
    write_hf_checkpoint(out_dir, fields=fields, state_dict=hf_state)
