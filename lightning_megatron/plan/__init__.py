"""The layout planner: which tp x pp x vpp x dp x cp x ep x ZeRO x recomputation x micro-batch to run.

For a model, a global batch and a machine it enumerates the layouts ``Megatron3DStrategy`` accepts, predicts
each one's memory per GPU (model states byte for byte as the strategy reports them, activations after
Korthikanti et al. 2022, a stated allowance for buffers) and step time (a roofline), and ranks those that fit
by tokens/s. ``lightning-megatron plan`` is its command; ``Megatron3DStrategy(tensor_parallel_size="auto")``
asks it for a layout. See ``docs/planner.md``.

Example::

    from lightning_megatron.plan import GPUS, Planner, Workload
    from lightning_megatron.models import GPT

    planner = Planner(lambda: GPT("gpt-8.3b"), Workload(global_batch_size=512, seq_length=1024), GPUS["a100"],
                      world_size=64)
    best = planner.plan().best
    print(best.layout.label(), best.tokens_per_second, best.memory_per_gpu_bytes)
"""

from lightning_megatron.plan.hardware import GPUS, Hardware, parse_bytes, parse_gpu
from lightning_megatron.plan.layout import Layout, Workload, check_layout
from lightning_megatron.plan.planner import LayoutPlan, Planner, PlanResult

__all__ = ["GPUS", "Hardware", "Layout", "LayoutPlan", "PlanResult", "Planner", "Workload", "check_layout",
           "parse_bytes", "parse_gpu"]
