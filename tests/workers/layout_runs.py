"""What the layout workers share: the main loop (every layout of a job, one after another, over the
same processes: starting processes and importing Lightning costs ~10 s a launch), and the pipeline schedule wired
to the step's gradient bookkeeping as the strategy wires it.

``layouts_job(out_dir, layouts, train, tools)`` is a layout worker's ``main`` (``entry.py``). A layout starting with
one of ``tools``' prefixes goes to that function, whose result is this rank's entry; any other goes to
``train(layout) -> (losses, weights)``, rank 0 writing ``{layout}.pt`` with both. Each rank writes its entries to
``rank{r}.json``.
"""

import json
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.distributed as dist


def layouts_job(out_dir: Path, layouts: list[str], train: Callable, tools: Mapping[str, Callable] = {}) -> None:
    """Every layout of ``layouts`` in turn on this rank (a worker's ``main``, see ``entry.py``)."""
    rank = dist.get_rank()
    summary = {}
    for layout in layouts:
        tool = next((tool for prefix, tool in tools.items() if layout.startswith(prefix)), None)
        if tool is not None:
            summary[layout] = tool(layout)
            continue
        losses, weights = train(layout)
        if rank == 0:
            torch.save({"losses": losses, "weights": weights}, out_dir / f"{layout}.pt")
        summary[layout] = losses
    (out_dir / f"rank{rank}.json").write_text(json.dumps(summary))
    dist.barrier()


def start_worker_pipeline(split, state, step, micro_batch_size: int, schedule: str = "1f1b"):
    """``preparation.start_pipeline`` (1F1B by default) with the strategy's ``before_backward``: the gradient buckets
    expect one backward per micro-batch, and the schedule scales each loss sum by ``step``'s backward scale."""
    from lightning_megatron.strategy.options import StrategyOptions
    from lightning_megatron.strategy.preparation import start_pipeline

    def before_backward(count, tokens):
        step.sync.start_micro_batch(sync=True, backward_passes=count)
        runner.loss_scale = step.backward_scale(tokens, accumulation=1, loss_scale=1.0)

    config = state.config
    options = StrategyOptions(pipeline_parallel_size=config.pipeline_parallel_size, zero_stage=config.zero_stage,
                              virtual_pipeline_size=config.virtual_pipeline_size, pipeline_schedule=schedule,
                              micro_batch_size=micro_batch_size)
    runner = start_pipeline(split, state, options, device=torch.device("cpu"), recorder=None,
                            before_backward=before_backward)
    return runner

