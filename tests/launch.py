"""Run a worker script under ``torchrun`` on gloo and collect what each rank wrote.

Workers receive an output directory as their first argument; rank ``r`` writes
``rank{r}.json`` (small results) and optionally ``.pt`` files (tensors, loaded with
``weights_only=True``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"


# Set by an in-process Trainer earlier in the session; a child must not inherit them (it would try to
# join, or bind the port of, this process's process group).
_DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                    "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED")


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess that starts its own distributed job."""
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_ENV}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore", **extra}


def launch(worker: str, nproc: int, out_dir: Path, *args: str, timeout: float = 600, expect_failure: bool = False):
    """Run ``tests/workers/<worker>`` on ``nproc`` ranks; return (per-rank JSON results, completed process)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = child_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(WORKERS / worker), str(out_dir), *args]
    proc = subprocess.run(cmd, env=env, cwd=out_dir, capture_output=True, text=True, timeout=timeout)
    if expect_failure:
        return [], proc
    if proc.returncode != 0:
        raise AssertionError(f"{worker} failed with exit code {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)
               if (out_dir / f"rank{r}.json").exists()]
    return results, proc
