"""What a rank pool's job finds in its process, for tests/test_pools.py; or a job that changes all of it, or fails.

args: MODE. ``probe``: rank r writes rank{r}.json with the process settings a job could change (the default
generator's next numbers, default dtype, deterministic flags, threads, grad mode, seed variables, signal
handlers, working directory, warning filters, native threads: gloo's, per group), the sum of the ranks over the
default group and a DTensor sum over a mesh of its own. ``disturb``: changes every one of them. ``raise``: raises
on every rank. ``hang_on_rank1``: rank 1 raises while rank 0 waits in a collective. ``exit_on_rank1``: rank 1's
process ends.
"""

import json
import os
import signal
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from entry import run_script


def dtensor_sum() -> float:
    """A DTensor op over a mesh of its own: a job's mesh has the layout of the one before, never its groups."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return (distribute_tensor(torch.arange(4.0), mesh, [Shard(0)]) * 2).full_tensor().sum().item()


def probe(out_dir: Path) -> dict:
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)
    return {"rand": torch.rand(3).tolist(), "initial_seed": torch.initial_seed(),
            "dtype": str(torch.get_default_dtype()), "deterministic": torch.are_deterministic_algorithms_enabled(),
            "threads": torch.get_num_threads(), "grad": torch.is_grad_enabled(),
            "matmul_precision": torch.get_float32_matmul_precision(),
            "seed_variables": sorted(key for key in os.environ if key.startswith(("PL_", "POOL_PROBE"))),
            "handlers": {signum.name: str(signal.getsignal(signum)) for signum in (signal.SIGTERM, signal.SIGUSR1)},
            "cwd_is_out_dir": Path.cwd() == out_dir.resolve(), "warning_filters": len(warnings.filters),
            "excepthook": getattr(sys.excepthook, "__name__", str(sys.excepthook)), "rank_sum": total.item(),
            "world": dist.get_world_size(), "dtensor_sum": dtensor_sum(), "native_threads": len(os.listdir("/proc/self/task"))}


def disturb() -> None:
    L.seed_everything(123)  # the generators and PL_GLOBAL_SEED
    os.environ["POOL_PROBE"] = "1"
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    torch.set_float32_matmul_precision("medium")
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGUSR1, lambda *_: None)
    warnings.simplefilter("error")
    sys.excepthook = lambda *_: None
    os.chdir("/")
    dtensor_sum()  # a mesh and its groups, as every layout builds


def main(out_dir: Path, args: list[str]) -> None:
    mode, rank = args[0], dist.get_rank()
    if mode == "probe":
        (out_dir / f"rank{rank}.json").write_text(json.dumps(probe(out_dir)))
    elif mode == "disturb":
        disturb()
        (out_dir / f"rank{rank}.json").write_text(json.dumps({"disturbed": True}))
    elif mode == "raise":
        raise ValueError(f"a job that fails on rank {rank}")
    elif mode == "hang_on_rank1":
        if rank == 1:
            raise ValueError("rank 1 fails while rank 0 waits for it")
        dist.all_reduce(torch.ones(1))
    elif mode == "exit_on_rank1":
        if rank == 1:
            os._exit(3)
        dist.all_reduce(torch.ones(1))
    else:
        raise ValueError(f"unknown mode {mode!r}")


if __name__ == "__main__":
    run_script(main)
