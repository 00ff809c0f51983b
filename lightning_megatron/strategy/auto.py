"""``Megatron3DStrategy(tensor_parallel_size="auto", ...)``: the planner chooses the sizes left to it.

The strategy calls :func:`choose_for_options` (its options, read into :func:`choose_sizes`) in
``setup_environment``, on every rank, before any process group exists: planning is deterministic, so every
rank chooses the same layout (or raises the same error). The sizes given as integers, and the strategy's
other settings (ZeRO stage, sequence parallelism, recomputation, micro-batch size, offloading, parameter-gather
overlap), are kept; the planner searches the ``"auto"`` ones for the layout that fits the devices present
with the most predicted tokens/s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from lightning_megatron.plan.hardware import GB, GIB, GPUS, TFLOPS, Hardware, preset_for_device
from lightning_megatron.plan.layout import Workload
from lightning_megatron.plan.planner import LayoutPlan, Planner

#: The strategy's size arguments that may be ``"auto"``.
AUTO_SIZES = ("tensor_parallel_size", "pipeline_parallel_size", "virtual_pipeline_size", "context_parallel_size",
              "expert_parallel_size")


@dataclass(frozen=True)
class AutoChoice:
    sizes: dict[str, int]  # every AUTO_SIZES entry and data_parallel_size, as the strategy takes them
    pipeline_schedule: str
    plan: LayoutPlan
    message: str


def device_hardware(device: torch.device, gpus_per_node: int) -> tuple[Hardware, str]:
    """The hardware preset of ``device`` (by its CUDA name) with its real memory and the host's RAM, and what was
    assumed."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        memory = torch.cuda.get_device_properties(device).total_memory
        preset = preset_for_device(name, memory)
        hardware = GPUS[preset or "a100"]
        note = f"{name}" + ("" if preset else " (not a known GPU: A100's rates assumed)")
        return replace(hardware, name=preset or f"a100 rates on {name}", memory_bytes=memory,
                       gpus_per_node=gpus_per_node, host_memory_bytes=ram), note
    # No GPU: nominal numbers, so that "auto" runs (and is tested) on CPU; its ranking is not a speed model.
    cpu = Hardware("cpu", 1 * TFLOPS, 1 * TFLOPS, ram // max(gpus_per_node, 1), 20 * GB, 10 * GB, 1 * GB,
                   gpus_per_node, matmul_efficiency=0.5)
    return cpu, f"CPU (its memory shared by {gpus_per_node} processes; nominal rates)"


def choose_sizes(module: Any, requested: dict[str, Any], *, world_size: int, device: torch.device,
                 gpus_per_node: int, global_batch_size: Optional[int], seq_length: Optional[int], precision: str,
                 settings: dict[str, Any], accumulate_grad_batches: int = 1, bucket_size_mb: float = 25.0,
                 pad_vocab_to_multiple_of: int = 128) -> AutoChoice:
    """The sizes for the ``"auto"`` entries of ``requested`` (the strategy's size arguments); ``settings``: the
    strategy's other layout arguments (zero_stage, sequence_parallel, ...), kept as they are."""
    if global_batch_size is None or seq_length is None:
        raise ValueError("Megatron3DStrategy sizes set to 'auto' are chosen for the run's global batch and sequence "
                         "length, which the data module must expose as global_batch_size and seq_length (as "
                         "lightning_megatron.data's modules do). Set the sizes explicitly, or use such a data module.")
    hparams = dict(getattr(module, "hparams", {}) or {})

    def make_module():
        try:
            return type(module)(**hparams)
        except TypeError as error:
            raise ValueError(f"Megatron3DStrategy's 'auto' sizes build {type(module).__name__} again from its "
                             f"hyper-parameters to plan it, which failed ({error}). Call save_hyperparameters() in its "
                             f"__init__, or set the sizes explicitly.") from None

    hardware, note = device_hardware(device, gpus_per_node)
    fixed = {name: value for name, value in requested.items() if name in AUTO_SIZES and value != "auto"}
    fixed.update(settings)
    for name in ("offload_optimizer", "offload_parameters"):  # the user's choice (or none), never searched for "auto"
        fixed.setdefault(name, "none")
    if requested.get("data_parallel_size", "auto") != "auto":
        fixed["data_parallel_size"] = requested["data_parallel_size"]
    fixed["accumulate_grad_batches"] = accumulate_grad_batches
    # The data module's global batch is one loader batch; the Trainer's accumulation makes the optimizer step's.
    workload = Workload(global_batch_size * accumulate_grad_batches, seq_length, precision, bucket_size_mb=bucket_size_mb,
                        pad_vocab_to_multiple_of=pad_vocab_to_multiple_of)
    planner = Planner(make_module, workload, hardware, world_size=world_size, fixed=fixed)
    result = planner.plan()
    best = result.best
    if best is None:
        from lightning_megatron.plan.no_fit import explain_no_fit

        raise ValueError(f"Megatron3DStrategy could not choose the 'auto' sizes: {explain_no_fit(result, planner)}")
    layout = best.layout
    sizes = {name: getattr(layout, name) for name in (*AUTO_SIZES, "data_parallel_size")}
    others = [p for p in result.fitting[1:] if p.layout != layout][:1]
    message = (f"Megatron3DStrategy chose {layout.label()} for the 'auto' sizes on {world_size} x {note}: predicted "
               f"{best.memory_per_gpu_bytes / GIB:.2f} of {hardware.memory_bytes / GIB:.2f} GiB per device, "
               f"{best.tokens_per_second:,.0f} tokens/s, MFU {best.mfu:.1%}, the fastest of {len(result.fitting)} "
               f"layouts that fit ({len(result.plans)} valid)"
               + (f"; next: {others[0].layout.label()} at {others[0].tokens_per_second:,.0f} tokens/s" if others else "")
               + ". Set the sizes explicitly to skip planning.")
    return AutoChoice(sizes, layout.pipeline_schedule, best, message)


def choose_for_options(module: Any, options: Any, *, world_size: int, device: torch.device, gpus_per_node: int,
                       precision: str) -> AutoChoice:
    """:func:`choose_sizes` for the strategy's ``options`` (``strategy.options.StrategyOptions``): the global batch
    and sequence length from the Trainer's data module, its gradient accumulation, and the options' other layout
    settings kept. The choice's ``pipeline_schedule`` is the one to run: the options' own, or, where that is 1F1B
    (the default), interleaved 1F1B if the planner chose virtual stages."""
    trainer = getattr(module, "_trainer", None)
    datamodule = getattr(trainer, "datamodule", None)
    requested, offload = options.requested, options.offload
    settings = dict(zero_stage=requested["zero_stage"], sequence_parallel=requested["sequence_parallel"],
                    activation_checkpointing=options.activation_checkpointing, offload_optimizer=offload.optimizer,
                    offload_parameters=offload.parameters, micro_batch_size=options.micro_batch_size,
                    overlap_param_gather=options.overlap_param_gather)
    if options.pipeline_schedule != "1f1b":
        settings["pipeline_schedule"] = options.pipeline_schedule  # kept; the planner's default is 1F1B or interleaved
    return choose_sizes(module, requested, world_size=world_size, device=device, gpus_per_node=gpus_per_node,
                        global_batch_size=getattr(datamodule, "global_batch_size", None),
                        seq_length=getattr(datamodule, "seq_length", None), precision=precision, settings=settings,
                        accumulate_grad_batches=getattr(trainer, "accumulate_grad_batches", 1),
                        bucket_size_mb=options.bucket_size_mb, pad_vocab_to_multiple_of=options.pad_vocab_to_multiple_of)
