"""One entry point for every Hugging Face family we convert: ``read_hf``, ``write_hf``, ``lightning_module_for``.

``read_hf`` picks the family by ``config.json``'s ``model_type``; ``write_hf`` by ``model_type`` when
given, else by our config: a ``BERTConfig`` is BERT, a ``GPTConfig`` with learned positions is GPT-2,
one with latent attention (``mla``) is ``deepseek_v3``, one with rotary positions is Llama-shaped: ``gpt_oss`` with attention sinks; with
Mixture-of-Experts layers ``qwen2_moe`` when they have a shared expert, else ``qwen3_moe`` when it
normalises query and key heads, else ``mixtral``; dense,
``gemma3_text`` with four norms a layer (Gemma 3's ``norm_position="sandwich"``), ``qwen3`` when it
normalises query and key heads (Qwen3's ``qk_layernorm``), ``qwen2`` when it has biases on qkv alone
(Qwen2's), else ``llama`` (``mistral`` only when asked for). The family then refuses, by name, any piece it
lacks. State dicts are our
models' own, full and unsharded (``GPTModel``/``BERTModel`` names, ``blocks.0.attn.qkv.weight``); a
LightningModule's (names under ``model.``) is accepted too.

Example::

    config, state_dict = read_hf("path/to/hf_model")          # GPT-2, BERT, Llama, Mistral, Qwen2, Qwen3, Gemma 3, ...
    module = lightning_module_for(config)(config)
    module.configure_model()
    module.model.load_state_dict(state_dict)
    write_hf("exported", config, module.model.state_dict(), max_shard_size="2GB")
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence, Union

from torch import Tensor, nn

from lightning_megatron.huggingface import (bert, deepseek_v3, gemma3, gpt2, gpt_oss, llama, mistral, mixtral, qwen2,
                                             qwen2_moe, qwen3, qwen3_moe)
from lightning_megatron.huggingface.companions import special_token_ids, write_companions
from lightning_megatron.huggingface.family import Family, TensorSource
from lightning_megatron.huggingface.io import DEFAULT_MAX_SHARD_SIZE, read_hf_config, weight_names
from lightning_megatron.models.bert import BERTConfig
from lightning_megatron.models.gpt import GPTConfig

ModelConfig = Union[GPTConfig, BERTConfig]
FAMILIES: dict[str, Family] = {family.model_type: family for family in
                               (gpt2.FAMILY, bert.FAMILY, llama.FAMILY, mistral.FAMILY, qwen2.FAMILY,
                                qwen3.FAMILY, mixtral.FAMILY, qwen2_moe.FAMILY, gemma3.FAMILY,
                                deepseek_v3.FAMILY, qwen3_moe.FAMILY, gpt_oss.FAMILY)}
HF_MODEL_TYPES = tuple(sorted(FAMILIES))
#: Model types we read another way, and how.
ELSEWHERE = {"gemma3": "It is the multimodal Gemma 3 (Gemma3ForConditionalGeneration): convert its text model, saved "
                       "as a Gemma3ForCausalLM: m = Gemma3ForConditionalGeneration.from_pretrained(DIR); "
                       "text = Gemma3ForCausalLM(m.config.text_config); "
                       "text.model.load_state_dict(m.model.language_model.state_dict()); "
                       "text.lm_head.load_state_dict(m.lm_head.state_dict()); text.save_pretrained(TEXT_DIR)."}


def model_types_of(config_class: type) -> tuple[str, ...]:
    """The Hugging Face model types that hold a model of ``config_class`` (``GPTConfig``: gpt2, llama, ...)."""
    return tuple(name for name in HF_MODEL_TYPES if FAMILIES[name].config_class is config_class)


def read_hf(model_or_dir: Union[str, os.PathLike, nn.Module], *,
            model_types: Sequence[str] = HF_MODEL_TYPES) -> tuple[ModelConfig, dict[str, Tensor]]:
    """Our config and full state dict from a ``transformers`` model or a ``save_pretrained`` directory, by its
    ``model_type`` (one of ``model_types``). Directories need no ``transformers``."""
    return _config_and_family(model_or_dir, model_types)[1].read(model_or_dir)


def read_hf_config_only(directory: Union[str, os.PathLike], *,
                        model_types: Sequence[str] = HF_MODEL_TYPES) -> ModelConfig:
    """Our config of a ``save_pretrained`` directory, from its ``config.json`` (and weight names), reading no
    weights: what ``GPT(pretrained=...)`` knows at construction, before ``configure_model`` loads them."""
    fields, family = _config_and_family(directory, model_types)
    return family.config_from_hf(fields, weight_names(directory))


def _config_and_family(model_or_dir: Union[str, os.PathLike, nn.Module],
                       model_types: Sequence[str]) -> tuple[dict[str, Any], Family]:
    """``config.json``'s fields and the family its ``model_type`` names, which must be one of ``model_types``."""
    classes = [FAMILIES[name].expected.removeprefix("a transformers ") for name in model_types if name in FAMILIES]
    expected = "a transformers " + (", ".join(classes[:-1]) + " or " + classes[-1] if len(classes) > 1 else classes[0])
    fields = read_hf_config(model_or_dir, expected=expected)
    model_type = fields.get("model_type")
    if model_type not in model_types:
        other = (f" It is a {FAMILIES[model_type].config_class.__name__.removesuffix('Config')} model: read it with "
                 f"{FAMILIES[model_type].lightning_module.__name__}.from_hf." if model_type in FAMILIES
                 else " " + ELSEWHERE[model_type] if model_type in ELSEWHERE else "")
        raise ValueError(f"model_type={model_type!r} cannot be converted: supported Hugging Face model types are "
                         f"{', '.join(map(repr, model_types))}.{other}")
    return fields, FAMILIES[model_type]


def family_for(config: Any, model_type: Optional[str] = None) -> Family:
    """The family that writes ``config``: ``model_type``'s, or the one our config describes (see the module)."""
    if not isinstance(config, (GPTConfig, BERTConfig)):
        raise TypeError(f"Expected a GPTConfig or BERTConfig, got {type(config).__name__}.")
    if model_type is None:
        if isinstance(config, BERTConfig):
            model_type = "bert"
        elif config.position_embedding_type == "learned_absolute":  # GPT-2's; its checks name any other piece
            model_type = "gpt2"
        elif config.mla is not None:
            model_type = "deepseek_v3"
        elif config.attention_sinks:
            model_type = "gpt_oss"
        elif config.moe is not None:
            model_type = ("qwen2_moe" if config.moe.shared_expert_size else "qwen3_moe" if config.qk_layernorm
                          else "mixtral")
        elif config.norm_position == "sandwich":  # Gemma 3's four norms a layer
            model_type = "gemma3_text"
        elif config.qk_layernorm:
            model_type = "qwen3"
        else:
            model_type = "qwen2" if config.add_qkv_bias and not config.add_bias_linear else "llama"
    valid = model_types_of(type(config))
    if model_type not in valid:
        raise ValueError(f"model_type={model_type!r} cannot hold a {type(config).__name__}: choose one of "
                         f"{', '.join(map(repr, valid))}.")
    return FAMILIES[model_type]


def write_hf(out_dir: Union[str, os.PathLike], config: ModelConfig,
             state_dict: Union[Mapping[str, Tensor], TensorSource], *, model_type: Optional[str] = None,
             max_shard_size: Union[int, str, None] = None, base: Union[str, os.PathLike, None] = None,
             **extra_fields: Any) -> list[str]:
    """Write a ``save_pretrained`` directory that ``transformers`` loads (``config.json``, ``model.safetensors``,
    or shards of at most ``max_shard_size``, default 5GB, with ``model.safetensors.index.json``).

    ``state_dict``: the model's full state dict, or a ``TensorSource`` that reads it a few tensors at a time
    (as ``lightning-megatron checkpoint convert`` reads a sharded checkpoint); ``model_type`` chooses the
    family (see the module); ``base``: the Hugging Face directory the model was fine-tuned from, whose tokenizer
    files, ``generation_config.json`` and special token ids go along (``companions``; skipped where it is not a
    directory here); ``extra_fields`` go into ``config.json`` (e.g. ``eos_token_id``). Returns the names of the
    base's files written beside the weights.
    """
    usable_base = base is not None and os.path.isdir(base)
    fields = {**(special_token_ids(base) if usable_base else {}), **extra_fields}
    source = state_dict if isinstance(state_dict, TensorSource) else TensorSource.of(state_dict)
    family_for(config, model_type).write(out_dir, config, source, max_shard_size=max_shard_size or DEFAULT_MAX_SHARD_SIZE,
                                         **fields)
    return write_companions(out_dir, base) if usable_base else []


def lightning_module_for(config: ModelConfig) -> type:
    """The LightningModule class for ``config``: ``GPT`` for a ``GPTConfig``, ``BERT`` for a ``BERTConfig``."""
    return family_for(config).lightning_module
