"""Measure a pipeline schedule: per-rank forward/backward events, bubble fraction, a picture.

Events are intervals of each stage's forward and backward of each micro-batch, recorded around
``PipelineStage.forward_one_chunk`` / ``backward_one_chunk`` (and, for the zero-bubble schedules' split
backward, ``backward_weight_one_chunk``), by the clock of the stage's device (:func:`step_clock`): the host's
on the CPU, CUDA events on a GPU, where the host only queues kernels and its clock would time the launches.
The bubble of
a rank is the share of the step during which it computes nothing; theory for 1F1B is
``(p - 1) / m`` of the ideal time (``(p - 1) / (m + p - 1)`` of the step), divided by ``v``
when interleaved (Narayanan et al. 2021). The zero-bubble schedules' theory is their own
action table played out (:func:`simulated_bubble`) with the costs of Qi et al. 2024's analysis:
forward, input-gradient and weight-gradient passes of equal time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from lightning_megatron.pipeline.layout import SCHEDULE_SPECS


@dataclass(frozen=True)
class Event:
    rank: int
    stage: int
    micro_batch: int
    kind: str  # "forward" | "backward"
    start: float
    end: float


class HostClock:
    """The host's monotonic clock: on the CPU the host runs the work it times."""

    def restart(self) -> None:
        pass

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, marks: list) -> list[float]:
        return marks


class CudaEventClock:
    """CUDA events recorded on the device's current stream (where the stages' kernels run): the GPU's own times
    of what was queued between two marks, without waiting for it. They are read once, when the step's events are
    asked for (one synchronisation), and put on the host's time axis through an anchor event recorded at the
    step's first mark after the queue drained (one synchronisation per recorded step, not per micro-batch), so
    that the ranks of one node share an axis as with :class:`HostClock`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._anchor: Optional[tuple[Any, float]] = None  # (event, host time at which the GPU reached it)

    def restart(self) -> None:
        self._anchor = None

    def _record(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def mark(self):
        if self._anchor is None:
            torch.cuda.current_stream(self.device).synchronize()
            self._anchor = (self._record(), time.perf_counter())
        return self._record()

    def seconds(self, marks: list) -> list[float]:
        if not marks:
            return []
        torch.cuda.synchronize(self.device)
        anchor, host_time = self._anchor
        return [host_time + anchor.elapsed_time(mark) / 1e3 for mark in marks]


def step_clock(device: Union[torch.device, str, None]) -> Union[HostClock, CudaEventClock]:
    """The clock that times work on ``device``: CUDA events on a CUDA device, the host's clock elsewhere."""
    device = torch.device(device if device is not None else "cpu")
    return CudaEventClock(device) if device.type == "cuda" else HostClock()


class TimelineRecorder:
    """Wraps pipeline stages' per-chunk methods to record events while ``active``. ``action_tables`` keeps, per
    micro-batch count, the compute actions of a schedule that has a table (torch's multi-stage schedules), for
    the theory of the split-backward schedules.

    The clock is the stages' device's (:func:`step_clock`; ``device`` overrides it). Intervals are kept as the
    clock's marks while the step runs and turned into :class:`Event` times when ``events`` is read: read it after
    the step (on CUDA that waits once for the queued work)."""

    def __init__(self, rank: int, device: Union[torch.device, str, None] = None) -> None:
        self.rank = rank
        self._active = False
        self._events: list[Event] = []
        self._pending: list[tuple[int, int, str, Any, Any]] = []  # (stage, micro-batch, kind, start mark, end mark)
        self.clock = step_clock(device) if device is not None else None
        self.action_tables: dict[int, dict] = {}

    @property
    def active(self) -> bool:
        return self._active

    @active.setter
    def active(self, value: bool) -> None:
        if value and not self._active and self.clock is not None:
            self.clock.restart()  # a new recorded step: the CUDA clock anchors anew
        self._active = value

    @property
    def events(self) -> list[Event]:
        """The recorded events (a list the caller may clear); reading it converts what the clock recorded."""
        if self._pending:
            marks = [mark for *_, start, end in self._pending for mark in (start, end)]
            times = self.clock.seconds(marks)
            for index, (stage, micro_batch, kind, _, _) in enumerate(self._pending):
                self._events.append(Event(self.rank, stage, micro_batch, kind, times[2 * index], times[2 * index + 1]))
            self._pending.clear()
        return self._events

    def instrument(self, stage) -> None:
        if self.clock is None:
            self.clock = step_clock(getattr(stage, "device", None))
        clock = self.clock
        for method, kind in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                             ("backward_weight_one_chunk", "weight")):
            original = getattr(stage, method)

            def timed(chunk_id, *args, _original=original, _kind=kind, **kwargs):
                if not self._active:
                    return _original(chunk_id, *args, **kwargs)
                start = clock.mark()
                try:
                    return _original(chunk_id, *args, **kwargs)
                finally:
                    self._pending.append((stage.stage_index, chunk_id, _kind, start, clock.mark()))

            setattr(stage, method, timed)


def theoretical_bubble(pipeline_parallel_size: int, micro_batches: int, virtual_pipeline_size: int = 1) -> float:
    """Idle share of a step: bubble time / (bubble + ideal time), with bubble/ideal = (p-1)/(m v)."""
    ratio = (pipeline_parallel_size - 1) / (micro_batches * virtual_pipeline_size)
    return ratio / (1 + ratio)


_COSTS = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}  # a full backward is the input- and the weight-gradient pass


def simulated_bubble(action_table: dict[int, list]) -> float:
    """Idle share of a step (mean over ranks) when each rank runs its actions in the table's order, each as soon as
    its inputs exist: a forward after the previous stage's forward of the micro-batch, a backward (full ``B`` or
    input-gradient ``I``) after its own forward and the next stage's backward, a weight pass ``W`` after its ``I``.
    Costs: F = I = W = 1, B = 2 per stage; communication is free. ``action_table`` is torch's ``pipeline_order``
    (rank -> actions with ``stage_index``, ``computation_type``, ``microbatch_index``, ``sub_actions``; ``None``
    for an idle slot)."""
    def flatten(action):
        return [leaf for sub in action.sub_actions for leaf in flatten(sub)] if action.sub_actions else [action]

    queues = {rank: [leaf for action in actions if action is not None for leaf in flatten(action)
                     if leaf.computation_type.value in _COSTS] for rank, actions in action_table.items()}
    last_stage = max(leaf.stage_index for actions in queues.values() for leaf in actions)
    finished: dict[tuple, float] = {}  # ("F" | "G" (input gradient ready) | "W", stage, micro-batch) -> time
    clock, busy, position = dict.fromkeys(queues, 0.0), dict.fromkeys(queues, 0.0), dict.fromkeys(queues, 0)

    def needs(kind: str, stage: int, mb: int) -> list[tuple]:
        if kind == "F":
            return [("F", stage - 1, mb)] if stage > 0 else []
        if kind in ("I", "B"):
            return [("F", stage, mb)] + ([("G", stage + 1, mb)] if stage < last_stage else [])
        return [("G", stage, mb)]

    progress = True
    while progress:
        progress = False
        for rank, actions in queues.items():
            while position[rank] < len(actions):
                action = actions[position[rank]]
                kind, stage, mb = action.computation_type.value, action.stage_index, action.microbatch_index
                inputs = needs(kind, stage, mb)
                if any(need not in finished for need in inputs):
                    break
                start = max([clock[rank], *(finished[need] for need in inputs)])
                clock[rank] = start + _COSTS[kind]
                busy[rank] += _COSTS[kind]
                finished[("G" if kind in ("I", "B") else kind, stage, mb)] = clock[rank]
                position[rank] += 1
                progress = True
    if any(position[rank] < len(actions) for rank, actions in queues.items()):
        raise RuntimeError("The pipeline action table cannot be played out: an action waits for one never run.")
    span = max(clock.values())
    return sum(1 - busy[rank] / span for rank in queues) / len(queues)


def schedule_theory(schedule: str, recorder: TimelineRecorder, pipeline_parallel_size: int, micro_batches: int,
                    virtual_pipeline_size: int = 1) -> float:
    """The theoretical bubble of ``schedule``: Narayanan et al.'s formula for GPipe and (interleaved) 1F1B, the
    played-out action table for the split-backward (zero-bubble) schedules."""
    if SCHEDULE_SPECS[schedule].split_backward:
        return simulated_bubble(recorder.action_tables[micro_batches])
    return theoretical_bubble(pipeline_parallel_size, micro_batches, virtual_pipeline_size)


def measured_bubble(events: list[Event]) -> float:
    """Mean idle share over ranks between the first event start and the last event end of the step."""
    start, end = min(e.start for e in events), max(e.end for e in events)
    span = end - start
    ranks = sorted({e.rank for e in events})
    idle = [1 - sum(e.end - e.start for e in events if e.rank == r) / span for r in ranks]
    return sum(idle) / len(idle)


def render(events: list[Event], path: Path, *, title: str = "", theory: Optional[float] = None) -> Path:
    """Draw ranks as rows and micro-batches as coloured boxes (light: forward, dark: backward, hatched: the weight
    pass of a split backward)."""
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
                alpha=0.55 if event.kind == "forward" else 1.0, edgecolor="black", linewidth=0.4,
                hatch="//" if event.kind == "weight" else None)
        letter = {"forward": "F", "backward": "B", "weight": "W"}[event.kind]
        ax.text((event.start - start + (event.end - event.start) / 2) * 1e3, row,
                f"{letter}{event.micro_batch}", ha="center", va="center", fontsize=7)
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
