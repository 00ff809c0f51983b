"""Fault injection on the launch: killing the launcher leaves no worker process behind."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from launch import REPO_ROOT, WORKERS, child_env
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
