"""Hugging Face BERT (``BertForPreTraining``, ``BertForMaskedLM``) <-> our post-norm BERT.

Hugging Face's BERT is the original post-norm BERT, so only ``BERTConfig(norm_position="post")``
converts; our default pre-norm BERT (Megatron-LM's) has no Hugging Face equivalent. The tensors
differ in one way only: Hugging Face keeps separate ``query``/``key``/``value`` projections, ours is
one fused, head-major ``qkv``. The sentence-order head (``binary_head``) is ``BertForPreTraining``'s
next-sentence head, with its pooler; ``BertForMaskedLM`` has neither.

Example::

    bert = BERT.from_hf("path/to/bert-base-uncased")   # a save_pretrained directory or a BertForPreTraining
    bert.to_hf("exported")                             # loads with BertForPreTraining.from_pretrained("exported")
"""

from __future__ import annotations

import re
from typing import Any, Collection, Mapping, Optional, Union

from lightning_megatron.huggingface.family import Family
from lightning_megatron.huggingface.gpt2 import TANH_GELUS
from lightning_megatron.huggingface.io import config_fields
from lightning_megatron.huggingface.mapping import (
    QueryGroups,
    Rule,
    StateDictMapping,
    Texts,
    Tie,
    check_extra_fields,
    pair,
    raise_problems,
    state_dict_shapes,
)
from lightning_megatron.models.bert import BERT, BERTConfig, BERTModel

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
def bert_mapping(config: BERTConfig) -> StateDictMapping:
    """Our ``BERTModel`` names <-> ``BertForPreTraining``'s (``BertForMaskedLM``'s: no pooler, no next-sentence head)."""
    _check_post_norm(config)
    layer = "bert.encoder.layer.{i}"
    return StateDictMapping.build(
        state_dict_shapes(BERTModel, config), num_layers=config.num_layers,
        first=[rule for table in ("word_embeddings", "position_embeddings", "token_type_embeddings")
               for rule in pair(f"embeddings.{table}", f"bert.embeddings.{table}")]
        + pair("embeddings.norm", "bert.embeddings.LayerNorm"),
        layer=[*pair("blocks.{i}.attn.qkv", [f"{layer}.attention.self.{part}" for part in ("query", "key", "value")],
                     QueryGroups(config.num_heads, config.num_heads)),
               *pair("blocks.{i}.attn.proj", f"{layer}.attention.output.dense"),
               *pair("blocks.{i}.ln_1", f"{layer}.attention.output.LayerNorm"),
               *pair("blocks.{i}.mlp.fc", f"{layer}.intermediate.dense"),
               *pair("blocks.{i}.mlp.proj", f"{layer}.output.dense"),
               *pair("blocks.{i}.ln_2", f"{layer}.output.LayerNorm")],
        last=[*pair("pooler.dense", "bert.pooler.dense"), *pair("binary_head", "cls.seq_relationship"),
              *pair("mlm_head.dense", "cls.predictions.transform.dense"),
              *pair("mlm_head.norm", "cls.predictions.transform.LayerNorm"),
              Rule("mlm_head.decoder.bias", ("cls.predictions.bias",))],  # its weight is the tied embedding
        our_ties=[Tie("mlm_head.decoder.weight", "embeddings.word_embeddings.weight", TIED_WHY)],
        their_ties=[Tie("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight", TIED_WHY),
                    Tie("cls.predictions.decoder.bias", "cls.predictions.bias", "Hugging Face's BERT ties them")],
        texts=Texts(hf="The Hugging Face BERT state dict", ours="The BERT state dict",
                    hf_fix="Pass a BertForPreTraining or BertForMaskedLM state dict (a BertModel has no masked-LM "
                           "head) and the config that belongs to it (bert_config_from_hf(model.config))."),
    )


def _hf_name(name: str) -> Optional[str]:
    """Old position-id buffers are dropped, TensorFlow-era ``LayerNorm.gamma``/``beta`` renamed."""
    if _BUFFERS.fullmatch(name):
        return None
    return _TF_LAYER_NORM.sub(lambda match: f"{match[1]}.{_TF_NAMES[match[2]]}", name)


def _config_from_hf(fields: Mapping[str, Any], weight_names: Collection[str]) -> BERTConfig:
    """``binary_head`` follows the weights: on when they hold the next-sentence head (as the original
    ``bert-base-uncased`` does, whichever class its config names)."""
    return bert_config_from_hf(fields, binary_head="cls.seq_relationship.weight" in weight_names)


FAMILY = Family(model_type="bert", config_class=BERTConfig, lightning_module=BERT, config_from_hf=_config_from_hf,
                hf_config=hf_config_from_bert, mapping=bert_mapping, hf_name=_hf_name,
                expected="a transformers BertForPreTraining or BertForMaskedLM")

# The functional API: full (unsharded) state dicts and directories.
bert_state_dict_from_hf = FAMILY.state_dict_from_hf  # the tied decoder weight and either tied bias may be absent
hf_state_dict_from_bert = FAMILY.hf_state_dict
read_hf_bert = FAMILY.read
