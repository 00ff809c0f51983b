"""Each process of a node gets its share of the node's cores as torch's intra-op threads (``launcher``): under
torchrun, which sets ``OMP_NUM_THREADS=1`` itself, and under srun, which sets nothing; an ``OMP_NUM_THREADS`` the
user set is kept. The workers are told the node has 6 cores: 2 processes get 3 threads each.

The two torchrun launches start together at the module's first test and run next to the srun tasks (each launch's
torchrun imports torch on one core before its processes start)."""

import json

import pytest

from launch import Started, child_env, launch_slurm, selected, torchrun_command

CORES, PROCESSES = 6, 2
WITHOUT_OMP_TEST = "test_torchrun_workers_get_their_share_of_the_cores_not_torchruns_one_thread"
USER_OMP_TEST = "test_an_omp_num_threads_the_user_set_is_kept"


@pytest.fixture(scope="module", autouse=True)
def torchruns(request, tmp_path_factory):
    """The torchrun launches of this session's selection, started at the module's first test: ``without OMP``, as a
    user who sets no ``OMP_NUM_THREADS`` starts torchrun; ``user OMP``, with ``OMP_NUM_THREADS=1`` set by the user."""
    runs = {}
    for name, test, env in (("without OMP", WITHOUT_OMP_TEST, {k: v for k, v in child_env().items()
                                                                if k != "OMP_NUM_THREADS"}),
                            ("user OMP", USER_OMP_TEST, child_env())):
        if selected(request, test):
            out = tmp_path_factory.mktemp(name.replace(" ", "_"))
            runs[name] = Started(torchrun_command("thread_count.py", PROCESSES, out, str(CORES)), out, env=env)
    yield runs
    for run in runs.values():
        run.stop()


def results_of(run: Started) -> list[dict]:
    proc = run.result()
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads((run.cwd / f"rank{r}.json").read_text()) for r in range(PROCESSES)]


@pytest.mark.slow
def test_srun_tasks_share_the_cores_instead_of_each_taking_all(tmp_path):
    results, _ = launch_slurm("thread_count.py", 1, PROCESSES, tmp_path, str(CORES), "unset")
    assert [r["omp"] for r in results] == [None, None]
    assert [r["threads"] for r in results] == [CORES // PROCESSES] * PROCESSES


@pytest.mark.slow
def test_torchrun_workers_get_their_share_of_the_cores_not_torchruns_one_thread(torchruns):
    results = results_of(torchruns["without OMP"])
    assert [r["omp"] for r in results] == ["1", "1"]  # torchrun's default, which would leave one thread
    assert [r["threads"] for r in results] == [CORES // PROCESSES] * PROCESSES


@pytest.mark.slow
def test_an_omp_num_threads_the_user_set_is_kept(torchruns):
    results = results_of(torchruns["user OMP"])  # OMP_NUM_THREADS=1 set by the user
    assert [(r["omp"], r["threads"]) for r in results] == [("1", 1)] * PROCESSES
