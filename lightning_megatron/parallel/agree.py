"""Fail on every rank, or on none: a check that may fail on some ranks only, settled before the next collective.

A rank that raises while its peers go on leaves them waiting in their next collective until the timeout
(10 minutes by default), and the user sees a timeout instead of the reason. :func:`on_every_rank` runs the
check everywhere, gathers who failed (one ``all_gather_object`` over the world) and raises on every rank:
the failing rank its own error, the others a ``RuntimeError`` quoting the first failing rank's.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

T = TypeVar("T")
EXPECTED_FAILURES = (OSError, RuntimeError, TypeError, ValueError)


def on_every_rank(check: Callable[[], T], *, doing: str, undo: Optional[Callable[[T], Any]] = None) -> T:
    """``check()``'s result if it succeeded on every rank; otherwise raise on every rank. ``doing`` completes
    "Rank 3 cannot ..." in the other ranks' message (e.g. ``"load the checkpoint"``); ``undo(result)`` releases
    what a rank that succeeded made (files, threads) before it raises for another rank's failure."""
    error, result = None, None
    try:
        result = check()
    except EXPECTED_FAILURES as caught:
        error = caught
    reports: list[Any] = [None if error is None else f"{type(error).__name__}: {error}"]
    if dist.is_available() and dist.is_initialized():
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if failed:
        if undo is not None:
            undo(result)
        rank, report = failed[0]
        raise RuntimeError(f"Rank {rank} cannot {doing}: {report}")
    return result  # type: ignore[return-value]
