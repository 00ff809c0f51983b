"""Measure a pipeline schedule: per-rank forward/backward events, bubble fraction, a picture.

Events are wall-clock intervals of each stage's forward and backward of each micro-batch,
recorded around ``PipelineStage.forward_one_chunk`` / ``backward_one_chunk``. The bubble of
a rank is the share of the step during which it computes nothing; theory for 1F1B is
``(p - 1) / m`` of the ideal time (``(p - 1) / (m + p - 1)`` of the step), divided by ``v``
when interleaved (Narayanan et al. 2021).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class Event:
    rank: int
    stage: int
    micro_batch: int
    kind: str  # "forward" | "backward"
    start: float
    end: float


class TimelineRecorder:
    """Wraps pipeline stages' per-chunk methods to record events while ``active``."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.active = False
        self.events: list[Event] = []

    def instrument(self, stage) -> None:
        for method, kind in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward")):
            original = getattr(stage, method)

            def timed(chunk_id, *args, _original=original, _kind=kind, **kwargs):
                if not self.active:
                    return _original(chunk_id, *args, **kwargs)
                start = time.perf_counter()
                try:
                    return _original(chunk_id, *args, **kwargs)
                finally:
                    self.events.append(Event(self.rank, stage.stage_index, chunk_id, _kind, start, time.perf_counter()))

            setattr(stage, method, timed)


def theoretical_bubble(pipeline_parallel_size: int, micro_batches: int, virtual_pipeline_size: int = 1) -> float:
    """Idle share of a step: bubble time / (bubble + ideal time), with bubble/ideal = (p-1)/(m v)."""
    ratio = (pipeline_parallel_size - 1) / (micro_batches * virtual_pipeline_size)
    return ratio / (1 + ratio)


def measured_bubble(events: list[Event]) -> float:
    """Mean idle share over ranks between the first event start and the last event end of the step."""
    start, end = min(e.start for e in events), max(e.end for e in events)
    span = end - start
    ranks = sorted({e.rank for e in events})
    idle = [1 - sum(e.end - e.start for e in events if e.rank == r) / span for r in ranks]
    return sum(idle) / len(idle)


def render(events: list[Event], path: Path, *, title: str = "", theory: Optional[float] = None) -> Path:
    """Draw ranks as rows and micro-batches as coloured boxes (light: forward, dark: backward)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:  # pragma: no cover - depends on the [plot] extra
        raise ImportError("Rendering the pipeline timeline needs matplotlib: pip install 'lightning-megatron[plot]'.") from error
    start = min(e.start for e in events)
    ranks = sorted({e.rank for e in events})
    micro_batches = max(e.micro_batch for e in events) + 1
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1.5))
    for event in events:
        row = ranks.index(event.rank)
        colour = colours(event.micro_batch % 10)
        ax.barh(row, (event.end - event.start) * 1e3, left=(event.start - start) * 1e3, color=colour,
                alpha=0.55 if event.kind == "forward" else 1.0, edgecolor="black", linewidth=0.4)
        ax.text((event.start - start + (event.end - event.start) / 2) * 1e3, row,
                f"{'F' if event.kind == 'forward' else 'B'}{event.micro_batch}", ha="center", va="center", fontsize=7)
    measured = measured_bubble(events)
    label = f"bubble measured {measured:.1%}" + (f", theory {theory:.1%}" if theory is not None else "")
    ax.set_yticks(range(len(ranks)), [f"pp rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(f"{title} ({micro_batches} micro-batches; {label})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
