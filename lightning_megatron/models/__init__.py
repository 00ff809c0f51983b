"""Models: plain-PyTorch transformer blocks and the GPT and BERT LightningModules."""

from lightning_megatron.models.bert import BERT, BERT_PRESETS, BERTConfig, BERTModel
from lightning_megatron.models.gpt import GPT, GPT_PRESETS, GPTConfig, GPTModel
from lightning_megatron.models.transformer import MLP, SelfAttention, TransformerLayer

__all__ = ["BERT", "BERTConfig", "BERTModel", "BERT_PRESETS", "GPT", "GPTConfig", "GPTModel", "GPT_PRESETS", "MLP", "SelfAttention", "TransformerLayer"]
