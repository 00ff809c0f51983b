"""Under SLURM: the strategy reads a job's ranks and builds its groups from the variables ``srun`` sets.

Four processes get the variables of a 2-node x 2-task job (``launch.launch_slurm``, no SLURM installed) and
fit under Lightning's ``SLURMEnvironment``, which derives MASTER_ADDR from ``SLURM_NODELIST`` and MASTER_PORT from
``SLURM_JOB_ID``, as on a cluster. The same processes then take the time limit's signal (``SaveAndRequeue``, with
a stand-in ``scontrol``). The sbatch scripts in ``examples/slurm`` are checked in ``test_slurm_scripts.py``.
"""

import json
import os

import pytest
import torch

from launch import free_slurm_port, launch_slurm
from test_strategy import plain_lightning_run

OPTIONS = {"steps": 2, "layouts": [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
           "requeue_steps": 4, "signalled_task": 3}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    job_id, port = free_slurm_port()
    out = tmp_path_factory.mktemp("slurm")
    bin_dir = out / "bin"  # a stand-in for SLURM's scontrol: it records how it was called
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {out / "scontrol.txt"}\n')
    (bin_dir / "scontrol").chmod(0o755)
    results, _ = launch_slurm("slurm_env.py", 2, 2, out, json.dumps(OPTIONS), job_id=job_id, timeout=600,
                              PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    scontrol = (out / "scontrol.txt").read_text() if (out / "scontrol.txt").exists() else None
    return results, port, {"out": out, "job_id": job_id, "scontrol": scontrol}


@pytest.mark.slow
def test_ranks_come_from_slurm_and_the_address_from_its_node_list(job):
    results, port, _ = job
    for task, result in enumerate(results):
        assert result["environment"] == {"MASTER_ADDR": None, "MASTER_PORT": None}, "the test must not set them"
        assert result["environment_after"] == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        for layout in result["layouts"]:
            assert layout["cluster_environment"] == "SLURMEnvironment"
            assert layout["launcher"] == "InPlaceLauncher", "srun started the processes: the strategy starts none"
            assert (layout["global_rank"], layout["dist_rank"]) == (task, task)  # SLURM_PROCID
            assert (layout["local_rank"], layout["node_rank"]) == (task % 2, task // 2)  # SLURM_LOCALID, _NODEID
            assert layout["world_size"] == layout["dist_world_size"] == 4  # SLURM_NTASKS


@pytest.mark.slow
def test_tensor_parallel_groups_stay_inside_a_node_and_data_parallel_crosses_nodes(job):
    results, _, _ = job
    for task, result in enumerate(results):
        node = [2 * (task // 2), 2 * (task // 2) + 1]
        tp2, pp2 = result["layouts"]
        assert (tp2["tp"], tp2["dp"], tp2["pp"]) == (node, [task % 2, task % 2 + 2], [task])
        # pp outermost: stage 0 on node 0, stage 1 on node 1; dp inside each node.
        assert (pp2["tp"], pp2["dp"], pp2["pp"]) == ([task], node, [task % 2, task % 2 + 2])


@pytest.mark.slow
def test_training_under_slurm_matches_a_single_process(job):
    results, _, _ = job
    reference = torch.tensor(plain_lightning_run(OPTIONS)[0])
    tp2 = torch.tensor([r["layouts"][0]["losses"] for r in results])
    assert torch.equal(tp2[0], tp2[1]) and torch.equal(tp2[2], tp2[3]), "the tp ranks of a replica see one loss"
    assert torch.allclose((tp2[0] + tp2[2]) / 2, reference, atol=1e-5), (tp2, reference)
    pp2 = torch.tensor([r["layouts"][1]["losses"] for r in results])
    assert torch.allclose((pp2[0] + pp2[1]) / 2, reference, atol=1e-5), (pp2, reference)


@pytest.mark.slow
def test_tasks_per_node_that_disagree_with_devices_fail_on_every_task_before_any_collective(job):
    results, _, _ = job
    for result in results:
        error = result["mismatch"]
        assert error is not None, "the run went ahead with a device count SLURM did not start"
        assert not result["initialized_after_mismatch"]
        assert error.startswith("Megatron3DStrategy: SLURM started 4 tasks (SLURM_NTASKS=4, SLURM_NNODES=2, "
                                "SLURM_NTASKS_PER_NODE=2), but the Trainer was given devices=1 and num_nodes=2"), error
        assert "pass Trainer(devices=2, num_nodes=2)" in error and "--ntasks-per-node=1" in error


@pytest.mark.slow
def test_the_time_limit_signal_saves_on_every_task_at_one_step_requeues_once_and_resumes_exactly(job):
    """SLURM signals every task; each notices at its own point of a step (here: only task 3 does, during step 2).
    Every task saves last.ckpt at the same step and stops; rank 0 requeues once; the requeued run (ckpt_path="last")
    ends where an uninterrupted one does, with the same losses."""
    results, _, run = job
    out = run["out"]
    for result in results:
        requeue = result["requeue"]
        assert requeue["stopped_at"] == [2, OPTIONS["requeue_steps"]], requeue["stopped_at"]
        assert requeue["saved"] == str(out / "checkpoints" / "last.ckpt")
        assert requeue["handler_restored"]
    assert run["scontrol"] == f"requeue {run['job_id']}\n", "rank 0 requeues, once"
    assert not list(out.rglob("hpc_ckpt_*")), "Lightning's own SLURM handler (a save inside the handler) stayed out"
    saved = out / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in saved.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)], "every rank's shards"
    assert json.loads((saved / "megatron_3d.json").read_text())["global_step"] == 2
    reference = torch.tensor(plain_lightning_run({**OPTIONS, "steps": OPTIONS["requeue_steps"]})[0])
    tp2 = torch.tensor([r["requeue"]["losses"] for r in results])  # 2 steps before the signal, 2 after the requeue
    assert torch.allclose((tp2[0] + tp2[2]) / 2, reference, atol=1e-5), (tp2, reference)
