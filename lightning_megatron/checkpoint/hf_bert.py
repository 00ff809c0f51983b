"""Conversion between our BERT and Hugging Face BERT (``BertForPreTraining``, ``BertForMaskedLM``), both ways.

Like ``hf.py`` for GPT-2: two pure functions on full (unsharded) state dicts, two on configs,
and directory reading and writing through ``hf_io.py`` (``safetensors`` only, never
``transformers``). Under tensor or pipeline parallelism, gather the full state dict first
(``Megatron3DStrategy.full_state_dict()``) and convert that.

Hugging Face's BERT is the original post-norm BERT, so only ``BERTConfig(norm_position="post")``
converts; our default pre-norm BERT (Megatron-LM's) has no Hugging Face equivalent. The tensors
differ in one way only: Hugging Face keeps separate ``query``/``key``/``value`` projections, ours
is one fused ``qkv`` laid out head-major (``[head, (q, k, v), head_dim]``) so that a column
split hands each rank whole heads. The sentence-order head (``binary_head``) is
``BertForPreTraining``'s next-sentence head, with its pooler; ``BertForMaskedLM`` has neither.

Example::

    bert = BERT.from_hf("path/to/bert-base-uncased")   # a save_pretrained directory or a BertForPreTraining
    bert.to_hf("exported")                             # loads with BertForPreTraining.from_pretrained("exported")
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping, Optional, Union

import torch
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
from lightning_megatron.models.bert import BERTConfig, BERTModel

# Hugging Face's activation -> torch's gelu ``approximate`` (BERTConfig.gelu_approximate), and back: writing uses
# "gelu_pytorch_tanh", torch's own op, so the exported model computes exactly what ours does.
GELUS = {"gelu": "none", **dict.fromkeys(TANH_GELUS, "tanh")}
HF_GELUS = {"none": "gelu", "tanh": "gelu_pytorch_tanh"}
# BertConfig switches whose other value describes a model ours does not compute (BERT's defaults).
SUPPORTED_SWITCHES = {"position_embedding_type": "absolute", "is_decoder": False, "add_cross_attention": False,
                      "tie_word_embeddings": True}
# BertConfig's defaults for the fields read here: older transformers write only the fields that differ.
BERT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
    "intermediate_size": 3072, "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
    "max_position_embeddings": 512, "type_vocab_size": 2, "layer_norm_eps": 1e-12, **SUPPORTED_SWITCHES,
}
PRE_NORM_FIX = ("norm_position='pre': Hugging Face's BERT is post-norm (LayerNorm after each residual sum and on the "
                "embeddings, no final LayerNorm), so a pre-norm BERT has no Hugging Face equivalent. Use "
                "BERTConfig(norm_position='post') for a BERT you mean to export.")
TIED_WHY = "our BERT ties them (the masked-LM decoder and the word embeddings), as BERT does"
# Buffers of older checkpoints (not weights), and TensorFlow-era LayerNorm names (gamma/beta).
_BUFFERS = re.compile(r"(bert\.)?embeddings\.(position_ids|token_type_ids)")
_TF_LAYER_NORM, _TF_NAMES = re.compile(r"(.*LayerNorm)\.(gamma|beta)$"), {"gamma": "weight", "beta": "bias"}
_DECODER_BIAS, _PREDICTIONS_BIAS = "cls.predictions.decoder.bias", "cls.predictions.bias"  # tied; either may be stored


# ----------------------------------------------------------------------------- configs
def bert_config_from_hf(hf_config: Union[Mapping[str, Any], Any], *, binary_head: Optional[bool] = None) -> BERTConfig:
    """Our post-norm ``BERTConfig`` for a ``transformers.BertConfig`` (or its ``to_dict()``, or a parsed ``config.json``).

    ``binary_head``: whether the model has the sentence-order (next-sentence) head and pooler; by
    default, whether ``architectures`` names ``BertForPreTraining`` (True when it names no model).
    Raises ``ValueError`` naming every field that describes a model ours cannot compute.
    """
    fields = dict(BERT_DEFAULTS, **config_fields(hf_config))
    problems = []
    if fields.get("model_type", "bert") != "bert":
        problems.append(f"model_type={fields['model_type']!r}: only BERT ('bert') checkpoints convert")
    if fields["hidden_act"] not in GELUS:
        problems.append(f"hidden_act={fields['hidden_act']!r}: our BERT uses a GELU, one of {tuple(GELUS)}")
    for name, supported in SUPPORTED_SWITCHES.items():
        if fields[name] != supported:
            problems.append(f"{name}={fields[name]!r}: our BERT supports only {supported!r}")
    raise_problems(problems, what="This Hugging Face config cannot be converted to our BERT")
    if binary_head is None:
        architectures = fields.get("architectures") or []
        binary_head = not architectures or "BertForPreTraining" in architectures
    hidden = fields["hidden_size"]
    return BERTConfig(
        vocab_size=fields["vocab_size"],
        max_seq_length=fields["max_position_embeddings"],
        type_vocab_size=fields["type_vocab_size"],
        hidden_size=hidden,
        num_layers=fields["num_hidden_layers"],
        num_heads=fields["num_attention_heads"],
        ffn_hidden_size=None if fields["intermediate_size"] == 4 * hidden else fields["intermediate_size"],
        dropout=fields["hidden_dropout_prob"],
        attention_dropout=fields["attention_probs_dropout_prob"],
        layer_norm_eps=fields["layer_norm_eps"],
        norm_position="post",
        gelu_approximate=GELUS[fields["hidden_act"]],
        binary_head=binary_head,
    )


def _check_post_norm(config: BERTConfig) -> None:
    if config.norm_position != "post":
        raise ValueError(PRE_NORM_FIX)


def hf_config_from_bert(config: BERTConfig, **extra_fields: Any) -> dict[str, Any]:
    """The ``BertConfig`` fields (a JSON-ready dict, ``transformers.BertConfig(**fields)``) of our post-norm ``config``.

    ``architectures`` is ``BertForPreTraining`` with the sentence-order head, else ``BertForMaskedLM``.
    ``extra_fields`` adds fields that do not describe the architecture, e.g. your tokenizer's
    ``pad_token_id`` (0 for BERT's WordPiece vocabulary); by default it is ``None``, so no
    embedding row is held out as padding.
    """
    _check_post_norm(config)
    architecture = {
        "architectures": ["BertForPreTraining" if config.binary_head else "BertForMaskedLM"],
        "model_type": "bert",
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_seq_length,
        "type_vocab_size": config.type_vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "intermediate_size": config.ffn_size,
        "hidden_act": HF_GELUS[config.gelu_approximate],
        "hidden_dropout_prob": config.dropout,
        "attention_probs_dropout_prob": config.attention_dropout,
        "layer_norm_eps": config.layer_norm_eps,
        **SUPPORTED_SWITCHES,
    }
    check_extra_fields(architecture, extra_fields, config=config)
    return {**architecture, "pad_token_id": None, **extra_fields}


# ----------------------------------------------------------------------------- state dicts
def _name_map(config: BERTConfig) -> dict[str, tuple[str, ...]]:
    """Our parameter name -> its ``BertForPreTraining`` name, or the three (query, key, value) a fused qkv splits into."""
    renames = {  # modules with a weight and a bias
        "embeddings.norm": "bert.embeddings.LayerNorm",
        "mlm_head.dense": "cls.predictions.transform.dense",
        "mlm_head.norm": "cls.predictions.transform.LayerNorm",
        "mlm_head.decoder": "cls.predictions.decoder",
    }
    if config.binary_head:
        renames |= {"pooler.dense": "bert.pooler.dense", "binary_head": "cls.seq_relationship"}
    for index in range(config.num_layers):
        theirs = f"bert.encoder.layer.{index}."
        renames |= {f"blocks.{index}.attn.proj": theirs + "attention.output.dense",
                    f"blocks.{index}.ln_1": theirs + "attention.output.LayerNorm",
                    f"blocks.{index}.mlp.fc": theirs + "intermediate.dense",
                    f"blocks.{index}.mlp.proj": theirs + "output.dense",
                    f"blocks.{index}.ln_2": theirs + "output.LayerNorm"}
    names = {f"embeddings.{table}.weight": (f"bert.embeddings.{table}.weight",)
             for table in ("word_embeddings", "position_embeddings", "token_type_embeddings")}
    names |= {f"{ours}.{kind}": (f"{theirs}.{kind}",) for ours, theirs in renames.items() for kind in ("weight", "bias")}
    for index in range(config.num_layers):
        for kind in ("weight", "bias"):
            names[f"blocks.{index}.attn.qkv.{kind}"] = tuple(
                f"bert.encoder.layer.{index}.attention.self.{part}.{kind}" for part in ("query", "key", "value"))
    return names


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, heads: int) -> Tensor:
    return torch.stack([t.unflatten(0, (heads, -1)) for t in (q, k, v)], dim=1).flatten(0, 2)  # -> head-major


def _split_qkv(qkv: Tensor, heads: int) -> tuple[Tensor, ...]:
    # clone: three views of one tensor would share memory, which safetensors refuses to save
    return tuple(t.flatten(0, 1).clone(memory_format=torch.contiguous_format) for t in qkv.unflatten(0, (heads, 3, -1)).unbind(1))


def bert_state_dict_from_hf(hf_state_dict: Mapping[str, Tensor], config: BERTConfig) -> dict[str, Tensor]:
    """Our ``BERTModel`` state dict (full, global names) from a ``BertForPreTraining`` or ``BertForMaskedLM`` one.

    The tied decoder weight and either of the two tied decoder biases may be absent (as
    ``save_pretrained`` leaves them out); TensorFlow-era ``LayerNorm.gamma``/``beta`` names and
    old position-id buffers are accepted.
    """
    state = {}
    for name, value in hf_state_dict.items():
        if not _BUFFERS.fullmatch(name):
            state[_TF_LAYER_NORM.sub(lambda match: f"{match[1]}.{_TF_NAMES[match[2]]}", name)] = value
    if "cls.predictions.decoder.weight" not in state and "bert.embeddings.word_embeddings.weight" in state:
        state["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"]
    for name, tied_to in ((_DECODER_BIAS, _PREDICTIONS_BIAS), (_PREDICTIONS_BIAS, _DECODER_BIAS)):
        if name not in state and tied_to in state:
            state[name] = state[tied_to]
    names, shapes = _name_map(config), state_dict_shapes(BERTModel, config)
    expected = {theirs: (shapes[ours][0] // len(parts), *shapes[ours][1:])
                for ours, parts in names.items() for theirs in parts}
    expected[_PREDICTIONS_BIAS] = expected[_DECODER_BIAS]
    check_names_and_shapes(state, expected, what="The Hugging Face BERT state dict",
                           fix="Pass a BertForPreTraining or BertForMaskedLM state dict (a BertModel has no masked-LM "
                               "head) and the config that belongs to it (bert_config_from_hf(model.config)).")
    what = "The Hugging Face state dict"
    check_tied(state, "cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight", what=what, why=TIED_WHY)
    check_tied(state, _DECODER_BIAS, _PREDICTIONS_BIAS, what=what, why="Hugging Face's BERT ties them")
    ours = {}
    for name, parts in names.items():
        ours[name] = state[parts[0]] if len(parts) == 1 else _fuse_qkv(*(state[part] for part in parts), config.num_heads)
    return ours


def hf_state_dict_from_bert(full_state_dict: Mapping[str, Tensor], config: BERTConfig) -> dict[str, Tensor]:
    """The ``BertForPreTraining`` (with the sentence-order head) or ``BertForMaskedLM`` state dict of our full,
    post-norm ``BERTModel`` state dict, tied entries included.

    Under tensor or pipeline parallelism, convert the gathered state dict, not a rank's own.
    """
    _check_post_norm(config)
    check_names_and_shapes(
        full_state_dict, state_dict_shapes(BERTModel, config), what="The BERT state dict",
        fix="Pass the full, unsharded state dict of a BERTModel with this config: under tensor or pipeline parallelism, "
            "gather it on every rank with Megatron3DStrategy.full_state_dict() and convert it on one.",
    )
    check_tied(full_state_dict, "mlm_head.decoder.weight", "embeddings.word_embeddings.weight", what="The BERT state dict",
               why=TIED_WHY)
    hf = {}
    for ours, parts in _name_map(config).items():
        values = (full_state_dict[ours],) if len(parts) == 1 else _split_qkv(full_state_dict[ours], config.num_heads)
        hf.update(zip(parts, values))
    hf["cls.predictions.decoder.weight"] = hf["bert.embeddings.word_embeddings.weight"]
    hf[_PREDICTIONS_BIAS] = hf[_DECODER_BIAS]
    return hf


# ----------------------------------------------------------------------------- files
def read_hf_bert(model_or_dir: Union[str, os.PathLike, nn.Module]) -> tuple[BERTConfig, dict[str, Tensor]]:
    """Our config and full state dict from a ``BertForPreTraining``/``BertForMaskedLM`` or a ``save_pretrained`` directory.

    ``binary_head`` follows the weights: on when they hold the next-sentence head (as the original
    ``bert-base-uncased`` does, whichever class its config names).
    """
    hf_config, hf_state = read_hf_checkpoint(model_or_dir, expected="a transformers BertForPreTraining or BertForMaskedLM")
    config = bert_config_from_hf(hf_config, binary_head="cls.seq_relationship.weight" in hf_state)
    return config, bert_state_dict_from_hf(hf_state, config)


def write_hf_bert(out_dir: Union[str, os.PathLike], *, config: BERTConfig, state_dict: Mapping[str, Tensor],
                  **extra_fields: Any) -> None:
    """Write ``config.json`` and ``model.safetensors`` as ``save_pretrained`` does, from our full post-norm state dict.

    ``BertForPreTraining.from_pretrained`` (or ``BertForMaskedLM``'s) loads the directory;
    ``extra_fields`` go into ``config.json`` (see ``hf_config_from_bert``).
    """
    hf_state = hf_state_dict_from_bert(state_dict, config)
    del hf_state["cls.predictions.decoder.weight"], hf_state[_DECODER_BIAS]  # tied: save_pretrained leaves them out
    fields = hf_config_from_bert(config, **{"dtype": dtype_name(hf_state["bert.embeddings.word_embeddings.weight"]),
                                            **extra_fields})
    write_hf_checkpoint(out_dir, fields=fields, state_dict=hf_state)
