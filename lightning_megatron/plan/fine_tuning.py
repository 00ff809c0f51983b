"""Which models fine-tune on one GPU: each preset planned on a single GPU with LoRA (the base frozen in 16 bits)
and with QLoRA (the base in 4-bit NF4, ``peft.nf4``), the same adapters and batch, by the same planner as every
other plan. ``lightning-megatron plan --fine-tuning-fit --gpu rtx-4090`` prints the table; docs/planner.md shows
it for a 24 GB and a 48 GB GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from lightning_megatron.models import GPT, GPTConfig
from lightning_megatron.plan.hardware import GIB, Hardware
from lightning_megatron.plan.layout import Workload
from lightning_megatron.plan.planner import LayoutPlan, Planner

#: The adapters planned: rank 16 on every attention and MLP linear layer (``LoRAConfig``'s default targets).
ADAPTERS = {"rank": 16, "alpha": 32}
#: Dense decoder presets of published models, smallest first (LoRA does not adapt MoE experts).
PRESETS = ("qwen3-0.6b", "gemma-3-1b", "llama-3.2-1b", "qwen3-4b", "mistral-7b", "qwen2.5-7b", "llama-3.1-8b", "qwen3-8b",
           "gemma-3-12b", "qwen3-14b", "gemma-3-27b", "qwen3-32b", "llama-3.1-70b")


@dataclass(frozen=True)
class FineTuningFit:
    """A preset on one GPU: its parameters, and LoRA's and QLoRA's layout that needs the least memory (it fits
    when any does; ``None``: no valid layout)."""

    preset: str
    parameters: int
    lora: Optional[LayoutPlan]
    qlora: Optional[LayoutPlan]


#: On the GPU alone: the offload tiers would put LoRA's 16-bit base in host memory (ZeRO-3's parameter offload) and
#: make any model "fit" at the host link's speed.
ON_THE_GPU = {"offload_optimizer": "none", "offload_parameters": "none"}


def _one_gpu_plan(preset: str, lora: dict, workload: Workload, hardware: Hardware) -> Optional[LayoutPlan]:
    result = Planner(lambda: GPT(preset, lora=lora), workload, hardware, world_size=1, fixed=ON_THE_GPU).plan()
    return min(result.plans, key=lambda plan: plan.memory_per_gpu_bytes, default=None)


def fine_tuning_fits(hardware: Hardware, *, seq_length: int = 4096, global_batch_size: int = 16,
                     presets: Sequence[str] = PRESETS) -> list[FineTuningFit]:
    """Each of ``presets`` fine-tuned on one ``hardware`` GPU in ``bf16-true`` (``global_batch_size`` sequences of
    ``seq_length`` tokens a step, accumulated), everything on the GPU (:data:`ON_THE_GPU`): LoRA's plan and
    QLoRA's."""
    workload = Workload(global_batch_size=global_batch_size, seq_length=seq_length, precision="bf16-true")
    return [FineTuningFit(preset, GPTConfig.from_name(preset).num_parameters(),
                          _one_gpu_plan(preset, dict(ADAPTERS), workload, hardware),
                          _one_gpu_plan(preset, {**ADAPTERS, "quantize_base": "nf4"}, workload, hardware))
            for preset in presets]


def _cell(plan: Optional[LayoutPlan]) -> str:
    if plan is None:
        return "no valid layout"
    where = "fits" if plan.fits else "no"
    return f"{where}: {plan.memory_per_gpu_bytes / GIB:.1f} GiB ({plan.layout.label()})"  # the least it needs


def format_fits(fits: Sequence[FineTuningFit], hardware: Hardware) -> str:
    """A Markdown table of :func:`fine_tuning_fits` (GiB per GPU of the plan, and its layout)."""
    lines = [f"One {hardware.name} ({hardware.memory_bytes / GIB:.1f} GiB), rank-{ADAPTERS['rank']} adapters on every "
             f"attention and MLP layer, bf16-true, no offload; the least memory a layout needs:", "",
             "| model | parameters | LoRA (16-bit base) | QLoRA (NF4 base) |", "|---|---|---|---|"]
    lines += [f"| {fit.preset} | {fit.parameters / 1e9:.1f}B | {_cell(fit.lora)} | {_cell(fit.qlora)} |"
              for fit in fits]
    return "\n".join(lines)
