"""Fail on every rank, or on none: a check that may fail on some ranks only, settled before the next collective.

A rank that raises while its peers go on leaves them waiting in their next collective until the timeout
(10 minutes by default), and the user sees a timeout instead of the reason. :func:`on_every_rank` runs the
check everywhere, gathers who failed (one ``all_gather_object`` over the world) and raises on every rank:
the failing rank its own error, the others a :class:`PeerFailed` quoting the first failing rank's.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

T = TypeVar("T")
EXPECTED_FAILURES = (OSError, RuntimeError, TypeError, ValueError)


class PeerFailed(RuntimeError):
    """Raised on a rank because another rank failed, whose own error says why: when both end their processes, the
    other rank's error is printed last and this one in a single line (``processes.exit_before_native_teardown``)."""


def all_gather_objects(value: Any, group: Optional[dist.ProcessGroup] = None) -> list:
    """Every rank's ``value`` (one process without torch.distributed: just this one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def on_every_rank(check: Callable[[], T], *, doing: str, undo: Optional[Callable[[T], Any]] = None) -> T:
    """``check()``'s result if it succeeded on every rank; otherwise raise on every rank. ``doing`` completes
    "Rank 3 cannot ..." in the other ranks' message (e.g. ``"load the checkpoint"``); ``undo(result)`` releases
    what a rank that succeeded made (files, threads) before it raises for another rank's failure."""
    error, result = None, None
    try:
        result = check()
    except EXPECTED_FAILURES as caught:
        error = caught
    reports = all_gather_objects(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if failed:
        if undo is not None:
            undo(result)
        rank, report = failed[0]
        raise PeerFailed(f"Rank {rank} cannot {doing}: {report}")
    return result  # type: ignore[return-value]
