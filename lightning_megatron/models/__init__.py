"""Models: plain-PyTorch transformer pieces and the GPT and BERT LightningModules."""

from lightning_megatron.models.attention import CoreAttention, SelfAttention
from lightning_megatron.models.bert import BERT, BERT_PRESETS, BERTConfig, BERTModel
from lightning_megatron.models.gpt import GPT, GPT_PRESETS, GPTConfig, GPTModel
from lightning_megatron.models.hf_causal_lm import HFCausalLM
from lightning_megatron.models.mlp import MLP, GatedMLP
from lightning_megatron.models.norms import RMSNorm
from lightning_megatron.models.rotary import RopeScaling, RotaryEmbedding
from lightning_megatron.models.transformer import TransformerLayer

__all__ = ["BERT", "BERTConfig", "BERTModel", "BERT_PRESETS", "CoreAttention", "GPT", "GPTConfig", "GPTModel",
           "GPT_PRESETS", "GatedMLP", "HFCausalLM", "MLP", "RMSNorm", "RopeScaling", "RotaryEmbedding", "SelfAttention",
           "TransformerLayer"]
