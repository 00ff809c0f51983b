"""The benchmark scripts keep running (tiny sizes; no timing is asserted)."""

import subprocess
import sys
from pathlib import Path

from launch import child_env

REPO = Path(__file__).resolve().parents[1]


def test_pipeline_bubble_benchmark_prints_its_table(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "pipeline_bubble.py"), "--ranks=2", "--micro-batches=4",
         "--stage-ms=2", f"--plot={tmp_path / 'timeline.png'}"],
        capture_output=True, text=True, timeout=300, env=child_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines()]
    assert {row[0] for row in rows if row} >= {"gpipe", "1f1b", "interleaved_1f1b"}
    assert (tmp_path / "timeline.png").stat().st_size > 10_000


def test_checkpoint_benchmark_saves_and_restores_both_sides(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "checkpoint.py"), "--quick",
         "--variants", "model_parallel", "megatron_sharded", f"--out-dir={tmp_path}"],
        capture_output=True, text=True, timeout=300, env=child_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split(" | ")[0].strip(): line.split(" | ") for line in result.stdout.splitlines() if " | " in line}
    for label in ("ModelParallelStrategy (DCP)", "Megatron3DStrategy sharded"):
        assert rows[label][5].strip() == "weights+optim", rows[label]  # every rank got back exactly what it saved
    assert (next((tmp_path / "megatron_sharded" / "checkpoints").iterdir()) / "__1_0.distcp").stat().st_size > 0
