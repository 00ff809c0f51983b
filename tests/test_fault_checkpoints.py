"""Fault injection on checkpoints: nothing a user saved is lost, nothing damaged or diverged is loaded or written.

Each test reproduces one case of the fault-injection survey (issue 10) on real files: a mistaken
target, a crash between the renames of a replacement, a save that never finished, a full disk,
bytes changed in place, weights that went NaN.
"""

import json
import logging
import shutil
import signal
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch
from dataclasses import replace
from lightning.pytorch.callbacks import ModelCheckpoint

from launch import REPO_ROOT, WORKERS, child_env, run_job
from test_checkpoint_files import fit
from lightning_megatron.checkpoint import open_sharded, read_full_tensors
from lightning_megatron.checkpoint.replacement import partial_path, replaced_path
from lightning_megatron.cli import main as cli_main
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.strategy.options import verify_mode


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step run's trainer (still usable for saves) and its sharded checkpoint (checksums: the default)."""
    root = tmp_path_factory.mktemp("run")
    trainer, _ = fit(root, 2)
    trainer.save_checkpoint(root / "two.ckpt")
    return trainer, root / "two.ckpt"


def user_directory(path):
    """A directory of someone's files where a checkpoint was not meant to go."""
    (path / "notes").mkdir(parents=True)
    (path / "results.csv").write_text("step,loss\n1,5.5\n")
    (path / "notes" / "todo.txt").write_text("do not delete me")
    return {file.relative_to(path): file.read_bytes() for file in path.rglob("*") if file.is_file()}


def files_of(path):
    return {file.relative_to(path): file.read_bytes() for file in path.rglob("*") if file.is_file()}


# ----------------------------------------------------------------------------- 1. a mistaken target
@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_format", ["sharded", "full"])
def test_save_checkpoint_refuses_an_existing_directory_of_user_files(run, tmp_path, checkpoint_format):
    trainer, _ = run
    before = user_directory(tmp_path / "runs")
    trainer.strategy.options = replace(trainer.strategy.options, checkpoint_format=checkpoint_format)
    try:
        with pytest.raises(FileExistsError, match=r"runs: it exists and is not a lightning-megatron checkpoint.*"
                                                  r"results\.csv.*Nothing was written or removed"):
            trainer.save_checkpoint(tmp_path / "runs")
    finally:
        trainer.strategy.options = replace(trainer.strategy.options, checkpoint_format="sharded")
    assert files_of(tmp_path / "runs") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # no partial or replaced left beside it


@pytest.mark.slow
def test_save_checkpoint_refuses_a_file_that_is_not_a_checkpoint(run, tmp_path):
    trainer, _ = run
    (tmp_path / "model.ckpt").write_text("my own notes")
    with pytest.raises(FileExistsError, match=r"a file of 12 bytes"):
        trainer.save_checkpoint(tmp_path / "model.ckpt")
    assert (tmp_path / "model.ckpt").read_text() == "my own notes"


@pytest.mark.slow
def test_save_checkpoint_still_replaces_its_own_checkpoints_and_lightning_files(run, tmp_path):
    trainer, checkpoint = run
    shutil.copytree(checkpoint, tmp_path / "ours.ckpt")
    torch.save({"state_dict": {}}, tmp_path / "lightning.ckpt")  # any torch.save checkpoint file, as Lightning does
    (tmp_path / "empty").mkdir()
    for name in ("ours.ckpt", "lightning.ckpt", "empty"):
        trainer.save_checkpoint(tmp_path / name)
        assert open_sharded(tmp_path / name).info["global_step"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["to_hf", "from_hf"])
def test_checkpoint_convert_refuses_an_existing_directory_of_user_files(run, tmp_path, direction):
    _, checkpoint = run
    if direction == "to_hf":
        source = checkpoint
    else:
        source = tmp_path / "hf"
        cli_main(["checkpoint", "convert", str(checkpoint), str(source)])
    before = user_directory(tmp_path / "out")
    (tmp_path / "out" / "config.json").write_text('{"model_type": "llama"}')  # someone else's model
    before = files_of(tmp_path / "out")
    with pytest.raises(SystemExit):
        cli_main(["checkpoint", "convert", str(source), str(tmp_path / "out")])
    assert files_of(tmp_path / "out") == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.slow
def test_hf_export_replaces_its_own_export_and_keeps_other_files(run, tmp_path):
    _, checkpoint = run
    out = tmp_path / "hf"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")  # a tokenizer saved first is kept
    cli_main(["checkpoint", "convert", str(checkpoint), str(out)])
    cli_main(["checkpoint", "convert", str(checkpoint), str(out)])  # our own export: replaced
    assert (out / "tokenizer.json").read_text() == "{}"
    (out / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")  # someone else's weights
    with pytest.raises(SystemExit):
        cli_main(["checkpoint", "convert", str(checkpoint), str(out)])


# ----------------------------------------------------------------------------- 3. a crash between the renames
@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The losses of an uninterrupted 5-step run."""
    return fit(tmp_path_factory.mktemp("straight"), 5)[1]


def crash_between_renames(directory):
    """Leave ``directory`` as a SIGKILL between the two renames of last.ckpt's third save does. (In the
    directory the test resumes in: the checkpoint records its ModelCheckpoint's dirpath.)"""
    directory.mkdir()
    result = subprocess.run([sys.executable, str(WORKERS / "crash_between_renames.py"), str(directory)],
                            env=child_env(PYTHONPATH=f"{WORKERS}:{REPO_ROOT}"), cwd=directory.parent,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert not (directory / "last.ckpt").exists()
    assert json.loads((partial_path(directory / "last.ckpt") / "megatron_3d.json").read_text())["global_step"] == 3
    assert open_sharded(replaced_path(directory / "last.ckpt")).info["global_step"] == 2


@pytest.mark.slow
def test_resume_from_last_after_a_crash_between_the_renames_continues_from_the_newest(straight, tmp_path):
    directory = tmp_path / "ckpts"
    crash_between_renames(directory)
    trainer, losses = fit(tmp_path / "resumed", 5, ckpt_path="last",
                          callbacks=[ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_last=True,
                                                     save_top_k=0)])
    # Resumed at step 3, the save the crash interrupted, not from step 0 (nor 2: those losses differ by > 0.05). The
    # crashed run was another process, whose matmuls may split their work over another number of threads.
    assert losses == pytest.approx(straight[3:], abs=1e-5)
    assert open_sharded(directory / "last.ckpt").info["global_step"] == 5
    assert sorted(p.name for p in directory.iterdir() if not p.name.endswith(".lock")) == ["last.ckpt"]


@pytest.mark.slow
def test_two_ranks_finish_the_interrupted_replacement_once_and_resume_from_it(straight, tmp_path):
    directory = tmp_path / "ckpts"
    crash_between_renames(directory)
    results, _ = run_job("resume_last", 2, tmp_path / "out", str(directory), "5")
    assert [result["resumed_at"] for result in results] == [3, 3]
    for result in results:  # tp=2 now: the same losses to fp32 rounding
        assert result["losses"] == pytest.approx(straight[3:], rel=1e-5)
    assert open_sharded(directory / "last.ckpt").info["global_step"] == 5


# ----------------------------------------------------------------------------- 4. saves that never finished
@pytest.mark.slow
def test_leftovers_are_reported_at_the_next_start_and_only_incomplete_ones_removed(run, tmp_path, capfd):
    _, checkpoint = run
    directory = tmp_path / "ckpts"
    unfinished = partial_path(directory / "epoch=0-step=4.ckpt")
    shutil.copytree(checkpoint, unfinished)
    (unfinished / "megatron_3d.json").unlink()  # written last: without it the save provably did not finish
    size = sum(file.stat().st_size for file in unfinished.iterdir())
    finished = partial_path(directory / "epoch=0-step=2.ckpt")
    shutil.copytree(checkpoint, finished)  # complete, crashed before its rename
    capfd.readouterr()
    fit(tmp_path / "run", 1, callbacks=[ModelCheckpoint(dirpath=directory, save_top_k=0)])
    err = capfd.readouterr().err
    assert f"removed {unfinished} ({size:,} bytes): a save that did not finish" in err
    assert "finished an interrupted save: .epoch=0-step=2.ckpt.partial" in err
    assert not unfinished.exists() and not finished.exists()
    assert open_sharded(directory / "epoch=0-step=2.ckpt").info["global_step"] == 2


@pytest.mark.slow
def test_checkpoint_recover_command_finishes_interrupted_saves(run, tmp_path, capsys):
    _, checkpoint = run
    shutil.copytree(checkpoint, replaced_path(tmp_path / "last.ckpt"))
    cli_main(["checkpoint", "recover", str(tmp_path)])
    assert "restored" in capsys.readouterr().out
    assert open_sharded(tmp_path / "last.ckpt").info["global_step"] == 2


# ----------------------------------------------------------------------------- a full disk
FULL_DISK = textwrap.dedent("""
    import os, shutil, subprocess, sys
    sys.path[:0] = [{workers!r}, {repo!r}]
    from test_checkpoint_files import fit
    from lightning_megatron.checkpoint import open_sharded
    mount = sys.argv[1]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", mount], check=True)
    trainer, _ = fit(mount + "/run", 2)
    trainer.save_checkpoint(mount + "/last.ckpt")
    first = sorted(os.listdir(mount + "/last.ckpt"))
    free = shutil.disk_usage(mount).free
    with open(mount + "/filler", "wb") as filler:
        filler.write(b"x" * (free - 64 * 1024))  # 64 KiB left: less than a checkpoint
    try:
        trainer.save_checkpoint(mount + "/last.ckpt")
    except OSError as error:
        print("ERROR", error)
    assert sorted(os.listdir(mount + "/last.ckpt")) == first
    print("PREVIOUS", open_sharded(mount + "/last.ckpt").info["global_step"])
    print("LEFT", sorted(name for name in os.listdir(mount) if name.startswith(".")))
""")


@pytest.mark.slow
def test_a_full_disk_says_so_with_the_sizes_and_leaves_the_previous_checkpoint(tmp_path):
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK.format(workers=str(WORKERS.parent), repo=str(REPO_ROOT)))
    (tmp_path / "mnt").mkdir()
    # A 2 MiB tmpfs of our own, in a user and mount namespace (no privileges needed).
    result = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", sys.executable, str(script),
                             str(tmp_path / "mnt")], env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    error = next(line for line in result.stdout.splitlines() if line.startswith("ERROR"))
    assert f"No space left on device: {tmp_path / 'mnt'}/last.ckpt, needs " in error
    assert "bytes free on that filesystem" in error and "previous checkpoint" in error
    assert "PREVIOUS 2" in result.stdout
    assert "LEFT []" in result.stdout  # the unfinished directory was removed


# ----------------------------------------------------------------------------- bytes changed in place
def damage(checkpoint, tmp_path, name, pattern):
    """A copy of ``checkpoint`` whose bytes of tensor ``name`` are overwritten in place (file sizes intact)."""
    copy = tmp_path / "damaged.ckpt"
    shutil.copytree(checkpoint, copy)
    saved = open_sharded(copy)
    item = next(item for index, item in saved.index.storage_data.items() if index.fqn == name)
    with open(copy / item.relative_path, "r+b") as file:
        file.seek(item.offset + item.length // 2)
        file.write(pattern)
    return copy


@pytest.mark.slow
def test_a_shard_damaged_in_place_into_nan_is_refused_on_load(run, tmp_path):
    _, checkpoint = run
    copy = damage(checkpoint, tmp_path, "state_dict/model.blocks.0.mlp.fc.weight", b"\xff" * 64)
    assert not torch.isfinite(read_full_tensors(copy)["state_dict/model.blocks.0.mlp.fc.weight"]).all()
    with pytest.raises(RuntimeError, match=r"damaged\.ckpt is unusable: 'state_dict/model\.blocks\.0\.mlp\.fc\.weight' "
                                           r"hold NaN or infinite values.*checkpoint verify"):
        fit(tmp_path / "resume", 3, ckpt_path=copy, verify_checkpoint="off")  # the finite check, without checksums


@pytest.mark.slow
def test_checksums_find_a_changed_byte_that_still_loads_as_finite(run, tmp_path, capsys):
    _, checkpoint = run
    name = "state_dict/model.blocks.1.attn.qkv.weight"
    copy = damage(checkpoint, tmp_path, name, b"\x00")
    assert torch.isfinite(read_full_tensors(copy)[name]).all()
    assert not torch.equal(read_full_tensors(copy)[name], read_full_tensors(checkpoint)[name])
    cli_main(["checkpoint", "verify", str(checkpoint)])
    assert "every crc32 matches" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["checkpoint", "verify", str(copy)])
    assert "__0_0.distcp is damaged: its crc32 is" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match=r"__0_0\.distcp is damaged"):
        fit(tmp_path / "resume", 3, ckpt_path=copy, verify_checkpoint=True)
    trainer, _ = fit(tmp_path / "intact", 3, ckpt_path=checkpoint, verify_checkpoint=True)
    assert trainer.global_step == 3


@pytest.mark.slow
def test_four_kib_of_zeros_in_a_shard_are_refused_by_default_naming_the_file(run, tmp_path):
    """The defaults record checksums and compare them on load: a shard zeroed in its middle (finite numbers still)
    stops the resume before anything is read, naming the file and what to do."""
    _, checkpoint = run
    largest = max(open_sharded(checkpoint).index.storage_data.items(), key=lambda item: item[1].length)[0].fqn
    copy = damage(checkpoint, tmp_path, largest, bytes(4096))
    assert all(torch.isfinite(tensor).all() for tensor in read_full_tensors(copy).values())
    with pytest.raises(RuntimeError, match=r"damaged\.ckpt/__0_0\.distcp is damaged: its crc32 is [0-9a-f]{8}, the "
                                           r"save recorded .*nothing was loaded.*resume from an earlier checkpoint"):
        fit(tmp_path / "resume", 3, ckpt_path=copy)
    trainer, _ = fit(tmp_path / "unchecked", 3, ckpt_path=copy, verify_checkpoint="off")  # what the user may choose
    assert trainer.global_step == 3


@pytest.mark.slow
def test_a_damaged_full_checkpoint_is_refused_by_default(run, tmp_path):
    trainer, _ = run
    trainer.strategy.options = replace(trainer.strategy.options, checkpoint_format="full")
    try:
        trainer.save_checkpoint(tmp_path / "full.ckpt")
    finally:
        trainer.strategy.options = replace(trainer.strategy.options, checkpoint_format="sharded")
    with zipfile.ZipFile(tmp_path / "full.ckpt") as archive:
        largest = max(archive.infolist(), key=lambda info: info.compress_size)
    with open(tmp_path / "full.ckpt", "r+b") as file:  # in the middle of that record's data
        file.seek(largest.header_offset + largest.compress_size // 2)
        file.write(bytes(4096))
    with pytest.raises(RuntimeError, match=rf"full\.ckpt is damaged: the CRC-32 of its record '{largest.filename}'"):
        fit(tmp_path / "resume", 3, ckpt_path=tmp_path / "full.ckpt")


@pytest.mark.slow
def test_a_damaged_shard_stops_every_rank_naming_the_file(tmp_path):
    """Each rank compares its share of the files; the one that finds the damage and the other alike raise, naming
    the file, before any collective reads a tensor."""
    options = {"tp": 2, "steps": 2, "checksums": True}
    run_job("trainer_fit", 2, tmp_path / "first", json.dumps(options))
    checkpoint = tmp_path / "first" / "last.ckpt"
    largest = max((item for item in open_sharded(checkpoint).index.storage_data.values()
                   if item.relative_path == "__1_0.distcp"), key=lambda item: item.length)
    with open(checkpoint / "__1_0.distcp", "r+b") as file:  # rank 1's shard
        file.seek(largest.offset + largest.length // 2)
        file.write(bytes(4096))
    results, _ = run_job("trainer_fit", 2, tmp_path / "resume", json.dumps({**options, "steps": 3,
                                                                              "ckpt_path": str(checkpoint)}))
    assert len(results) == 2
    assert all(f"{checkpoint}/__1_0.distcp is damaged" in result["error"] for result in results), results


@pytest.mark.slow
def test_a_checkpoint_without_checksums_loads_saying_so_once_and_strict_refuses_it(tmp_path, caplog):
    trainer, _ = fit(tmp_path / "old", 2, checkpoint_checksums=False)
    trainer.save_checkpoint(tmp_path / "old.ckpt")
    assert "checksums" not in open_sharded(tmp_path / "old.ckpt").info
    with caplog.at_level(logging.INFO):
        resumed, _ = fit(tmp_path / "resume", 3, ckpt_path=tmp_path / "old.ckpt")
    assert resumed.global_step == 3
    assert caplog.text.count("old.ckpt records no checksums") == 1
    with pytest.raises(RuntimeError, match=r"old\.ckpt records no checksums.*verify_checkpoint='recorded'"):
        fit(tmp_path / "strict", 3, ckpt_path=tmp_path / "old.ckpt", verify_checkpoint="strict")


def test_verify_checkpoint_takes_a_mode_or_a_bool_and_names_the_choices():
    assert [verify_mode(value) for value in ("recorded", "strict", "off", True, False)] == [
        "recorded", "strict", "off", "strict", "off"]
    with pytest.raises(ValueError, match=r"verify_checkpoint='yes' is not one of \('recorded', 'strict', 'off'\)"):
        Megatron3DStrategy(verify_checkpoint="yes")


# ----------------------------------------------------------------------------- 2. never a non-finite checkpoint
@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_format", ["sharded", "full"])
def test_weights_that_went_nan_are_never_saved_and_the_last_good_checkpoint_stays(run, tmp_path, checkpoint_format):
    trainer, checkpoint = run
    target = tmp_path / "last.ckpt"
    trainer.strategy.options = replace(trainer.strategy.options, checkpoint_format=checkpoint_format)
    weight = dict(trainer.lightning_module.named_parameters())["model.blocks.0.attn.proj.weight"]
    good = weight.detach().clone()
    try:
        trainer.save_checkpoint(target)
        before = files_of(target) if target.is_dir() else target.read_bytes()
        with torch.no_grad():
            weight[0, 0] = float("nan")
        with pytest.raises(RuntimeError, match=r"Refusing to save checkpoint .*last\.ckpt: "
                                               r"'.*model\.blocks\.0\.attn\.proj\.weight' hold NaN"):
            trainer.save_checkpoint(target)
    finally:
        trainer.strategy.options = replace(trainer.strategy.options, checkpoint_format="sharded")
        with torch.no_grad():
            weight.copy_(good)
    assert (files_of(target) if target.is_dir() else target.read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
