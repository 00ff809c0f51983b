"""The ``lightning-megatron`` command: config parsing and the default run, as a user types them."""

import shutil
import subprocess
from pathlib import Path

import pytest

from launch import child_env
from lightning_megatron.checkpoint import consolidated_state_dict, open_sharded
from lightning_megatron.cli import main

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "gpt-tiny.yaml"


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_config_parses(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / config), "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "lightning_megatron.Megatron3DStrategy" in printed and "class_path: lightning_megatron.models." in printed


def test_print_config_parses_and_overrides(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIG), "--trainer.max_steps=7", "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "max_steps: 7" in printed
    assert "lightning_megatron.Megatron3DStrategy" in printed
    assert "tensor_parallel_size: 2" in printed


def run_command(tmp_path, *args):
    executable = shutil.which("lightning-megatron")
    assert executable, "install the package (pip install -e .) so the lightning-megatron command exists"
    result = subprocess.run([executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env=child_env())
    assert result.returncode == 0, result.stderr[-5000:]
    return result


def test_default_run_trains_with_tensor_parallelism_and_saves_a_layout_free_checkpoint(tmp_path):
    result = run_command(
        tmp_path, "fit", "--config", str(CONFIG), "--trainer.max_steps=4", "--trainer.val_check_interval=4",
        "--trainer.limit_val_batches=2", "--data.max_files=40", f"--trainer.default_root_dir={tmp_path}",
    )
    assert "tp=2 pp=1 dp=1" in result.stdout + result.stderr
    checkpoints = list(tmp_path.rglob("*.ckpt"))
    assert len(checkpoints) == 1, checkpoints
    saved = open_sharded(checkpoints[0])  # a directory: each rank wrote its own shards
    assert saved.info["global_step"] == 4
    assert saved.info["layout"]["tensor_parallel_size"] == 2
    assert saved.trainer_state()["global_step"] == 4
    # Full global shapes: the vocabulary is stored unpadded.
    assert consolidated_state_dict(checkpoints[0])["model.embedding.wte.weight"].shape == (257, 64)


def test_bert_tiny_config_trains_two_steps(tmp_path):
    run_command(
        tmp_path, "fit", "--config", str(REPO / "configs" / "bert-tiny.yaml"), "--trainer.max_steps=2",
        "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1", "--data.max_files=30",
        f"--trainer.default_root_dir={tmp_path}",
    )
    checkpoint = open_sharded(next(tmp_path.rglob("*.ckpt"))).trainer_state()
    assert checkpoint["global_step"] == 2
    assert checkpoint["hyper_parameters"]["config"]["norm_position"] == "pre"
