"""lightning-megatron: Megatron-LM-style 3D parallelism for PyTorch Lightning.

Importing the package registers ``Trainer(strategy="megatron_3d")`` and the Hugging Face converters behind
``GPT.from_hf``/``to_hf`` and ``BERT.from_hf``/``to_hf``.
"""

from lightning_megatron import callbacks, checkpoint, data, huggingface, models, optim, parallel, pipeline, tensor_parallel
from lightning_megatron.parallel import ParallelConfig, ParallelState
from lightning_megatron.strategy import Megatron3DStrategy, register

__version__ = "0.1.0"

register()

__all__ = [
    "Megatron3DStrategy",
    "ParallelConfig",
    "ParallelState",
    "callbacks",
    "checkpoint",
    "data",
    "huggingface",
    "models",
    "optim",
    "parallel",
    "pipeline",
    "tensor_parallel",
]
