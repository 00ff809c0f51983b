"""Fault injection on the launch: killing the launcher leaves no worker process behind.

The runs under Lightning's launcher that the tests only read afterwards start together at the module's first test
(each run's second process imports while its first waits: one run at a time leaves a core idle)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from launch import REPO_ROOT, WORKERS, Started, child_env, selected
import pytest


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited already


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


@pytest.mark.slow
def test_killing_the_launcher_kills_the_script_copies_it_started(tmp_path):
    launcher = subprocess.Popen([sys.executable, str(WORKERS / "stalled_child.py"), str(tmp_path)],
                                env=child_env(PYTHONPATH=f"{WORKERS}:{REPO_ROOT}"), cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    child = None
    try:
        assert wait_for(lambda: (tmp_path / "rank1.pid").exists() and (tmp_path / "rank0.pid").exists(), 240), \
            launcher.stderr.read()[-3000:] if launcher.poll() is not None else "no pid files"
        child = int((tmp_path / "rank1.pid").read_text())
        assert int((tmp_path / "rank0.pid").read_text()) == launcher.pid and child != launcher.pid
        launcher.kill()  # SIGKILL: no handler of the launcher's can run
        launcher.wait(timeout=30)
        assert wait_for(lambda: not alive(child), 20), f"rank 1 (pid {child}) outlived its launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if child is not None and alive(child):
            os.kill(child, signal.SIGKILL)


STOP_SIGNALS = [(signal.SIGTERM, 143), (signal.SIGINT, 130)]
STOP_TEST = "test_a_stop_by_signal_saves_at_one_step_on_every_rank_and_exits_with_128_plus_the_signal"
DATA_ERROR_TEST = "test_a_data_error_on_one_rank_is_the_last_thing_printed_and_the_other_rank_says_one_line"


def _run(script: str, out: Path, *args: str, **popen) -> Started:
    return Started([sys.executable, str(WORKERS / script), str(out), *args], out,
                   env=child_env(PYTHONPATH=f"{WORKERS}:{REPO_ROOT}"), **popen)


@pytest.fixture(scope="module", autouse=True)
def started(request, tmp_path_factory):
    """The stop-by-signal and data-error runs of this session's selection, started at the module's first test."""
    runs = {}
    for signum, _ in STOP_SIGNALS:
        if selected(request, STOP_TEST, signum=signum):  # its own process group: Ctrl-C hits it alone
            runs[signum] = _run("stop_signal.py", tmp_path_factory.mktemp(signum.name), signum.name,
                                start_new_session=True)
    if selected(request, DATA_ERROR_TEST):
        runs["data error"] = _run("bad_sft_data.py", tmp_path_factory.mktemp("data_error"))
    yield runs
    for run in runs.values():
        run.stop()


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", STOP_SIGNALS)
def test_a_stop_by_signal_saves_at_one_step_on_every_rank_and_exits_with_128_plus_the_signal(started, signum, code):
    """SIGTERM to the launcher's process alone (``kill <pid>``), or Ctrl-C (SIGINT to the whole process group),
    under Lightning's own launcher: every rank saves last.ckpt at the same step and the job ends non-zero."""
    out, run = started[signum].cwd, started[signum].result()
    assert run.returncode == code, run.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["exit_code"] for r in ranks] == [code, code]
    assert [r["stopped_at"] for r in ranks] == [3, 3], "the ranks stopped at different steps (or ran to the end)"
    saved = out / "checkpoints" / "last.ckpt"
    assert json.loads((saved / "megatron_3d.json").read_text())["global_step"] == 3
    assert sorted(p.name for p in saved.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert f"{signum.name}{')' if signum == signal.SIGINT else ''} received" in run.stderr
    assert f"{signum.name}: stopped at step 3; resume with fit(ckpt_path='last')" in run.stderr + run.stdout
    assert "terminate called" not in run.stderr



@pytest.mark.slow
def test_a_data_error_on_one_rank_is_the_last_thing_printed_and_the_other_rank_says_one_line(started):
    out, run = started["data error"].cwd, started["data error"].result()
    assert run.returncode == 1, run.stderr[-4000:]
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(f"[rank0]: ValueError: {out / 'chats.jsonl'}:2: invalid JSON"), lines[-8:]
    assert "[rank1]: PeerFailed: Building the SFT conversations in" in run.stderr
    assert "[rank1]: Traceback" not in run.stderr, "the rank that only followed rank 0's failure printed a traceback"
