"""The base layer: the parallel layout's sizes (``config``), the device mesh and its groups (``state``), the dropout
random streams (``random``), agreement between ranks (``agree``), layout-invariant initialisation (``initialize``),
how a local shard relates to its global tensor (``shards``), name matching (``names``) and the device checks a
run can switch on (``guards``). It imports no other part of the package: everything else builds on it."""

from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.random import TensorParallelRNG
from lightning_megatron.parallel.state import ParallelState

__all__ = ["ParallelConfig", "ParallelState", "TensorParallelRNG"]
