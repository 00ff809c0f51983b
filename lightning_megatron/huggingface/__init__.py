"""Hugging Face ``transformers`` interop: GPT-2, BERT, Llama, Mistral, Qwen2, Qwen3, Gemma 3, Mixtral, Qwen2-MoE,
Qwen3-MoE, GPT-OSS and DeepSeek-V3 checkpoints, both ways.

One module per family (``gpt2``, ``bert``, ``llama`` and its dialects ``mistral``, ``qwen2``, ``qwen3``,
``gemma3``, ``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``gpt_oss``; ``deepseek_v3``) over one name/shape mapping mechanism
(``mapping``); ``io`` reads and writes
``save_pretrained`` directories; ``companions`` gives an export its base's tokenizer files and generation settings;
``convert`` picks the family. Importing this package registers the converters behind
``GPT.from_hf``/``to_hf`` and ``BERT.from_hf``/``to_hf`` (``models/formats.py``): the models never
import this package, which imports them.
"""

from functools import partial

from lightning_megatron.huggingface.convert import (
    FAMILIES,
    HF_MODEL_TYPES,
    family_for,
    lightning_module_for,
    model_types_of,
    read_hf,
    read_hf_config_only,
    write_hf,
)
from lightning_megatron.huggingface.adapters import read_peft_adapter
from lightning_megatron.huggingface.lora_export import write_merged_hf
from lightning_megatron.huggingface.family import Family, TensorSource
from lightning_megatron.models.bert import BERTConfig
from lightning_megatron.models.formats import HFFormat, register_hf_format
from lightning_megatron.models.gpt import GPTConfig



def _hf_format(config_class: type) -> HFFormat:
    types = model_types_of(config_class)
    return HFFormat(read=partial(read_hf, model_types=types),
                    write=write_merged_hf if config_class is GPTConfig else write_hf,  # GPT modules carry LoRA
                    read_config=partial(read_hf_config_only, model_types=types),
                    read_peft_adapter=read_peft_adapter if config_class is GPTConfig else None)


register_hf_format(GPTConfig, _hf_format(GPTConfig))
register_hf_format(BERTConfig, _hf_format(BERTConfig))

__all__ = ["FAMILIES", "Family", "HF_MODEL_TYPES", "TensorSource", "family_for", "lightning_module_for", "read_hf",
           "write_hf"]
