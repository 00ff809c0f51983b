"""The processes' groups for one layout: how a run starts them, and how a failed run leaves them.

:func:`init_processes` joins the default process group (Lightning's ``_init_dist_connection``, which reads
the cluster environment's address, ranks and world size) with the strategy's timeout, then builds the
layout's groups (``ParallelState.create``, the same timeout on every group). :func:`exit_before_native_teardown`
keeps a failed run's error the last thing its process prints.
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
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    _init_dist_connection(environment, backend, **kwargs)
    return ParallelState.create(config, device, timeout=timeout)


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
