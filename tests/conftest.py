"""Fixtures shared by several test modules."""

import os
import sys

# One intra-op thread in this process, as in every rank and launch it starts (launch.child_env): the suite runs
# processes beside it (rank pools, launches started early to fill a core), and torch's two threads on two busy cores
# wait for each other at every op (a small linear: ~25 us on one thread, 0.6-3 ms on two beside one busy process).
# The variable, not only set_num_threads: in-process Trainers keep what it says (strategy.launcher, Lightning's DDP).
os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from launch import LAUNCHES, WORKERS, close_pools, run_job  # noqa: E402

torch.set_num_threads(1)  # in case a plugin imported torch before the variable was set

# The single-process FP8 runs the fp8 layouts compare with (test_layout_invariance.py, test_zero3.py): one process,
# the global batch in as many pieces as the layout has dp ranks x micro-batches, "-s1": the first step only
# (test_layout_invariance.py says why).
FP8_REFERENCES = ["tp1-dp1-mb2-fp8t-s1", "tp1-dp1-mb4-fp8t-s1", "tp1-dp1-mb2-fp8r-s1", "tp1-dp1-mb4-fp8r-s1"]


@pytest.fixture(scope="session")
def fp8_reference(tmp_path_factory) -> dict[str, tuple[list[float], dict]]:
    """``{layout: (losses, weights)}`` of the FP8 reference runs, trained once per session in one process (the
    1-rank pool)."""
    out = tmp_path_factory.mktemp("fp8_reference")
    run_job("layout_invariance", 1, out, ",".join(FP8_REFERENCES))
    results = {name: torch.load(out / f"{name}.pt", weights_only=True) for name in FP8_REFERENCES}
    return {name: (result["losses"], result["weights"]) for name, result in results.items()}


@pytest.fixture(scope="session")
def plan_bytes_job(tmp_path_factory):
    """Every ``BYTE_LAYOUTS`` layout (``tests/workers/plan_layouts.py``) trained one step on the 4-rank pool, once per
    session: ``(per-rank results, the job's process)`` of ``tests/workers/plan_bytes.py``. ``test_plan.py`` holds
    the planner's model-state bytes to it, ``test_simulate.py`` the simulation's."""
    if str(WORKERS) not in sys.path:
        sys.path.insert(0, str(WORKERS))
    from plan_layouts import BYTE_LAYOUTS

    return run_job("plan_bytes", 4, tmp_path_factory.mktemp("plan_bytes"), ",".join(BYTE_LAYOUTS), timeout=900)


@pytest.fixture(scope="session")
def activation_peak_job(tmp_path_factory) -> list[dict]:
    """Every ``benchmarks/memory/peak.py`` layout's measured peak of activation bytes on the 2-rank pool, once per
    session (``tests/workers/activation_peak.py``): per rank, ``{layout: row}``. ``test_plan.py`` holds the
    planner's activation bytes to it, ``test_simulate.py`` the simulation's."""
    from benchmarks.memory.peak import LAYOUTS, RANKS

    keys = ",".join(layout.key for layout in LAYOUTS)
    measured, _ = run_job("activation_peak", RANKS, tmp_path_factory.mktemp("activation_peak"), keys, timeout=900)
    return measured


@pytest.fixture
def one_rank_group():
    """A process group of this process alone (the session's default group when one exists)."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def no_process_group():
    """The layout planner builds shards over torch's fake process group, which needs a process without a default
    group; an in-process Trainer earlier in the session may have left one (each Trainer makes its own when it
    starts), which goes here."""
    if dist.is_initialized():
        dist.destroy_process_group()


def pytest_sessionfinish(session, exitstatus):
    close_pools()


def pytest_terminal_summary(terminalreporter):
    """Every process start and pool job of the session with its seconds, by kind and worker (tests/launch.py)."""
    if not LAUNCHES:
        return
    rows: dict[tuple[str, str, int], list[float]] = {}
    for item in LAUNCHES:
        rows.setdefault((item.kind, item.worker, item.ranks), []).append(item.seconds)
    write = terminalreporter.write_line
    terminalreporter.section("launches")
    write(f"{'kind':<11}{'worker':<26}{'ranks':>6}{'count':>7}{'seconds':>10}")
    for (kind, worker, ranks), seconds in sorted(rows.items(), key=lambda row: -sum(row[1])):
        write(f"{kind:<11}{worker:<26}{ranks:>6}{len(seconds):>7}{sum(seconds):>10.1f}")
    starts = [item for item in LAUNCHES if item.kind != "job"]
    jobs = [item for item in LAUNCHES if item.kind == "job"]
    write(f"{len(starts)} process starts ({sum(item.seconds for item in starts):.1f} s, pool starts: their start-up "
          f"alone), {len(jobs)} pool jobs ({sum(item.seconds for item in jobs):.1f} s)")
