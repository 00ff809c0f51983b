"""The processes' groups for one layout: how a run starts them, and how a failed run leaves them.

:func:`init_processes` joins the default process group (Lightning's ``_init_dist_connection``, which reads
the cluster environment's address, ranks and world size) with the strategy's timeout, then builds the
layout's groups (``ParallelState.create``, the same timeout on every group); on NCCL it first makes a
collective's timeout reach Python (:func:`surface_nccl_timeouts`), where the strategy explains it.
:func:`exit_before_native_teardown` keeps a failed run's error the last thing its process prints, and the rank
whose error caused the failure the last one to print.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection

from lightning_megatron.parallel.agree import PeerFailed
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.state import ParallelState


def init_processes(environment, config: ParallelConfig, device: torch.device, *, backend: Optional[str],
                   timeout: Optional[timedelta]) -> ParallelState:
    """The default group (``backend``: ``None`` takes Lightning's default for ``device``, gloo on CPU), joined
    unless an earlier run of this process already did, then the layout's groups over it."""
    backend = backend or _get_default_process_group_backend_for_device(device)
    surface_nccl_timeouts(backend)
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    _init_dist_connection(environment, backend, **kwargs)
    if not _LEAVING:
        _LEAVING.append(True)
        atexit.register(leave_together)
    return ParallelState.create(config, device, timeout=timeout)


# ------------------------------------------------------------------ NCCL's timeouts, told in Python
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_TEAR_DOWN = ("1", "3")  # NCCL's watchdog ends the process from its own thread (3: torch's default, 1: torchrun's)
_CLEAN_UP_ONLY = "2"


def surface_nccl_timeouts(backend: str, environ=os.environ) -> bool:
    """Make an NCCL collective's timeout an exception in the training thread, so that the strategy's
    ``on_exception`` can say what was waiting (``diagnostics.explain_collective_failure``); returns whether it
    changed ``TORCH_NCCL_ASYNC_ERROR_HANDLING``.

    Torch's default (3) and torchrun's (1) let NCCL's watchdog thread rethrow the timeout and so terminate the
    process before any Python code runs: the log ends with the watchdog's "WorkNCCL(SeqNum=..., OpType=...)",
    never the phase and step. With 2 (clean up only) the watchdog aborts the timed-out communicators (which ends
    their kernels, so a training thread waiting on one goes on) and the next use of the group raises the watchdog's
    error (``DistBackendError``, "NCCL communicator was aborted ... Watchdog caught collective operation
    timeout") in that thread; the process still ends, through the exception. Set before the process groups
    exist: each reads the variable when it is created. A user's own choice of 0 (no handling) or 2 is kept;
    gloo has no watchdog and raises its timeouts in the calling thread already."""
    if "nccl" not in backend or environ.get(NCCL_ERROR_HANDLING, "3") not in _TEAR_DOWN:
        return False
    environ[NCCL_ERROR_HANDLING] = _CLEAN_UP_ONLY
    return True


# ------------------------------------------------------------------ leaving after a run
_LEAVING: list[bool] = []  # leave_together is registered (once per process)
EXIT_WAIT_SECONDS = 60.0
_EXITING = "lightning_megatron/exiting"


def leave_together() -> None:
    """At the interpreter's exit after a run that did not fail: wait until every rank is exiting too (a counter in
    the process group's store, at most ``EXIT_WAIT_SECONDS``), then destroy the process groups, before the
    interpreter's finalisation and C++ static destructors tear them down in no set order.

    The ranks of a user's script finish at different times (rank 0 writes a report, another prints nothing); a
    rank whose gloo groups are destroyed while a peer is gone or going can abort in native code (``terminate
    called without an active exception``) after a run that went well. Under Lightning's launcher this also keeps
    rank 0, whose exit kills the script copies it started, until they are done. A process ending on an uncaught
    error, or after a run of this process failed (a second Ctrl-C, an error the script caught), leaves at once
    (:func:`exit_before_native_teardown`): its peers may never arrive."""
    if not dist.is_initialized() or getattr(sys, "last_value", None) is not None or _FAILED:
        return
    store, world = _store(), dist.get_world_size()
    if store is not None and world > 1:
        arrived = _tell(store, lambda: store.add(_EXITING, 1))
        deadline = time.monotonic() + EXIT_WAIT_SECONDS
        while arrived is not None and arrived < world and time.monotonic() < deadline:
            time.sleep(0.05)
            arrived = _tell(store, lambda: store.add(_EXITING, 0))  # None once the store's host has left
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - at exit, nothing is left to protect
        pass


# ------------------------------------------------------------------ leaving after a failure
_FAILED: set[int] = set()  # ids of the errors a run failed on (ids, not the errors: their frames hold the model)


def exit_before_native_teardown(error: BaseException) -> None:
    """If ``error`` ends the interpreter, end the process right after its traceback and the atexit handlers.

    Left to the interpreter, gloo's groups are torn down by Python's finalisation and C++ static destructors
    while the peers exit too, and on torch 2.13 that sometimes aborts with ``terminate called without an
    active exception`` below the traceback: the error the user needs is no longer the last line, and the
    exit code is SIGABRT's. Destroying the groups first does not avoid it (a minimal gloo script that calls
    ``destroy_process_group()`` before raising still aborted in 2 of 18 runs under torchrun).
    A run that failed has nothing left for that teardown to do, so the process leaves with exit code 1 (what
    an uncaught error gives) after every atexit handler has run, skipping only the native teardown. A
    caller that catches ``error`` and goes on is unaffected: nothing happens unless ``error`` is the one the
    interpreter printed (``sys.last_value``).

    Ranks that share a terminal (Lightning's launcher, torchrun) print their errors at about the same time, and a
    rank that failed only because another did (:class:`~lightning_megatron.parallel.agree.PeerFailed`: "Building
    ... failed on rank 0; its error says why") could be the last one printed. So the interpreter's report of an
    uncaught error goes through :func:`_report_cause_last`: such a rank prints its error in one line and says so in
    the process group's store; the others wait for those lines (at most ``CAUSE_WAIT_SECONDS``) before printing.
    (On a failed run only: the wait costs up to that long where a peer never fails, as a stalled one.)
    """
    if not _FAILED:
        atexit.register(_exit_if_failed)
        _report_cause_last.previous = sys.excepthook
        _report_cause_last.rank = dist.get_rank() if dist.is_initialized() else 0
        sys.excepthook = _report_cause_last
    _FAILED.add(id(error))


CAUSE_WAIT_SECONDS = 3.0
_REPORTED = "lightning_megatron/failure_reported/{rank}"
_CAUSE = "lightning_megatron/failure_cause/{rank}"


def _report_cause_last(kind, error, traceback) -> None:
    """``sys.excepthook`` after a failed run: a :class:`PeerFailed` rank first, in one line; the cause last. Each
    rank notes in the store what it is and when it has printed, and waits for the others before it leaves too:
    under Lightning's launcher rank 0's exit kills the other ranks, which may hold the cause.

    A rank with a cause of its own says so first, then waits only for the ranks that are neither causes nor done
    printing: ranks that failed alike (every rank raising the same error) print at once, none waits for another
    to print first (each would wait the whole ``CAUSE_WAIT_SECONDS`` for a peer doing the same)."""
    previous, rank = _report_cause_last.previous, _report_cause_last.rank
    if id(error) not in _FAILED:
        return previous(kind, error, traceback)
    store = _store()
    if isinstance(error, PeerFailed) or isinstance(error.__cause__, PeerFailed):
        print(f"[rank{rank}]: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        _tell(store, lambda: store.set(_REPORTED.format(rank=rank), "1"))
        _wait_for_the_others(store, rank, (_REPORTED,))
        return None
    _tell(store, lambda: store.set(_CAUSE.format(rank=rank), "1"))
    _wait_for_the_others(store, rank, (_REPORTED, _CAUSE))  # the followers' one-liners first
    previous(kind, error, traceback)
    _tell(store, lambda: store.set(_REPORTED.format(rank=rank), "1"))
    _wait_for_the_others(store, rank, (_REPORTED,), among=_CAUSE)  # the other causes, before this rank may end them
    return None


def _wait_for_the_others(store: Optional[Any], rank: int, marks: tuple[str, ...], among: Optional[str] = None) -> None:
    """Until every other rank (``among``: every other rank with that mark) has one of ``marks`` in the store, at
    most ``CAUSE_WAIT_SECONDS`` (a rank that did not fail never gets one)."""
    if store is None:
        return

    def marked(peer: int, mark: str) -> bool:
        return _tell(store, lambda: store.check([mark.format(rank=peer)]), default=True)

    waiting = [peer for peer in range(dist.get_world_size()) if peer != rank and (among is None or marked(peer, among))]
    deadline = time.monotonic() + CAUSE_WAIT_SECONDS
    while True:
        waiting = [peer for peer in waiting if not any(marked(peer, mark) for mark in marks)]
        if not waiting or time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def _store() -> Optional[Any]:
    """The default process group's store (its key-value server), None without one."""
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a private accessor: without it, no ordering
        return None


def _tell(store: Optional[Any], call, default=None):
    """``call()`` on the store; a store whose server has gone (its rank exited) gives ``default``."""
    if store is None:
        return default
    try:
        return call()
    except Exception:  # noqa: BLE001 - the server's rank may have exited already: nothing to wait for
        return default


def _exit_if_failed() -> None:
    error = getattr(sys, "last_value", None)  # set by the interpreter when it printed an uncaught error
    if error is None or id(error) not in _FAILED or not dist.is_initialized():
        return
    atexit.unregister(_exit_if_failed)
    atexit._run_exitfuncs()  # the handlers registered before this one (logging's flush, ...), in their order
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(1)
