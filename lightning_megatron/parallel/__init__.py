"""The parallel layout: sizes, the device mesh, and the dropout random streams."""

from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.random import TensorParallelRNG
from lightning_megatron.parallel.state import ParallelState

__all__ = ["ParallelConfig", "ParallelState", "TensorParallelRNG"]
