"""The processes' groups for one layout: how a run starts them, and how a failed run leaves them.

:func:`init_processes` joins the default process group (Lightning's ``_init_dist_connection``, which reads
the cluster environment's address, ranks and world size) with the strategy's timeout, then builds the
layout's groups (``ParallelState.create``, the same timeout on every group); on NCCL it first makes a
collective's timeout reach Python (:func:`surface_nccl_timeouts`), where the strategy explains it.
:func:`exit_before_native_teardown` keeps a failed run's error the last thing its process prints.
"""

from __future__ import annotations

import atexit
import os
import sys
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection

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
    """
    if not _FAILED:
        atexit.register(_exit_if_failed)
    _FAILED.add(id(error))


def _exit_if_failed() -> None:
    error = getattr(sys, "last_value", None)  # set by the interpreter when it printed an uncaught error
    if error is None or id(error) not in _FAILED or not dist.is_initialized():
        return
    atexit.unregister(_exit_if_failed)
    atexit._run_exitfuncs()  # the handlers registered before this one (logging's flush, ...), in their order
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(1)
