"""Datasets, tokenizers and data modules; the built-in corpus is the Python standard library."""

from lightning_megatron.data.base import DataParallelDataModule
from lightning_megatron.data.bert import BERTDataModule, BERTPretrainingDataset
from lightning_megatron.data.corpus import ByteTokenizer, stdlib_source_files
from lightning_megatron.data.blend import BlendedDataset
from lightning_megatron.data.gpt import GPTDataModule
from lightning_megatron.data.gpt_dataset import DocumentMasks, GPTDataset
from lightning_megatron.data.indexed import IndexedDataset, IndexedDatasetWriter
from lightning_megatron.data.sft import SFTDataModule
from lightning_megatron.data.tokenizers import HFTokenizer, load_tokenizer

__all__ = [
    "BERTDataModule",
    "BERTPretrainingDataset",
    "BlendedDataset",
    "ByteTokenizer",
    "DataParallelDataModule",
    "DocumentMasks",
    "GPTDataModule",
    "GPTDataset",
    "HFTokenizer",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "SFTDataModule",
    "load_tokenizer",
    "stdlib_source_files",
]
