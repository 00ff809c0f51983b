"""``lightning-megatron checkpoint`` reads both formats the strategy saves, a sharded directory and a full
(``checkpoint_format="full"``) file, telling them apart by what is on disk, and refuses anything else by name."""

import pathlib
import zipfile

import lightning as L
import pytest
import torch
from dataclasses import replace
from safetensors.torch import load_file, save_file

from workers.trainer_setup import datamodule, model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.checkpoint import consolidated_state_dict
from lightning_megatron.cli import main as cli_main
from lightning_megatron.huggingface.io import read_weights

EXPECTED = "Expected a sharded checkpoint directory holding megatron_3d.json"


@pytest.fixture(scope="module")
def both_formats(tmp_path_factory):
    """One 2-step run's state saved both ways: the default sharded directory and a checkpoint_format="full" file."""
    root = tmp_path_factory.mktemp("formats")
    L.seed_everything(7)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=Megatron3DStrategy(), default_root_dir=root,
                        **{**trainer_kwargs({"steps": 2}), "limit_val_batches": 0})
    trainer.fit(model({}), datamodule=datamodule({}))
    trainer.save_checkpoint(root / "sharded.ckpt")
    # The same weights, written as one file (what the option selects).
    trainer.strategy.options = replace(trainer.strategy.options, checkpoint_format="full")
    trainer.save_checkpoint(root / "full.ckpt")
    assert (root / "sharded.ckpt").is_dir() and (root / "full.ckpt").is_file()
    return root / "sharded.ckpt", root / "full.ckpt"


def command(capsys, *args) -> tuple[int, str, str]:
    """Run ``lightning-megatron checkpoint ...`` in this process: (exit code, stdout, stderr)."""
    try:
        cli_main(["checkpoint", *map(str, args)])
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
def test_every_command_reads_a_full_checkpoint_as_it_reads_the_sharded_one(both_formats, tmp_path, capsys):
    sharded, full = both_formats
    code, shown, _ = command(capsys, "inspect", full, "--keys")
    assert code == 0
    assert "format       full" in shown and "global_step=2" in shown and "tensor_parallel_size=1" in shown
    assert "hyper_parameters hold a GPTConfig" in shown
    assert "model.embedding.wte.weight  (257, 32)  float32" in shown  # global, unpadded
    assert "format       sharded" in command(capsys, "inspect", sharded)[1]

    for source in (sharded, full):
        assert command(capsys, "consolidate", source, tmp_path / f"{source.stem}.safetensors")[0] == 0
        assert command(capsys, "convert", source, tmp_path / f"hf-{source.stem}")[0] == 0
    from_full, from_sharded = load_file(tmp_path / "full.safetensors"), load_file(tmp_path / "sharded.safetensors")
    assert from_full.keys() == from_sharded.keys() == consolidated_state_dict(sharded).keys()
    assert all(torch.equal(from_full[name], value) for name, value in from_sharded.items())
    hf_full, hf_sharded = read_weights(tmp_path / "hf-full"), read_weights(tmp_path / "hf-sharded")
    assert hf_full.keys() == hf_sharded.keys() and len(hf_full) > 10
    assert all(torch.equal(hf_full[name], value) for name, value in hf_sharded.items())

    code, out, err = command(capsys, "consolidate", full, tmp_path / "with-optimizer.pt", "--optimizer")
    assert code == 0, err
    state = torch.load(tmp_path / "with-optimizer.pt", weights_only=True)
    assert "model.embedding.wte.weight" in state and "optimizer/0/0/exp_avg_sq" in state

    code, out, err = command(capsys, "verify", full)
    assert code == 0 and "every CRC-32 matches" in out, err
    damaged = tmp_path / "damaged.ckpt"
    data = bytearray(full.read_bytes())
    with zipfile.ZipFile(full) as archive:  # flip one byte inside the largest tensor record
        record = max(archive.infolist(), key=lambda info: info.file_size)
    data[record.header_offset + 30 + len(record.filename) + len(record.extra) + record.file_size // 2] ^= 0xFF
    damaged.write_bytes(data)
    code, _, err = command(capsys, "verify", damaged)
    assert code == 1 and f"{damaged} is damaged" in err and record.filename in err


def _not_a_checkpoint(tmp_path, kind):
    path = tmp_path / kind
    if kind == "notes.txt":
        path.write_text("not a checkpoint\n")
    elif kind == "empty-dir":
        path.mkdir()
    elif kind == "runs-dir":  # a directory around checkpoints
        path.mkdir()
        (path / "checkpoints").mkdir()
    elif kind == "model.safetensors":
        save_file({"w": torch.zeros(2)}, str(path))
    elif kind == "truncated.ckpt":
        torch.save({"state_dict": {"w": torch.zeros(100)}}, path)
        path.write_bytes(path.read_bytes()[:200])
    return path


@pytest.mark.parametrize("kind, also", [("notes.txt", "a file of 17 bytes"), ("empty-dir", "an empty directory"),
                                        ("runs-dir", "a directory holding checkpoints/"),
                                        ("model.safetensors", "a safetensors file"),
                                        ("truncated.ckpt", "truncated or unfinished save")])
def test_what_is_neither_format_is_refused_naming_the_path_what_was_expected_and_the_fix(kind, also, tmp_path, capsys):
    path = _not_a_checkpoint(tmp_path, kind)
    before = sorted(tmp_path.rglob("*"))
    for args in (["inspect", path], ["consolidate", path, tmp_path / "out.pt"], ["convert", path, tmp_path / "hf"],
                 ["verify", path]):
        code, _, err = command(capsys, *args)
        assert code == 1, (args, err)
        assert f"{path} is not a checkpoint this command reads" in err and also in err, err
        assert EXPECTED in err and "checkpoint_format='full'" in err and "Pass the checkpoint itself" in err
        assert ("save_pretrained directory holding config.json" in err) == (args[0] == "convert")
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


class WritesAFileWhenUnpickled:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def test_a_full_file_holding_other_pickled_objects_is_refused_unread(tmp_path, capsys):
    marker = tmp_path / "unpickled"
    file = tmp_path / "untrusted.ckpt"
    torch.save({"state_dict": {"model.w": torch.zeros(3)}, "hyper_parameters": {"x": WritesAFileWhenUnpickled(marker)}},
               file)
    for args in (["inspect", file], ["consolidate", file, tmp_path / "out.pt"], ["convert", file, tmp_path / "hf"]):
        code, _, err = command(capsys, *args)
        assert code == 1 and "never unpickles" in err and "weights_only=True" in err, err
    assert not marker.exists()
    torch.save({"weights": torch.zeros(3)}, tmp_path / "plain.pt")  # a torch.save file, but no Lightning checkpoint
    code, _, err = command(capsys, "inspect", tmp_path / "plain.pt")
    assert code == 1 and "not a Lightning checkpoint: it holds no 'state_dict'" in err
