"""Each process of a node gets its share of the node's cores as torch's intra-op threads (``launcher``): under
torchrun, which sets ``OMP_NUM_THREADS=1`` itself, and under srun, which sets nothing; an ``OMP_NUM_THREADS`` the
user set is kept. The workers are told the node has 6 cores: 2 processes get 3 threads each."""

import json
import subprocess
import sys

import pytest

from launch import WORKERS, child_env, launch, launch_slurm

CORES, PROCESSES = 6, 2


def torchrun_without_omp(out_dir):
    """``launch``, but with no ``OMP_NUM_THREADS`` given to torchrun, as a user who sets none starts it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in child_env().items() if k != "OMP_NUM_THREADS"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={PROCESSES}",
           str(WORKERS / "thread_count.py"), str(out_dir), str(CORES)]
    proc = subprocess.run(cmd, env=env, cwd=out_dir, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(PROCESSES)]


@pytest.mark.slow
def test_torchrun_workers_get_their_share_of_the_cores_not_torchruns_one_thread(tmp_path):
    results = torchrun_without_omp(tmp_path)
    assert [r["omp"] for r in results] == ["1", "1"]  # torchrun's default, which would leave one thread
    assert [r["threads"] for r in results] == [CORES // PROCESSES] * PROCESSES


@pytest.mark.slow
def test_srun_tasks_share_the_cores_instead_of_each_taking_all(tmp_path):
    results, _ = launch_slurm("thread_count.py", 1, PROCESSES, tmp_path, str(CORES), "unset")
    assert [r["omp"] for r in results] == [None, None]
    assert [r["threads"] for r in results] == [CORES // PROCESSES] * PROCESSES


@pytest.mark.slow
def test_an_omp_num_threads_the_user_set_is_kept(tmp_path):
    results, _ = launch("thread_count.py", PROCESSES, tmp_path, str(CORES))  # OMP_NUM_THREADS=1 set by the user
    assert [(r["omp"], r["threads"]) for r in results] == [("1", 1)] * PROCESSES
