"""Callbacks that report what a Megatron user watches: throughput of the global batch (tokens/s, TFLOP/s per
device, MFU), the pipeline timeline; and ``SaveAndRequeue`` (``lightning_megatron.strategy.requeue``), which saves and
requeues a cluster job warned of its time limit."""

from __future__ import annotations

import time
from numbers import Number
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_megatron.models.batch_flops import data_parallel_size
from lightning_megatron.models.flops import flops_per_batch
from lightning_megatron.strategy.requeue import SaveAndRequeue  # noqa: F401  (a callback configs name here)

# Peak dense (no 2:4 sparsity) FLOP/s per device, from NVIDIA's datasheets: the tensor-core numbers, whose
# datasheet values are quoted "with sparsity" and are twice these. "tf32" is what fp32 matmuls run at when
# torch.set_float32_matmul_precision("high" or "medium") lets them use TF32 tensor cores; "fp32" is the plain rate.
#   H100 SXM, H100 PCIe (NVIDIA H100 Tensor Core GPU datasheet): BF16/FP16 1,979 / 1,513 sparse, TF32 989 / 756
#     sparse, FP32 67 / 51 TFLOPS.  H100 NVL: BF16 1,671 sparse, TF32 835 sparse, FP32 60.
#   H200 SXM, H200 NVL (NVIDIA H200 Tensor Core GPU datasheet): as H100 SXM and H100 NVL.
#   A100 SXM and PCIe (NVIDIA A100 Tensor Core GPU datasheet): BF16/FP16 312, TF32 156, FP32 19.5 TFLOPS (dense).
#   V100 SXM2, PCIe (NVIDIA V100 Tensor Core GPU datasheet): FP16 tensor 125 / 112, FP32 15.7 / 14 TFLOPS; no BF16.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "h100 sxm": {"bf16": 989.5e12, "fp16": 989.5e12, "tf32": 494.5e12, "fp32": 67e12},
    "h100 pcie": {"bf16": 756.5e12, "fp16": 756.5e12, "tf32": 378e12, "fp32": 51e12},
    "h100 nvl": {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12},
    "h200 sxm": {"bf16": 989.5e12, "fp16": 989.5e12, "tf32": 494.5e12, "fp32": 67e12},
    "h200 nvl": {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12},
    "a100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "v100 sxm": {"fp16": 125e12, "fp32": 15.7e12, "tf32": 15.7e12},
    "v100 pcie": {"fp16": 112e12, "fp32": 14e12, "tf32": 14e12},
}


def device_family(device_name: str) -> Optional[str]:
    """The :data:`PEAK_FLOPS` row of a CUDA device name (``torch.cuda.get_device_name()``), or None.

    Example::

        >>> device_family("NVIDIA H100 80GB HBM3"), device_family("NVIDIA H200"), device_family("NVIDIA A100-SXM4-80GB")
        ('h100 sxm', 'h200 sxm', 'a100')
    """
    name = device_name.lower()
    for chip in ("h200", "h100"):
        if chip in name:
            form = "nvl" if "nvl" in name else "pcie" if ("pcie" in name or "hbm2e" in name) else "sxm"
            return None if chip == "h200" and form == "pcie" else f"{chip} {form}"
    if "a100" in name:
        return "a100"
    if "v100" in name:
        return "v100 pcie" if "pcie" in name else "v100 sxm"
    return None


def compute_dtype(precision: str) -> Optional[str]:
    """The :data:`PEAK_FLOPS` column of a Lightning precision (``"bf16-mixed"`` -> ``"bf16"``), or None."""
    precision = str(precision)
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    if precision.startswith("32"):
        return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return None


def peak_flops_of(device: torch.device, precision: str) -> Optional[float]:
    """Peak dense FLOP/s of ``device`` for matmuls at ``precision``, from :data:`PEAK_FLOPS`; None if not known."""
    if device.type != "cuda":
        return None
    family, dtype = device_family(torch.cuda.get_device_name(device)), compute_dtype(precision)
    return PEAK_FLOPS.get(family, {}).get(dtype) if family is not None and dtype is not None else None


class TokenThroughput(L.Callback):
    """Logs the throughput of each optimizer step to the progress bar and the loggers:

    * ``tokens_per_sec``: tokens of the global batch per second;
    * ``tflops_per_device``: the model FLOPs of the global batch per second, divided over all devices;
    * ``mfu``: ``tflops_per_device`` over the device's peak (model FLOPs utilisation, PaLM's definition).

    The global batch of one optimizer step is what every data-parallel replica trained on:
    ``per-rank batch x dp x accumulate_grad_batches`` samples (``dp`` is the strategy's
    ``distributed_sampler_kwargs["num_replicas"]``, 1 without one). Its model FLOPs
    (``models/flops.py``: forward + backward, recomputation not counted) are done by all
    ``world_size = tp x cp x pp x dp`` devices together, so per device they are ``global FLOPs / step
    time / world_size``. The model's FLOPs come from its ``flops_per_batch(batch_size, seq_length)``
    method; without one, from ``models/flops.py`` on ``pl_module.config``; else a ``flops_per_batch``
    *number* (the attribute Lightning's ``ThroughputMonitor`` reads) is taken as the model FLOPs of one rank's batch.

    Why this and not ``lightning.pytorch.callbacks.ThroughputMonitor``: Lightning multiplies each rank's
    counts by the world size (``samples_per_sec = device/samples_per_sec x world_size``, the module's
    ``flops_per_batch`` number ``x world_size``), but the ``tp x pp`` ranks of one replica train on the
    same samples. Its samples/s and items/s are therefore ``tp x pp`` times too high, and so are its FLOP/s,
    per-device FLOP/s and MFU when a module's own ``flops_per_batch`` is the model's FLOPs of a rank's batch
    (what its docs compute with ``measure_flops`` on the whole model): 2x at tp=2 or pp=2, 4x at tp=2 x pp=2,
    measured side by side in ``tests/test_throughput.py``. GPT's and BERT's ``flops_per_batch`` is one
    device's share instead (``models/batch_flops.py``), so with them its FLOP/s and MFU are right. It also
    logs from rank 0 only, once its window (100 updates by default) is full.

    ``peak_flops``: a device's peak FLOP/s for MFU; by default from :data:`PEAK_FLOPS` for the CUDA
    device and the Trainer's precision. Without one (on CPU, or a device not in the table) MFU is not
    logged, which an info message says once. ``clock``: seconds, read once at the end of each optimizer
    step (after a CUDA synchronize); the first step of each epoch is skipped (start-up work), and
    validation between two steps is not counted. ``key``: the batch entry holding the token ids ``[B, S]``.
    Every rank logs its own measurement (no collective); ranks wait for each other inside every step.

    Example::

        trainer = L.Trainer(strategy=Megatron3DStrategy(tensor_parallel_size=2), devices=8, precision="bf16-mixed",
                            callbacks=[TokenThroughput()])   # H100: MFU against 989.5 TFLOP/s
    """

    def __init__(self, *, key: str = "input_ids", peak_flops: Optional[float] = None,
                 clock: Callable[[], float] = time.perf_counter, prog_bar: bool = True) -> None:
        self.key, self.peak_flops, self.clock, self.prog_bar = key, peak_flops, clock, prog_bar
        #: The last step's values, as logged.
        self.metrics: dict[str, float] = {}
        self._peak: Optional[float] = peak_flops
        self._last: Optional[float] = None
        self._step: Optional[int] = None
        self._tokens = 0
        self._flops: Optional[float] = 0
        self._validation_start: Optional[float] = None
        self._said_no_flops = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.peak_flops is None:
            device = trainer.strategy.root_device
            self._peak = peak_flops_of(device, trainer.precision)
            if self._peak is None and stage == "fit":
                where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type.upper()
                rank_zero_info(f"TokenThroughput: no peak FLOP/s known for {where} at precision={trainer.precision}, "
                               f"so MFU is not logged; pass TokenThroughput(peak_flops=...) for it.")

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last, self._step, self._tokens, self._flops = None, trainer.global_step, 0, 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if isinstance(batch, dict) and self.key in batch:
            batch_size, seq_length = batch[self.key].shape[:2]
            self._tokens += batch_size * seq_length
            flops = _model_flops(pl_module, batch_size, seq_length)
            self._flops = None if flops is None or self._flops is None else self._flops + flops
        if trainer.global_step == self._step:  # accumulating: the optimizer has not stepped yet
            return
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        now = self.clock()
        if self._last is not None and self._tokens and now > self._last:
            self._log(trainer, pl_module, now - self._last)
        self._last, self._step, self._tokens, self._flops = now, trainer.global_step, 0, 0

    def _log(self, trainer: L.Trainer, pl_module: L.LightningModule, seconds: float) -> None:
        dp = data_parallel_size(trainer)
        self.metrics = {"tokens_per_sec": self._tokens * dp / seconds}
        if self._flops is not None:
            per_device = self._flops * dp / seconds / trainer.world_size
            self.metrics["tflops_per_device"] = per_device / 1e12
            if self._peak:
                self.metrics["mfu"] = per_device / self._peak
        elif not self._said_no_flops:
            self._said_no_flops = True
            rank_zero_info(f"TokenThroughput: {type(pl_module).__name__} has no `flops_per_batch(batch_size, "
                           f"seq_length)` method and no GPTConfig or BERTConfig `config`, so only tokens/s is logged.")
        for name, value in self.metrics.items():
            pl_module.log(name, value, prog_bar=self.prog_bar, on_step=True, on_epoch=False)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._validation_start = self.clock() if self._last is not None else None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._validation_start is not None and self._last is not None:
            self._last += self.clock() - self._validation_start  # the next step's time leaves validation out
        self._validation_start = None


def _model_flops(pl_module: L.LightningModule, batch_size: int, seq_length: int) -> Optional[float]:
    """Model FLOPs of one rank's ``batch_size x seq_length`` batch: the module's ``flops_per_batch`` method, else
    ``models/flops.py`` on its ``config``, else its ``flops_per_batch`` number (Lightning's convention); None if
    none is there. The config comes before the number: GPT's and BERT's number is one device's share."""
    own = getattr(pl_module, "flops_per_batch", None)
    if callable(own):
        return own(batch_size, seq_length)
    config = getattr(pl_module, "config", None)
    if config is not None:
        try:
            return flops_per_batch(config, batch_size, seq_length)
        except TypeError:
            pass
    return own if isinstance(own, Number) else None


class StepRichProgressBar(RichProgressBar):
    """Lightning's rich progress bar, which reads "Epoch 0/-2" in a run by ``max_steps`` (``max_epochs=-1``: no
    epoch limit); this one reads "Epoch 0" there, the bar counting the batches. ``lightning-megatron`` uses it in
    place of Lightning's default."""

    def _get_train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        if max_epochs is None or max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"  # padded as Lightning's, no flicker


class PipelineTimeline(L.Callback):
    """Records one training step's pipeline schedule and renders it as a PNG (needs the ``[plot]`` extra).

    Rows are pipeline ranks, boxes are the forward (light) and backward (dark) of each
    micro-batch (hatched: the weight-gradient pass of a zero-bubble schedule); the title compares the measured bubble with the theoretical one. The
    measured fraction is also logged as ``pipeline_bubble``.

    Example::

        Trainer(strategy=Megatron3DStrategy(pipeline_parallel_size=4), callbacks=[PipelineTimeline(step=5)])
    """

    def __init__(self, *, step: int = 3, path: str = "pipeline_timeline.png") -> None:
        self.step, self.path = step, path
        self.measured: Optional[float] = None
        self.theory: Optional[float] = None

    def _recorder(self, trainer: L.Trainer):
        recorder = getattr(trainer.strategy, "pipeline_recorder", None)
        if recorder is None:
            raise RuntimeError("PipelineTimeline needs Megatron3DStrategy with pipeline_parallel_size > 1.")
        return recorder

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and batch_idx % trainer.accumulate_grad_batches == 0:
            recorder = self._recorder(trainer)
            recorder.events.clear()
            recorder.active = True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        recorder = self._recorder(trainer)
        if not recorder.active:
            return
        recorder.active = False
        from lightning_megatron.pipeline.timeline import measured_bubble, render, schedule_theory

        strategy = trainer.strategy
        state = strategy.parallel_state
        # One pipeline is enough: the ranks with dp rank 0, cp rank 0 and tp rank 0.
        mine = recorder.events if state.replica_rank == 0 and state.tensor_parallel_rank == 0 else []
        gathered = [None] * trainer.world_size
        torch.distributed.all_gather_object(gathered, mine)
        events = [event for part in gathered for event in part]
        micro_batches = len({(e.stage, e.micro_batch) for e in events if e.kind == "forward"}) // max(
            1, len({e.stage for e in events}))
        config = state.config
        self.theory = schedule_theory(strategy.options.pipeline_schedule, recorder, config.pipeline_parallel_size, micro_batches,
                                      config.virtual_pipeline_size)
        self.measured = measured_bubble(events)
        pl_module.log("pipeline_bubble", self.measured, rank_zero_only=True)
        if trainer.is_global_zero:
            title = f"{strategy.options.pipeline_schedule}, pp={config.pipeline_parallel_size}, vpp={config.virtual_pipeline_size}"
            render(events, Path(self.path), title=title, theory=self.theory)
            print(f"Pipeline timeline written to {self.path}: bubble measured {self.measured:.1%}, theory {self.theory:.1%}")
