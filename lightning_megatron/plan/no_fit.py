"""Why no layout fits or none is valid, in words a user can act on: the limit the nearest layout exceeds, the
nearest GPU count that would run the model, and, for a model that could fine-tune with LoRA instead, what that
would need (and with QLoRA's 4-bit base, where LoRA's 16-bit one does not fit). ``lightning-megatron plan`` prints it, and the strategy's ``"auto"`` sizes raise it (``plan.auto``).
"""

from __future__ import annotations

import copy
from typing import Optional

from lightning_megatron.plan.hardware import GIB
from lightning_megatron.plan.planner import LayoutPlan, Planner, PlanResult


def explain_no_fit(result: PlanResult, planner: Planner) -> str:
    """Why nothing fits or nothing is valid, and the nearest layout that would run."""
    hardware, world = planner.hardware, planner.world_size
    if not result.plans:
        reasons = "\n  ".join(list(result.refused.values())[:4]) or "(no candidate layouts)"
        nearby = nearest_world_with_layout(planner)
        hint = (f"\nThe nearest GPU count with a valid layout is {nearby[0]}: {nearby[1].layout.label()} "
                f"({nearby[1].memory_per_gpu_bytes / GIB:.1f} GiB per GPU, {'fits' if nearby[1].fits else 'does not fit'})."
                if nearby else "")
        return f"No layout of {type(planner.module).__name__} is valid on {world} GPUs:\n  {reasons}{hint}"
    nearest = result.nearest
    states = nearest.memory_per_gpu_bytes - nearest.activation_bytes - nearest.buffer_bytes  # the GPU's part
    text = (f"No layout fits in {hardware.memory_bytes / GIB:.1f} GiB per GPU on {world} GPUs (with "
            f"{hardware.host_memory_bytes / GIB:.1f} GiB of host memory and {hardware.disk_bytes / GIB:.1f} GiB of disk "
            f"per node): the smallest on the GPU, {nearest.layout.label()}, needs {nearest.memory_per_gpu_bytes / GIB:.1f} GiB (model "
            f"states {states / GIB:.1f} GiB, activations {nearest.activation_bytes / GIB:.1f} GiB, buffers "
            f"{nearest.buffer_bytes / GIB:.1f} GiB), {nearest.host_bytes_per_node / GIB:.1f} GiB of host memory and "
            f"{nearest.disk_bytes_per_node / GIB:.1f} GiB of disk per node, and exceeds {'; '.join(nearest.limits)}.")
    bigger = nearest_world_with_layout(planner, must_fit=True)
    if bigger is not None:
        text += (f" It would fit on {bigger[0]} GPUs as {bigger[1].layout.label()} "
                 f"({bigger[1].memory_per_gpu_bytes / GIB:.1f} GiB per GPU).")
    else:
        text += " More GPUs (up to 8x) do not make it fit either: lower the micro-batch, the sequence, or use GPUs " \
                "with more memory."
    return text + lora_alternative(planner)


#: The adapters :func:`lora_alternative` plans: rank 16 on every attention and MLP linear layer (LoRAConfig's targets).
LORA_HINT = {"rank": 16, "alpha": 32}


def _plan_with_lora(planner: Planner, hparams: dict, lora: dict) -> Optional[PlanResult]:
    try:  # a subclass that its hyper-parameters do not rebuild: no estimate, the explanation above stands
        return Planner(lambda: type(planner.module)(**copy.deepcopy({**hparams, "lora": lora})), planner.workload,
                       planner.hardware, world_size=planner.world_size, fixed=planner.fixed).plan()
    except (TypeError, ValueError):
        return None


def _found(result: Optional[PlanResult], planner: Planner) -> str:
    if result is not None and result.best is not None:
        where = "this GPU" if planner.world_size == 1 else f"these {planner.world_size} GPUs"
        return (f"fits on {where} as {result.best.layout.label()} ({result.best.memory_per_gpu_bytes / GIB:.1f} GiB "
                f"per GPU, {result.best.tokens_per_second:,.0f} tokens/s)")
    if result is not None and result.nearest is not None:
        return (f"does not fit either: its smallest layout, {result.nearest.layout.label()}, needs "
                f"{result.nearest.memory_per_gpu_bytes / GIB:.1f} GiB per GPU")
    return "has no valid layout on these GPUs either"


def lora_alternative(planner: Planner) -> str:
    """For a model that trains in full and could train LoRA adapters instead (``lora=None`` in its hyper-parameters,
    as ``GPT``): what the same plan needs with ``LORA_HINT``'s adapters and the base frozen in 16 bits, from a plan of
    that model, and where that does not fit, with the base in 4-bit NF4 (QLoRA, ``peft.nf4``); empty for any other
    module."""
    hparams = dict(getattr(planner.module, "hparams", None) or {})
    if "lora" not in hparams or hparams["lora"] is not None:
        return ""
    lora = _plan_with_lora(planner, hparams, dict(LORA_HINT))
    if lora is None:
        return ""
    setting = f"model.init_args.lora: {{rank: {LORA_HINT['rank']}, alpha: {LORA_HINT['alpha']}}}"
    text = (f"\nFine-tuning a pretrained model? LoRA trains small adapters and keeps the base frozen in 16 bits "
            f"(no gradients, fp32 copies or optimizer state for it): with {setting} the same batch "
            f"{_found(lora, planner)}.")
    if lora.best is None:
        qlora = _plan_with_lora(planner, hparams, {**LORA_HINT, "quantize_base": "nf4"})
        text += (f" QLoRA holds the frozen base in 4-bit NF4 (about 0.52 bytes a parameter): with "
                 f"{setting[:-1]}, quantize_base: nf4}} the same batch {_found(qlora, planner)}.")
    return text


def nearest_world_with_layout(planner: Planner, *, must_fit: bool = False) -> Optional[tuple[int, LayoutPlan]]:
    """The GPU count nearest ``planner.world_size`` (whole nodes, up to 8x more; fewer too unless ``must_fit``)
    with a valid (``must_fit``: fitting) layout, and that layout."""
    world, node = planner.world_size, planner.hardware.gpus_per_node
    step = node if world >= node else 1
    counts = sorted({w for w in range(step, 8 * world + 1, step) if w != world and (w > world or not must_fit)},
                    key=lambda w: (abs(w - world), w))
    for count in counts[:16]:
        other = Planner(planner.make_module, planner.workload, planner.hardware, world_size=count, fixed=planner.fixed)
        other._inventories = planner._inventories  # the same tp builds
        result = other.plan()
        chosen = result.best if must_fit else (result.best or result.nearest)
        if chosen is not None:
            return count, chosen
    return None
