"""Datasets, tokenizers and data modules; the built-in corpus is the Python standard library."""

from lightning_megatron.data.bert import BERTDataModule, BERTPretrainingDataset
from lightning_megatron.data.corpus import ByteTokenizer, stdlib_source_files
from lightning_megatron.data.gpt import GPTDataModule, PackedTokenDataset

__all__ = ["ByteTokenizer", "GPTDataModule", "PackedTokenDataset", "stdlib_source_files"]
