"""One training run per checkpoint folder (``checkpoint.run_lock``), and a folder that cannot be written is
found at the start, not at the first save."""

import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys

import pytest

from launch import child_env, launch
from test_checkpoint_files import fit
from lightning_megatron.checkpoint.run_lock import RUN_LOCK_FILE, RunLock

HOLD = ("import sys\nfrom lightning_megatron.checkpoint.run_lock import RunLock\n"
        "lock = RunLock.take(sys.argv[1])\nprint('held', flush=True)\nsys.stdin.read()\n")


def other_run(directory):
    """Another process holding ``directory``'s lock, as a run training there would."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=child_env())
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.slow
def test_a_second_run_in_the_same_checkpoint_folder_is_refused_and_a_dead_ones_lock_taken_over(tmp_path, caplog):
    folder = tmp_path / "checkpoints"
    holder = other_run(folder)
    try:
        with pytest.raises(RuntimeError, match=rf"Checkpoint directory {folder} is in use by another training run: "
                                               rf"pid {holder.pid} on {socket.gethostname()}, started .*Wait for that "
                                               rf"run to end, or give this one its own folder"):
            fit(folder, 2, save_every=1)
        assert sorted(path.name for path in folder.iterdir()) == [RUN_LOCK_FILE]  # nothing trained or saved
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # the other run dies without releasing its lock
        holder.wait()
    with caplog.at_level(logging.INFO):
        trainer, _ = fit(folder, 2, save_every=1)
    assert trainer.global_step == 2 and (folder / "epoch=0-step=2.ckpt").is_dir()
    assert f"taking over the lock of a run that ended without releasing it (pid {holder.pid} on" in caplog.text
    assert not (folder / RUN_LOCK_FILE).exists()  # released (removed) when the run ended
    RunLock.take(folder).release()


def test_the_lock_names_its_holder_and_refuses_a_second_taker(tmp_path):
    lock = RunLock.take(tmp_path / "new" / "folder")  # created
    holder = json.loads((tmp_path / "new" / "folder" / RUN_LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(RuntimeError, match=rf"pid {os.getpid()} on "):
        RunLock.take(tmp_path / "new" / "folder")
    lock.release()
    assert not (tmp_path / "new" / "folder" / RUN_LOCK_FILE).exists()  # a released lock leaves no file
    RunLock.take(tmp_path / "new" / "folder").release()


def test_a_lock_taken_on_a_file_its_holder_removed_is_taken_again_on_the_file_there(tmp_path):
    """A process that opened the lock file just before its holder released (removed) it must not hold a lock on
    the removed file while a third process locks the new one: it takes again, on the file now at the path."""
    first = RunLock.take(tmp_path)
    opened_before_release = open(tmp_path / RUN_LOCK_FILE)
    first.release()
    second = RunLock.take(tmp_path)  # a new file
    fcntl.flock(opened_before_release, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the removed file's lock: free, but stale
    with pytest.raises(RuntimeError, match="in use by another training run"):
        RunLock.take(tmp_path)  # the file at the path is the second run's, and locked
    opened_before_release.close()
    second.release()


@pytest.mark.slow
def test_a_checkpoint_folder_that_cannot_be_written_stops_the_run_before_the_first_step(tmp_path):
    (tmp_path / "results.csv").write_text("step,loss\n")
    folder = tmp_path / "results.csv" / "checkpoints"  # under a file: it can never be created
    with pytest.raises(RuntimeError, match=rf"Checkpoint directory {folder} cannot be written \(NotADirectoryError: "
                                           rf".*choose a folder this run can write"):
        fit(folder, 2, save_every=1)


@pytest.mark.slow
def test_a_script_that_fits_twice_on_one_folder_resumes_on_every_rank_while_rank_zero_lingers(tmp_path):
    """The first fit's lock is gone before any rank leaves it: a rank that reaches the second fit's start (which
    checks the lock in every process) before rank zero has finished ``on_fit_end`` is not refused, so no rank
    waits forever in a collective for one that was (a SLURM job's requeue hung so)."""
    _, straight = fit(tmp_path / "straight", 4)
    results, _ = launch("fit_twice.py", 2, tmp_path / "out", str(tmp_path / "checkpoints"), timeout=240)
    assert len(results) == 2, "a rank did not finish both fits"
    for fits in results:
        assert [run["started_at"] for run in fits] == [0, 2]
        assert fits[0]["losses"] + fits[1]["losses"] == pytest.approx(straight, abs=1e-5)
    assert not (tmp_path / "checkpoints" / RUN_LOCK_FILE).exists()
