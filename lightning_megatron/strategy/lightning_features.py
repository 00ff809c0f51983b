"""Lightning features on a split model: what the strategy adapts, and what it refuses up front.

* torchmetrics ``Metric`` states stay fp32 whatever the precision (``bf16-true`` converts the whole
  module, metric states included, and a bf16 running mean of losses is rounded to 3 significant
  digits: ModelCheckpoint and EarlyStopping would compare rounded numbers), and sync over the
  data-parallel group (tp / pp ranks of one replica hold the same values).
* ``StochasticWeightAveraging`` and ``Trainer(detect_anomaly=True)`` under pipelining cannot work
  (the reasons are in the errors): :func:`check_trainer_features` refuses them on every rank before
  the process group exists, so no rank waits in a collective for one that failed.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_megatron.parallel.config import ParallelConfig

_HALF = (torch.float16, torch.bfloat16)


def _half_to_fp32(tensor: Tensor) -> Tensor:
    return tensor.float() if tensor.dtype in _HALF else tensor


def _has_half_state(metric: Metric) -> bool:
    # Not metric.dtype alone: a .to(device) after the precision plugin's .to(dtype) resets it to fp32 (the dtype
    # of torch.zeros(1)) and leaves the states in bf16.
    for name in metric._defaults:
        value = getattr(metric, name)
        if any(isinstance(t, Tensor) and t.dtype in _HALF for t in (value if isinstance(value, list) else [value])):
            return True
    return metric.dtype in _HALF


def prepare_metrics(module: nn.Module, data_parallel_group: Optional[dist.ProcessGroup]) -> None:
    """Every ``Metric`` in ``module``: 16-bit floating states back to fp32 (integer states untouched,
    unlike ``Metric.set_dtype``), and synchronised over ``data_parallel_group``."""
    for metric in module.modules():
        if not isinstance(metric, Metric):
            continue
        if _has_half_state(metric):
            # Metric._apply converts states, defaults and metric.dtype (what update() casts inputs to) for any
            # function but .half()/.float()/...; this one only widens what the precision plugin narrowed.
            metric._apply(_half_to_fp32)
        if data_parallel_group is not None:
            metric.process_group = data_parallel_group


def evaluation_mode(*, zero3: bool):
    """Around validation / test / predict steps. Lightning evaluates under inference_mode (on NCCL); FSDP's
    (ZeRO-3's) sharded parameters must not be touched there, or training afterwards fails on "inplace update
    to inference tensor"."""
    if not zero3:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack


def _layout(config: ParallelConfig) -> str:
    return (f"tensor_parallel_size={config.tensor_parallel_size}, pipeline_parallel_size="
            f"{config.pipeline_parallel_size}, zero_stage={config.zero_stage}")


def check_trainer_features(trainer, config: ParallelConfig) -> None:
    """Raise (the same error on every rank) for Trainer features that cannot run at this layout."""
    if trainer is None:
        return
    split = config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1 or config.zero_stage == 3
    if split and any(isinstance(callback, StochasticWeightAveraging) for callback in trainer.callbacks):
        raise ValueError(
            f"StochasticWeightAveraging cannot average a model split with {_layout(config)}: it deep-copies the "
            f"LightningModule in its setup hook, before configure_model builds the model and before the strategy "
            f"keeps only this rank's shards and stages, and it saves that copy as callback state, which a sharded "
            f"checkpoint keeps from rank 0 only"
            + (" (under pipelining it also turns Lightning's backward back on after every epoch)"
               if config.pipeline_parallel_size > 1 else "")
            + ". Remove the callback and average checkpoints instead: save one per epoch of the averaging phase "
            "(ModelCheckpoint(every_n_epochs=1, save_top_k=-1)) and average their weights, read with "
            "lightning_megatron.checkpoint.consolidated_state_dict (any layout)."
        )
    if getattr(trainer, "_detect_anomaly", False) and config.pipeline_parallel_size > 1:
        raise ValueError(
            f"Trainer(detect_anomaly=True) cannot run with pipeline_parallel_size={config.pipeline_parallel_size}: "
            f"in its first step torch.distributed.pipelining infers each stage's shapes by running forward and "
            f"backward on uninitialised tensors, and anomaly mode reports their NaNs as an error of some backward "
            f"on some ranks (\"Function '...Backward' returned nan values\") while the others wait. Set "
            f"detect_anomaly=False: the strategy's on_nonfinite='error' (the default) still stops every rank at the "
            f"first NaN/Inf loss or gradient and names the step and the ranks; or look for the anomaly with "
            f"pipeline_parallel_size=1, where tensor and data parallelism run under detect_anomaly."
        )
