"""Running a benchmark's workers in fresh processes and collecting what each rank wrote.

Every measured run is a fresh process: a peak RSS is a high-water mark that never goes down, and no run should
inherit another's allocator caches or warmed-up kernels. Workers write ``rank{r}.json`` into a result directory;
the parent reads them back once the launch has exited.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]


def repo_env(**extra: str) -> dict[str, str]:
    """This environment (and ``extra``) with the repository first on ``PYTHONPATH``: a child process imports this
    checkout's package whatever is installed."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
                **extra)


def worker_env(threads: int = 1, **extra: str) -> dict[str, str]:
    """``repo_env`` with warnings off (they would interleave with the progress lines) and ``threads`` intra-op
    threads per process.

    One thread is also what torchrun gives each rank: on a shared CPU a multi-threaded matmul waits for its slowest
    thread, and runs got 10-60x slower whenever another job was busy. ``threads=0`` leaves torch's default.
    """
    env = repo_env(PYTHONWARNINGS="ignore", **extra)
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def torchrun(ranks: int, module: str, *args: str) -> list[str]:
    """The command that runs ``python -m module args`` on ``ranks`` local processes (``torch.distributed.run
    --standalone``); a benchmark passes its own ``__spec__.name`` (``benchmarks.memory.peak``, ...)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            "-m", module, *args]


def run_checked(cmd: list[str], what: str, cwd: Optional[Path] = None, env: Optional[dict[str, str]] = None,
                capture_stderr: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd``; if it fails, a ``RuntimeError`` naming ``what`` with the tail of its output (stderr passes
    through to the terminal instead where ``capture_stderr`` is off: workers that print progress there)."""
    proc = subprocess.run(cmd, env=worker_env() if env is None else env, cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE if capture_stderr else None, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit code {proc.returncode}):\n{proc.stdout[-3000:]}"
                           + (f"\n{proc.stderr[-6000:]}" if capture_stderr else ""))
    return proc


def read_ranks(result_dir: Path, ranks: int) -> list:
    """What each of ``ranks`` workers wrote to ``result_dir/rank{r}.json``, in rank order."""
    return [json.loads((Path(result_dir) / f"rank{r}.json").read_text()) for r in range(ranks)]


def add_worker_flags(parser: argparse.ArgumentParser, choices: Optional[Sequence[str]] = None) -> None:
    """The hidden flags a parent passes its workers: ``--worker`` (a flag, or which of ``choices`` to run) and
    ``--result-dir`` (where ``rank{r}.json`` goes)."""
    if choices is None:
        parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    else:
        parser.add_argument("--worker", choices=list(choices), help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", type=Path, help=argparse.SUPPRESS)


def launch_workers(module: str, ranks: int, threads: int, argv: Sequence[str]) -> list:
    """``python -m module argv --worker --result-dir DIR`` on ``ranks`` torchrun processes (``DIR`` a temporary directory),
    the per-rank results: the side-by-side benchmarks that train every variant in one launch (their workers report
    progress on stderr)."""
    with tempfile.TemporaryDirectory(prefix=f"{module.rsplit('.', 1)[-1]}-") as tmp:
        cmd = torchrun(ranks, module, *argv, "--worker", "--result-dir", tmp)
        run_checked(cmd, "the benchmark worker", Path(tmp), worker_env(threads), capture_stderr=False)
        return read_ranks(Path(tmp), ranks)


def worker_rank_and_device(device_type: str):
    """This worker's global rank and its device (CUDA: the local rank's GPU, made current); a plain process is
    rank 0."""
    import torch

    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return rank, device
