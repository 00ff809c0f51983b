"""Models: plain-PyTorch transformer blocks and the GPT LightningModule."""

from lightning_megatron.models.gpt import GPT, GPT_PRESETS, GPTConfig, GPTModel
from lightning_megatron.models.transformer import MLP, SelfAttention, TransformerLayer

__all__ = ["GPT", "GPTConfig", "GPTModel", "GPT_PRESETS", "MLP", "SelfAttention", "TransformerLayer"]
