"""One entry point for every Hugging Face model family we convert, chosen by ``model_type``.

``read_hf`` looks at ``config.json``'s ``model_type`` (``"gpt2"``: ``hf.py``, ``"bert"``:
``hf_bert.py``), ``write_hf`` at the type of our config, and ``lightning_module_for`` names the
LightningModule that holds such a model. State dicts are our models' own, full and unsharded
(``GPTModel``/``BERTModel`` names, ``blocks.0.attn.qkv.weight``, without the LightningModule's
``model.`` prefix).

Example::

    config, state_dict = read_hf("path/to/hf_model")          # GPT-2 or BERT
    module = lightning_module_for(config)(config)
    module.configure_model()
    module.model.load_state_dict(state_dict)
    write_hf("exported", config, module.model.state_dict())
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, NamedTuple, Union

from torch import Tensor, nn

from lightning_megatron.checkpoint.hf import read_hf_gpt2, write_hf_gpt2
from lightning_megatron.checkpoint.hf_bert import read_hf_bert, write_hf_bert
from lightning_megatron.checkpoint.hf_io import model_state_dict, read_hf_config
from lightning_megatron.models.bert import BERT, BERTConfig
from lightning_megatron.models.gpt import GPT, GPTConfig

ModelConfig = Union[GPTConfig, BERTConfig]


class _Family(NamedTuple):
    config_class: type
    lightning_module: type
    read: Callable[..., tuple[Any, dict[str, Tensor]]]
    write: Callable[..., None]


_FAMILIES = {  # by Hugging Face model_type
    "gpt2": _Family(GPTConfig, GPT, read_hf_gpt2, write_hf_gpt2),
    "bert": _Family(BERTConfig, BERT, read_hf_bert, write_hf_bert),
}
HF_MODEL_TYPES = tuple(sorted(_FAMILIES))


def read_hf(model_or_dir: Union[str, os.PathLike, nn.Module]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """Our config (``GPTConfig`` or ``BERTConfig``) and full state dict from a ``transformers`` model or a
    ``save_pretrained`` directory, by its ``model_type``. Directories need no ``transformers``."""
    model_type = read_hf_config(model_or_dir, expected="a transformers GPT-2 or BERT model").get("model_type")
    if model_type not in _FAMILIES:
        raise ValueError(f"model_type={model_type!r} cannot be converted: supported Hugging Face model types are "
                         f"{', '.join(map(repr, HF_MODEL_TYPES))}.")
    return _FAMILIES[model_type].read(model_or_dir)


def _family(config: Any) -> _Family:
    for family in _FAMILIES.values():
        if isinstance(config, family.config_class):
            return family
    raise TypeError(f"Expected a GPTConfig or BERTConfig, got {type(config).__name__}.")


def write_hf(out_dir: Union[str, os.PathLike], config: ModelConfig, state_dict: Mapping[str, Tensor],
             **extra_fields: Any) -> None:
    """Write a ``save_pretrained`` directory (``config.json``, ``model.safetensors``) that ``transformers`` loads:
    ``GPT2LMHeadModel`` for a ``GPTConfig``, ``BertForPreTraining`` for a post-norm ``BERTConfig``.

    ``state_dict``: the model's full state dict; a LightningModule's (names under ``model.``) is accepted too.
    ``extra_fields`` go into ``config.json`` (e.g. ``eos_token_id``, ``pad_token_id``).
    """
    _family(config).write(out_dir, config=config, state_dict=model_state_dict(state_dict), **extra_fields)


def lightning_module_for(config: ModelConfig) -> type:
    """The LightningModule class for ``config``: ``GPT`` for a ``GPTConfig``, ``BERT`` for a ``BERTConfig``."""
    return _family(config).lightning_module
