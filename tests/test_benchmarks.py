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


def test_nonfinite_check_benchmark_times_the_check_on_and_off_side_by_side():
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "nonfinite_check.py"), "--quick"],
        capture_output=True, text=True, timeout=300, env=child_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [[cell.strip() for cell in line.split(" | ")] for line in result.stdout.splitlines() if " | " in line]
    assert [(row[0], row[2]) for row in rows[1:]] == [("tiny", "on"), ("tiny", "off")], rows
    assert all(row[-1] == "yes" for row in rows[1:]), "the check changed the training result"
    assert all(float(row[5]) > 0 for row in rows[1:])


def test_checkpoint_checks_benchmark_times_each_check_against_its_baseline(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "checkpoint_checks.py"), "--megabytes=8", "--repeats=1",
         f"--out-dir={tmp_path}"],
        capture_output=True, text=True, timeout=300, env=child_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split(" | ")[0].strip(): line.split(" | ") for line in result.stdout.splitlines() if " | " in line}
    assert {"save with checksums", "verify every file's checksum", "finite check of what was read"} <= set(rows)
    assert (tmp_path / "with.ckpt" / "megatron_3d.json").is_file()
