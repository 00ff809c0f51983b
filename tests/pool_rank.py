"""One rank of a rank pool (``tests/launch.py``'s ``RankPool``): started by torchrun once per session and pool size,
it joins the default process group once and then runs worker functions as jobs, one after another.

argv: POOL_DIR PARENT_PID. The pool writes ``job{n}.json`` ({"worker", "out_dir", "args"}) into POOL_DIR; every
rank runs ``workers/<worker>.py``'s ``main(out_dir, args)`` with the working directory at ``out_dir`` and its
output in ``out_dir/job.rank{r}.log``, and writes ``job{n}.rank{r}.json`` (the traceback, or None). Then the ranks
meet at a barrier of the default group, destroy the groups the job built, put back what the job may have changed
in the process (:class:`ProcessState`), and write ``job{n}.rank{r}.synced`` before they wait for the next job. A
``stop`` file, or the pytest process that started the pool going away, ends the rank.
"""

import contextlib
import gc
import importlib
import importlib.util
import json
import os
import random
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

import lightning  # noqa: F401 - imported once for every job, before the state is taken (their warning filters)
import numpy as np
import torch
import torch.distributed as dist

import lightning_megatron  # noqa: F401

WORKERS = Path(__file__).resolve().parent / "workers"
sys.path.insert(0, str(WORKERS))  # workers import their setup modules so

POLL_SECONDS = 0.05
SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP]


class ProcessState:
    """What a job can change in its process and a fresh process would start without: taken when the rank has
    joined its group, put back after every job (the groups a job built are destroyed before)."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)  # PL_GLOBAL_SEED, MASTER_PORT, variables a worker sets
        self.cwd = os.getcwd()
        self.rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        self.dtype = torch.get_default_dtype()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.threads = (torch.get_num_threads(), torch.get_num_interop_threads())
        self.grad = torch.is_grad_enabled()
        self.anomaly = torch.is_anomaly_enabled()
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.handlers = {signum: signal.getsignal(signum) for signum in SIGNALS}  # Lightning's SIGTERM/SIGUSR1
        self.excepthook = sys.excepthook  # a failed run's exit_before_native_teardown replaces it
        self.warning_filters = list(warnings.filters)

    def restore(self) -> None:
        os.chdir(self.cwd)
        if os.environ != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        torch.set_rng_state(self.rng[0])
        random.setstate(self.rng[1])
        np.random.set_state(self.rng[2])
        torch.set_default_dtype(self.dtype)
        torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        torch.set_num_threads(self.threads[0])  # (interop threads can only be set before first use: never changed)
        torch.set_grad_enabled(self.grad)
        torch.autograd.set_detect_anomaly(self.anomaly)
        torch.set_float32_matmul_precision(self.matmul_precision)
        for signum, handler in self.handlers.items():
            signal.signal(signum, handler)
        sys.excepthook = self.excepthook
        warnings.filters[:] = self.warning_filters
        if "torch._dynamo" in sys.modules:  # compiled jobs: no cache (nor recompile limit) carried into the next
            torch._dynamo.reset()
        gc.collect()  # the job's modules, trainers and DataLoader iterators go now, not during the next job
        # What outlives a job (modules it imported, caches) is never scanned again: the next collection scans only
        # what the next job makes, not the ~500k objects of torch and Lightning (a full one costs ~0.25 s a rank).
        gc.freeze()


def destroy_groups_but_the_default() -> None:
    """The groups a job built (its meshes): each holds three threads and its sockets, and a pool runs hundreds.
    DTensor caches its sharding decisions by mesh layout, not by mesh: the next job's mesh of the same layout would
    be handed these groups, so those caches go too."""
    default = dist.group.WORLD
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not default:
            dist.destroy_process_group(group)
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
        clear_redistribute_planner_cache()
        _gen_transform_infos.cache_clear()


@contextlib.contextmanager
def output_to(path: Path):
    """This process's stdout and stderr (file descriptors 1 and 2: Python's and native code's) into ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def worker(name: str):
    """``workers/<name>.py``, imported once, by its path: a job that put another folder first on ``sys.path``
    (data_scale.py puts benchmarks/, which has a generation.py too) must not decide which module a name is."""
    module = sys.modules.get(name)
    if module is None or Path(module.__file__).parent != WORKERS:
        spec = importlib.util.spec_from_file_location(name, WORKERS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def run_job(job: dict, rank: int):
    """Run one job on this rank; the traceback it raised, or None."""
    out_dir = Path(job["out_dir"])
    with output_to(out_dir / f"job.rank{rank}.log"):
        os.chdir(out_dir)
        try:
            worker(job["worker"]).main(out_dir, job["args"])
            return None
        except BaseException:  # noqa: BLE001 - SystemExit too: the job failed, the rank goes on
            traceback.print_exc()
            return traceback.format_exc()


def next_job(pool_dir: Path, number: int, parent: int):
    """The job numbered ``number`` once the pool has written it; None when the pool stops."""
    path, ppid = pool_dir / f"job{number}.json", os.getppid()
    while not path.exists():
        if (pool_dir / "stop").exists() or os.getppid() != ppid or not alive(parent):
            return None
        time.sleep(POLL_SECONDS)
    return json.loads(path.read_text())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write(path: Path, text: str) -> None:
    """Whole or not at all (the pool reads as soon as the name exists)."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(text)
    partial.rename(path)


def main() -> None:
    pool_dir, parent = Path(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = ProcessState()
    gc.freeze()  # the imports' objects: see ProcessState.restore
    write(pool_dir / f"ready{rank}.pid", str(os.getpid()))
    number = 0
    while (job := next_job(pool_dir, number, parent)) is not None:
        error = run_job(job, rank)
        write(pool_dir / f"job{number}.rank{rank}.json", json.dumps({"error": error}))
        dist.barrier()  # every rank at the same collective of the default group: no peer uses the job's groups now
        destroy_groups_but_the_default()
        state.restore()
        write(pool_dir / f"job{number}.rank{rank}.synced", "")
        number += 1
    os._exit(0)  # skip gloo's C++ teardown (see workers/entry.py)


if __name__ == "__main__":
    main()
