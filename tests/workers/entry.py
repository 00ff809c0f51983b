"""How a worker runs as a process of its own: ``torchrun ... tests/workers/<worker>.py OUT_DIR ARGS...``.

A worker is a function ``main(out_dir, args)`` that every rank calls with the default process group joined and
the working directory at ``out_dir``; rank ``r`` writes ``rank{r}.json``. The rank pools (``tests/pool_rank.py``)
call it as one job after another in the same processes; as a script it is its process's only job.
"""

import os
import sys
from pathlib import Path
from typing import Callable

import torch.distributed as dist


def run_script(main: Callable[[Path, list[str]], None], *, join: bool = True) -> None:
    """Join the default group torchrun describes, run ``main`` with the command line's arguments, and leave with
    ``os._exit(0)``: gloo's C++ teardown with several meshes alive aborts at random (torch 2.13). ``join=False``:
    the worker's Trainer joins the group, as a user's script does (a pool's ranks have always joined it)."""
    if join:
        dist.init_process_group("gloo")
    main(Path(sys.argv[1]), sys.argv[2:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
