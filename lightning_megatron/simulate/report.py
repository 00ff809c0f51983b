"""Which ranks to simulate, the planner's prediction beside each, and the table ``lightning-megatron simulate`` prints.

The planner predicts, per pipeline rank, the bytes a rank's program holds at its peak: its model state on the GPU
(``plan.model_state``), the saved activations of the micro-batches in flight with the step's transients
(``plan.activations.activation_bytes``) and the buffers the program allocates (ZeRO-2's buckets, ZeRO-3's gathered
layers). Its total also carries ``FRAMEWORK_BYTES``, an allowance for what no program allocates (the CUDA context,
the communication library's buffers, the allocator's slack); a simulation allocates none of that, so the planned
figure set beside a simulated peak is the planner's total without that allowance.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional, Sequence

from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.plan.activations import FRAMEWORK_BYTES, activation_bytes, buffer_bytes
from lightning_megatron.plan.hardware import GIB
from lightning_megatron.plan.layout import Layout
from lightning_megatron.plan.model_state import placement
from lightning_megatron.plan.planner import Planner
from lightning_megatron.simulate.step import CATEGORIES, RankResult


def ranks_that_differ(config: ParallelConfig) -> list[int]:
    """The ranks whose memory or traffic can differ, in pipeline order: the first data-parallel rank of the first
    pipeline stage (the most micro-batches in flight, the embedding) and of the last (the output layer and the loss);
    without pipelining, the last data-parallel rank (ZeRO's padding falls on the last ranks: pipelined, ``--ranks``
    adds it, at a pipelined step's cost); with expert parallelism, the last rank of the first stage's expert group."""
    def rank(pipeline_rank: int = 0, data_rank: int = 0) -> int:
        return config.rank_of(pipeline_rank=pipeline_rank, data_rank=data_rank, tensor_rank=0)

    ranks = {rank(), rank(pipeline_rank=config.pipeline_parallel_size - 1)}
    if config.pipeline_parallel_size == 1:
        ranks.add(rank(data_rank=config.data_parallel_size - 1))
    if config.expert_parallel_size > 1:
        ranks.add(rank(data_rank=config.expert_parallel_size - 1))
    return sorted(ranks)  # pipeline order: the pipeline is the mesh's outermost dimension


def parse_ranks(text: str, config: ParallelConfig) -> list[int]:
    """``--ranks``: a comma list of global ranks, ``first`` and ``last``; simulated in pipeline order (a stage's
    simulation reads what the earlier stages sent, so the first stage's rank 0 is added where missing)."""
    ranks = []
    for token in (t.strip() for t in text.split(",") if t.strip()):
        if token in ("first", "last"):
            ranks.append(0 if token == "first" else config.world_size - 1)
            continue
        try:
            rank = int(token)
        except ValueError:
            raise ValueError(f"--ranks {text!r}: {token!r} is neither a rank number nor first/last.") from None
        if not 0 <= rank < config.world_size:
            raise ValueError(f"--ranks {text!r}: rank {rank} is outside the world of {config.world_size} ranks.")
        ranks.append(rank)
    if not ranks:
        raise ValueError("--ranks is empty; give ranks such as 0,last.")
    if min(ranks) >= config.world_size // config.pipeline_parallel_size:  # none of the first stage
        ranks.append(0)
    return sorted(set(ranks))  # pipeline order: the pipeline is the mesh's outermost dimension


def compare_with_plan(result: RankResult, planner: Planner, layout: Layout) -> None:
    """Set ``result.planned``: the planner's prediction for this rank's pipeline and data-parallel rank."""
    pipeline, data = result.coordinates["pp"], result.coordinates["dp"]
    state = planner.model_state_bytes(layout, pipeline_rank=pipeline, data_rank=data)
    where = placement(state, layout, state_bytes_per_element=planner.state_bytes_per_element,
                      buffer_mb=planner.workload.offload_buffer_mb,
                      gradient_bytes_per_element=planner.workload.parameter_bytes,
                      resident=planner.quantized_base_bytes(layout, pipeline))
    activations = activation_bytes(planner.shape, layout, planner.workload, pipeline_rank=pipeline)
    buffers = buffer_bytes(planner.shape, layout, planner.workload, state) - FRAMEWORK_BYTES
    result.planned = {"peak_bytes": where.device + activations + buffers, "model_state_bytes": dict(state),
                      "model_state_on_device_bytes": where.device, "activation_bytes": activations,
                      "buffer_bytes": buffers}


def to_json(results: Sequence[RankResult]) -> dict[str, Any]:
    """``--json``'s object: ``{"ranks": [{"rank", "simulated_peak_bytes", "planned_peak_bytes", ...}]}``."""
    ranks = []
    for result in results:
        row = asdict(result)
        row["planned_peak_bytes"] = result.planned.get("peak_bytes")
        ranks.append(row)
    return {"ranks": ranks}


def _gib(value: Optional[int]) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def format_report(results: Sequence[RankResult], *, tolerance: float = 0.05) -> str:
    """The per-rank table (simulated against planned, by category) and each rank's collectives."""
    lines = []
    for result in results:
        planned = result.planned
        where = ", ".join(f"{name} {value}" for name, value in result.coordinates.items())
        peak, predicted = result.simulated_peak_bytes, planned.get("peak_bytes")
        verdict = ""
        if predicted:
            ratio = peak / predicted
            verdict = (f" = {ratio:.3f} x planned {_gib(predicted)} GiB"
                       + ("" if abs(ratio - 1) <= tolerance else f"  (more than {tolerance:.0%} apart)"))
        lines.append(f"rank {result.rank} ({where}): simulated peak {_gib(peak)} GiB{verdict}; "
                     f"{result.seconds:.1f} s to simulate")
        state = planned.get("model_state_bytes", {})
        for name in CATEGORIES:
            lines.append(f"  {name.replace('_', ' '):<28} {_gib(result.model_state_bytes.get(name))} GiB held"
                         f" (planned {_gib(state.get(name))}), {_gib(result.peak_by_category.get(name))} GiB at the peak")
        split = result.peak_by_category
        rest = split.get("activations", 0) + split.get("temporaries", 0)
        lines.append(f"  {'activations + temporaries':<28} {_gib(split.get('activations'))} + "
                     f"{_gib(split.get('temporaries'))} = {_gib(rest)} GiB at the peak"
                     + (f" (planned {_gib(planned['activation_bytes'])} activations and transients + "
                        f"{_gib(planned['buffer_bytes'])} buffers)" if planned else ""))
        if result.largest_at_peak:
            lines.append("    largest: " + ", ".join(f"{name} {nbytes / GIB:.2f}"
                                                  for name, nbytes in result.largest_at_peak.items()))
        lines.append(f"  checkpoint shard plan: {result.checkpoint_entries} entries, "
                     f"{result.checkpoint_bytes / GIB:.2f} GiB written by this rank")
        lines.append(f"  host reads: {result.host_reads} ({result.stand_ins} answered with a healthy step's stand-in)")
        lines.append("  collectives per optimizer step (group: kind x count, bytes):")
        for row in result.collectives:
            lines.append(f"    {row['group']:<16} {row['kind']:<15} x {row['count']:<6} {row['bytes'] / 2**20:,.1f} MiB")
    return "\n".join(lines)
