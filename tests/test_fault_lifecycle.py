"""Nothing lost, nothing silent (issue 10): a stalled rank, an error while the model is on the meta device, a
model replicated over tp for want of a plan, and devices= that disagree with the processes torchrun started.

Multi-rank runs are real torchrun launches (tests/workers/fault_lifecycle.py); each rank's stderr is read
back exactly as that rank printed it. The launches that the tests only read afterwards (the checks, the uneven
exit) start together at the module's first test and run next to the others (the stalled run waits out its timeout
on an idle core).
"""

import inspect
import json
import re
import time
from datetime import timedelta

import lightning as L
import pytest
import torch
import torch.distributed as dist

from launch import Started, child_env, launch, selected, torchrun_command
from workers.fault_models import (MISNAMED_ERROR, MISNAMED_PLAN, STALL_SECONDS, STALL_TIMEOUT_SECONDS, Planned,
                                  trainer_kwargs)
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.strategy.diagnostics import collective_failure

def last_lines(path, count: int) -> list[str]:
    """The last ``count`` lines a rank printed, without torch's ``[rankN]:`` prefix."""
    lines = [re.sub(r"^\[rank\d+\]: ", "", line) for line in path.read_text().splitlines() if line.strip()]
    return lines[-count:]


CHECKS_TESTS = ("test_devices_that_disagree_with_torchrun_fail_on_every_rank",
                "test_model_without_a_plan_at_tp2_warns_once_on_rank_zero",
                "test_an_offload_path_one_rank_cannot_use_stops_every_rank_in_setup",
                "test_default_timeout_reaches_every_group_of_the_layout")
UNEVEN_TEST, UNEVEN_LAG = "test_ranks_that_finish_at_different_times_leave_together_and_cleanly", 2.0


@pytest.fixture(scope="module", autouse=True)
def started(request, tmp_path_factory):
    """The 2-rank launches of this session's selection that tests only read: "checks" (one launch, several fits) and
    "uneven exit", started at the module's first test."""
    runs = {}
    for name, test_names, worker, args in (("checks", CHECKS_TESTS, "fault_lifecycle.py", ["checks"]),
                                           ("uneven exit", (UNEVEN_TEST,), "uneven_exit.py", [str(UNEVEN_LAG)])):
        if any(selected(request, test) for test in test_names):
            out = tmp_path_factory.mktemp(name.replace(" ", "_"))
            runs[name] = Started(torchrun_command(worker, 2, out, *args), out, timeout=300, env=child_env())
    yield runs
    for run in runs.values():
        run.stop()


def test_default_timeout_is_ten_minutes():
    assert inspect.signature(Megatron3DStrategy).parameters["timeout"].default == timedelta(minutes=10)


@pytest.mark.slow
def test_stalled_rank_times_out_naming_the_phase_and_step_without_hanging(tmp_path):
    """Rank 1 sleeps 60 s after backward of step 2, timeout=5 s: rank 0 gives up after 5 s, says it was waiting
    in optimizer step 2 and why, and the whole run ends while rank 1 still sleeps (nobody waits for it)."""
    _, proc = launch("fault_lifecycle.py", 2, tmp_path, "stall", timeout=300, expect_failure=True)
    finished = time.time()
    assert proc.returncode != 0
    stalled_at = float((tmp_path / "stall_started").read_text())
    assert finished - stalled_at < STALL_SECONDS - 15, (
        f"the run ended {finished - stalled_at:.0f} s after rank 1 stalled: something waited for the stalled rank")
    note = last_lines(tmp_path / "rank0.stderr", 3)
    waited = timedelta(seconds=STALL_TIMEOUT_SECONDS)
    assert note[0].startswith(f"Megatron3DStrategy: rank 0 of 2 timed out after waiting {waited}"), note
    assert "in optimizer step 2 (gradient reduction over dp / global-norm clipping / ZeRO all-gather)" in note[0], note
    assert "another rank never joined this collective" in note[1] and "stalled" in note[1], note
    assert note[2].startswith("Fix: find the stalled rank") and "timeout=timedelta" in note[2], note
    # The backend's own error is right above the note: the note explains it rather than replacing it.
    assert "Timed out" in (tmp_path / "rank0.stderr").read_text()
    # torchrun stops the sleeping rank with SIGTERM: it says so, and never saves (no step comes).
    rank1 = last_lines(tmp_path / "rank1.stderr", 1)
    assert rank1[0].startswith("lightning-megatron: SIGTERM received"), rank1


def test_error_while_on_meta_is_the_last_error_on_one_process():
    """A plan entry naming no submodule fails in the strategy's set-up, before materialisation: that error, not
    teardown's "Cannot copy out of meta tensor", is what the user gets."""
    trainer = L.Trainer(devices=1, strategy=Megatron3DStrategy(), max_steps=1, **trainer_kwargs())
    try:
        with pytest.raises(ValueError, match=MISNAMED_ERROR):
            trainer.fit(Planned(MISNAMED_PLAN))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_error_while_on_meta_is_the_last_error_on_every_rank(tmp_path):
    """Ten 2-rank runs: on every rank of every run the strategy's error is the last line and the exit code an
    uncaught error's. Left to the interpreter, gloo's native teardown at exit sometimes aborted below it ("terminate
    called without an active exception", exit code SIGABRT's), which the strategy now skips once the error is printed
    (issue 31). One torchrun launch: each rank first forks nine copies of itself after its imports, one after
    another, each pair of copies a run with its own store (hosted here, as torchrun's agent hosts the launch's); each
    copy ends through the interpreter's exit as a fresh process does. The tenth run is the launch itself."""
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(9)]
    _, proc = launch("fault_lifecycle.py", 2, tmp_path, "meta_error", ",".join(str(store.port) for store in stores),
                     timeout=300, expect_failure=True)
    assert proc.returncode != 0
    assert "SIGABRT" not in proc.stderr, proc.stderr[-2000:]  # torchrun's report: both ranks exited with 1
    runs = [tmp_path / f"run{i}" for i in range(9)] + [tmp_path]
    for out in runs:
        for rank in range(2):
            printed = (out / f"rank{rank}.stderr").read_text()
            last = last_lines(out / f"rank{rank}.stderr", 1)[0]
            assert last.startswith(f"ValueError: {MISNAMED_ERROR}"), f"{out.name} rank {rank}: {printed[-2000:]}"
            assert "terminate called" not in printed and "Cannot copy out of meta tensor" not in printed
            if out != tmp_path:  # a forked copy: its parent recorded how it ended (the launch's: torchrun's report)
                assert (out / f"rank{rank}.exit").read_text() == "1", f"{out.name} rank {rank}: {printed[-2000:]}"


@pytest.fixture
def checks(started):
    proc = started["checks"].result()
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return [json.loads((started["checks"].cwd / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 4])
def test_devices_that_disagree_with_torchrun_fail_on_every_rank(checks, devices):
    for result in checks:
        error = result[f"devices={devices}"]
        assert error is not None, "the run went ahead with a device count torchrun did not start"
        assert error.startswith("ValueError: Megatron3DStrategy: torchrun started 2 processes (2 on this node)"), error
        assert f"devices={devices} and num_nodes=1" in error
        assert "pass Trainer(devices=2, num_nodes=1)" in error and f"--nproc-per-node={devices}" in error


@pytest.mark.slow
@pytest.mark.parametrize("case, declared", [
    ("no plan", "Unplanned declares no tensor_parallel_plan()"),
    ("empty plan", "Planned has a tensor_parallel_plan() that splits no layer"),
])
def test_model_without_a_plan_at_tp2_warns_once_on_rank_zero(checks, case, declared):
    rank0, rank1 = checks[0][case], checks[1][case]
    assert len(rank0) == 1 and rank1 == [], (rank0, rank1)
    warning = rank0[0]
    assert warning.startswith(f"Megatron3DStrategy: {declared}"), warning
    assert "at tensor_parallel_size=2 it is fully replicated" in warning
    assert "each of the 2 tensor-parallel ranks holds and computes the whole model" in warning
    assert "Declare tensor_parallel_plan()" in warning and "tensor_parallel_size=1" in warning


@pytest.mark.slow
def test_an_offload_path_one_rank_cannot_use_stops_every_rank_in_setup(checks):
    rank0, rank1 = checks[0]["nvme path"], checks[1]["nvme path"]
    assert rank1 == ("ValueError: Rank 1: offload_path='offload_here' is a file, not a folder. Choose a folder on a "
                     "local disk this process can write."), rank1
    assert rank0 == f"PeerFailed: Rank 1 cannot set up the 'nvme' offload tier: {rank1}", rank0
    # Rank 0 had made its files before hearing of rank 1: they are gone with the failed set-up, the file untouched.
    assert checks[0]["nvme files left"] in ([], ["offload_here"]), checks[0]["nvme files left"]
    assert checks[1]["nvme files left"] == ["offload_here"]


@pytest.mark.slow
def test_default_timeout_reaches_every_group_of_the_layout(checks):
    """init_process_group(timeout=) sets only the world group's; new_group would give the others torch's 30 min."""
    for result in checks:
        assert result["timeouts"] == {"world": 600.0, "tp": 600.0, "model_parallel": 600.0}, result["timeouts"]


@pytest.mark.parametrize("message, kind", [
    ("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv "
     "operation to complete", "timeout"),
    ("Application timeout caused pair closure", "timeout"),
    ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, "
     "NumelOut=1, Timeout(ms)=600000) ran for 600039 milliseconds before timing out.", "timeout"),
    # TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (processes.surface_nccl_timeouts): the group's next use in the training thread
    ("NCCL communicator was aborted on rank 1.  Original reason for failure was: [PG ID 0 PG GUID 0(default_pg) "
     "Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, "
     "NumelOut=1, Timeout(ms)=600000) ran for 600039 milliseconds before timing out.", "timeout"),
    ("NCCL communicator was aborted on rank 3. ", "lost"),
    ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:26030", "lost"),
    ("DataLoader timed out after 5 seconds", None),  # not a collective: no note
])
def test_which_errors_are_collective_failures(message, kind):
    assert collective_failure(RuntimeError(message)) == kind


@pytest.mark.parametrize("backend, before, after", [
    ("nccl", None, "2"),  # torch's default (3): the watchdog thread would end the process
    ("cpu:gloo,cuda:nccl", "1", "2"),  # torchrun's default
    ("nccl", "3", "2"),
    ("nccl", "0", "0"),  # the user's choices are kept
    ("nccl", "2", "2"),
    ("gloo", None, None),  # gloo raises its timeouts in the calling thread already
])
def test_nccl_timeouts_are_made_to_reach_python(backend, before, after):
    """On NCCL the launcher makes a timed-out collective an exception in the training thread (NCCL's watchdog only
    aborts the communicators), so that on_exception can say which phase and step were waiting."""
    from lightning_megatron.strategy.processes import NCCL_ERROR_HANDLING, surface_nccl_timeouts

    environ = {} if before is None else {NCCL_ERROR_HANDLING: before}
    assert surface_nccl_timeouts(backend, environ) == (before != after)
    assert environ.get(NCCL_ERROR_HANDLING) == after


def test_init_processes_sets_the_nccl_error_handling_before_joining(monkeypatch):
    """The variable is read when a process group is created: it is set before the default group is joined."""
    from lightning_megatron.strategy import processes

    seen = {}

    def joined(environment, backend, **kwargs):
        seen["handling"] = processes.os.environ.get(processes.NCCL_ERROR_HANDLING)
        raise RuntimeError("stop before any process group")

    monkeypatch.delenv(processes.NCCL_ERROR_HANDLING, raising=False)
    monkeypatch.setattr(processes, "_init_dist_connection", joined)
    with pytest.raises(RuntimeError, match="stop before"):
        processes.init_processes(None, None, torch.device("cpu"), backend="nccl", timeout=None)
    assert seen["handling"] == "2"


@pytest.mark.slow
def test_ranks_that_finish_at_different_times_leave_together_and_cleanly(started):
    """After a normal run every rank waits for the others at exit, then destroys the process groups itself (not
    the interpreter's finalisation): exit code 0 everywhere and no native abort below the output."""
    run, lag = started["uneven exit"], UNEVEN_LAG
    proc = run.result()
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = [json.loads((run.cwd / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["groups_at_exit"] for r in results] == [False, False], "the groups were left to the finalisation"
    assert results[0]["left_after"] >= lag * 0.9, "rank 0 left while rank 1 was still working"
    assert "terminate called" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
