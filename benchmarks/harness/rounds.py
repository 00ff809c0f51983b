"""How runs over several ranks and rounds are ordered and summarised (no torch import: a script may time steps
before it sets torch's threads)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence, TypeVar

T = TypeVar("T")


def abba(items: Sequence[T], round_: int) -> Sequence[T]:
    """``items`` in round ``round_``'s order: reversed every other round (ABBA), so slow drift on a shared machine
    falls on every variant alike."""
    return items if round_ % 2 == 0 else items[::-1]


def slowest_rank_median(step_seconds: Sequence[Sequence[float]]) -> float:
    """A run's step time from ``step_seconds[rank][step]``: each step takes as long as its slowest rank (the others
    wait for it in the next collective); the median over steps rejects the spikes other jobs cause."""
    return statistics.median(max(per_rank) for per_rank in zip(*step_seconds))


@dataclass
class Run:
    """One run over all its ranks: the slowest rank sets each step's time, the largest rank the memory."""

    tokens_per_s: float
    peak_bytes: int
    loss: float

    @classmethod
    def from_ranks(cls, ranks: list[dict], tokens_per_step: int) -> "Run":
        return cls(tokens_per_step / slowest_rank_median([r["step_seconds"] for r in ranks]),
                   max(r["peak_bytes"] for r in ranks), ranks[0]["loss"])
