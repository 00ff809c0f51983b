"""The session's rank pools (tests/launch.py ``run_job``): a job finds its process as a fresh launch would, whatever
the job before it changed; a job that fails on every rank leaves the pool usable; one that hangs or loses a rank
ends the pool with every rank's output in the failure, and the next job gets a new pool."""

import json

import pytest
import torch
from launch import _POOLS, launch, run_job

pytestmark = pytest.mark.slow


def test_a_job_after_one_that_changed_the_process_finds_what_a_fresh_process_finds(tmp_path):
    """A fresh process's generator starts from a random seed, so that part (and the thread count: a pool's rank
    has run torch's thread pools) is compared with the pool's own state before the disturbing job."""
    fresh, _ = launch("pool_probe.py", 2, tmp_path / "fresh", "probe")
    before, _ = run_job("pool_probe", 2, tmp_path / "before", "probe")
    run_job("pool_probe", 2, tmp_path / "disturb", "disturb")
    pooled, _ = run_job("pool_probe", 2, tmp_path / "pooled", "probe")
    assert fresh[0]["rank_sum"] == 1 and fresh[0]["seed_variables"] == []
    assert pooled == before
    generator = ("rand", "initial_seed", "native_threads")
    assert [{k: v for k, v in r.items() if k not in generator} for r in pooled] == \
        [{k: v for k, v in r.items() if k not in generator} for r in fresh]


def test_a_job_that_raises_on_every_rank_leaves_the_pool_usable(tmp_path):
    run_job("pool_probe", 2, tmp_path / "before", "probe")
    starts = _POOLS[2].starts
    with pytest.raises(AssertionError) as failure:
        run_job("pool_probe", 2, tmp_path / "raise", "raise")
    assert "a job that fails on rank 0" in str(failure.value) and "a job that fails on rank 1" in str(failure.value)
    results, _ = run_job("pool_probe", 2, tmp_path / "after", "probe")
    assert _POOLS[2].starts == starts and results[0]["rank_sum"] == 1


@pytest.mark.parametrize("mode", ["hang_on_rank1", "exit_on_rank1"])
def test_a_job_that_hangs_or_loses_a_rank_ends_the_pool_and_the_next_job_gets_a_new_one(tmp_path, mode):
    run_job("pool_probe", 2, tmp_path / "before", "probe")
    starts = _POOLS[2].starts
    with pytest.raises(AssertionError) as failure:
        run_job("pool_probe", 2, tmp_path / "fault", mode, timeout=8)  # ample for rank 0 to reach its all_reduce
    message = str(failure.value)
    assert "--- rank 0:" in message and "--- rank 1:" in message
    if mode == "hang_on_rank1":  # rank 1's error and where rank 0 waited (its stack, by the fault handler)
        assert "rank 1 fails while rank 0 waits for it" in message and "all_reduce" in message
    results, _ = run_job("pool_probe", 2, tmp_path / "after", "probe")
    assert _POOLS[2].starts == starts + 1 and results[1]["rank_sum"] == 1


def test_a_trainer_run_in_a_pool_after_another_equals_a_fresh_launch(tmp_path):
    """A real job, after a different one (another seed, layout and precision) in the same pool: the same losses and
    weights, bit for bit, as the run alone in a fresh process."""
    options = {"tp": 2, "steps": 3}
    fresh, _ = launch("trainer_fit.py", 2, tmp_path / "fresh", json.dumps(options))
    run_job("trainer_fit", 2, tmp_path / "other", json.dumps({"tp": 1, "steps": 2, "seed": 3, "zero_stage": 1}))
    pooled, _ = run_job("trainer_fit", 2, tmp_path / "pooled", json.dumps(options))
    assert [r["losses"] for r in pooled] == [r["losses"] for r in fresh]
    fresh_weights = torch.load(tmp_path / "fresh" / "weights.pt", weights_only=True)
    pooled_weights = torch.load(tmp_path / "pooled" / "weights.pt", weights_only=True)
    assert fresh_weights.keys() == pooled_weights.keys()
    assert all(torch.equal(fresh_weights[key], pooled_weights[key]) for key in fresh_weights)
