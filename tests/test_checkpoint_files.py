"""Sharded checkpoints in one process: exact resume, atomic saves, damaged files, the checkpoint command."""

import shutil
import signal
import subprocess
import sys
import threading

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

from launch import WORKERS, child_env
from workers.trainer_setup import datamodule, model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.checkpoint import consolidated_state_dict, open_sharded, sharded
from lightning_megatron.cli import main as cli_main
from lightning_megatron.data import BERTDataModule
from lightning_megatron.models import BERT, GPT, BERTConfig, GPTConfig


class RecordLosses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def fit(root, steps, *, ckpt_path=None, precision="32-true", options=None, save_every=None, module=None,
        callbacks=(), **strategy_kwargs):
    L.seed_everything(7)
    record = RecordLosses()
    callbacks = [record, *callbacks]
    if save_every:
        callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=save_every, save_top_k=-1))
    checkpointing = bool(save_every) or any(isinstance(c, ModelCheckpoint) for c in callbacks)
    kwargs = {**trainer_kwargs({"steps": steps}), "enable_checkpointing": checkpointing, "limit_val_batches": 0}
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=Megatron3DStrategy(**strategy_kwargs), precision=precision,
                        callbacks=callbacks, default_root_dir=root, **kwargs)
    trainer.fit(module or model(options or {}), datamodule=datamodule({}), ckpt_path=ckpt_path)
    return trainer, record.losses


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 2-step fp32 run's sharded checkpoint."""
    root = tmp_path_factory.mktemp("run")
    trainer, _ = fit(root, 2)
    trainer.save_checkpoint(root / "two.ckpt")
    return root / "two.ckpt"


@pytest.mark.slow
def test_bf16_run_resumes_exactly_with_its_fp32_main_parameters(tmp_path):
    """bf16 parameters with fp32 main copies: the copies are saved, so steps 3-4 repeat bit for bit."""
    straight, straight_losses = fit(tmp_path / "straight", 4, precision="bf16-true", save_every=2)
    saved = open_sharded(tmp_path / "straight" / "epoch=0-step=2.ckpt")
    assert any(name.startswith("main_params/") for name in saved.tensors())
    resumed, resumed_losses = fit(tmp_path / "resumed", 4, precision="bf16-true",
                                  ckpt_path=tmp_path / "straight" / "epoch=0-step=2.ckpt")
    assert resumed_losses == straight_losses[2:]
    for (_, a), (_, b) in zip(straight.strategy.driver.main_params.pieces, resumed.strategy.driver.main_params.pieces):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    for name, value in straight.lightning_module.state_dict().items():
        assert torch.equal(value, resumed.lightning_module.state_dict()[name]), name


@pytest.mark.slow
def test_full_format_writes_one_plain_file_that_resumes_exactly(tmp_path):
    _, straight = fit(tmp_path / "straight", 4, save_every=2, checkpoint_format="full")
    file = tmp_path / "straight" / "epoch=0-step=2.ckpt"
    assert file.is_file()
    checkpoint = torch.load(file, weights_only=True)
    assert checkpoint["state_dict"]["model.embedding.wte.weight"].shape == (257, 32)  # global, unpadded
    assert not list((tmp_path / "straight").glob(".*.partial"))  # written aside, then renamed into place
    _, resumed = fit(tmp_path / "resumed", 4, ckpt_path=file)  # a sharded-format run reads it too
    assert resumed == straight[2:]


@pytest.mark.slow
def test_top_k_removal_and_resume_from_last(tmp_path):
    keep_one = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=1, monitor="step", mode="max",
                               save_last=True)
    fit(tmp_path, 6, callbacks=[keep_one])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".ckpt")) == ["epoch=0-step=6.ckpt", "last.ckpt"]
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=Megatron3DStrategy(), default_root_dir=tmp_path,
                        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)],
                        **{**trainer_kwargs({"steps": 7}), "enable_checkpointing": True, "limit_val_batches": 0})
    trainer.fit(model({}), datamodule=datamodule({}), ckpt_path="last")
    assert trainer.global_step == 7


@pytest.mark.slow
def test_dropout_streams_continue_exactly_after_a_resume(tmp_path):
    """Random states are saved per rank and restored just before the first step: the masks repeat."""
    def with_dropout():
        config = GPTConfig(vocab_size=257, max_seq_length=32, hidden_size=32, num_layers=2, num_heads=4,
                           dropout=0.1, attention_dropout=0.1)
        return GPT(config, learning_rate=3e-3, warmup_steps=2, adam_eps=1e-6)

    _, straight = fit(tmp_path / "straight", 4, save_every=2, module=with_dropout())
    _, resumed = fit(tmp_path / "resumed", 4, ckpt_path=tmp_path / "straight" / "epoch=0-step=2.ckpt",
                     module=with_dropout())
    assert resumed == straight[2:]


@pytest.mark.slow
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    result = subprocess.run([sys.executable, str(WORKERS / "save_then_crash.py"), str(tmp_path / "ckpts")],
                            env=child_env(PYTHONPATH=f"{WORKERS}:{WORKERS.parent.parent}"), cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    directory = tmp_path / "ckpts"
    assert (directory / ".epoch=0-step=4.ckpt.partial").is_dir()  # the unfinished save, under a name nobody loads
    assert not (directory / "epoch=0-step=4.ckpt").exists()
    assert open_sharded(directory / "last.ckpt").info["global_step"] == 2
    trainer, losses = fit(tmp_path / "resume", 3, ckpt_path=directory / "last.ckpt")
    assert trainer.global_step == 3 and len(losses) == 1
    # Saving under the unfinished name again replaces the left-over.
    trainer.save_checkpoint(directory / "epoch=0-step=4.ckpt")
    assert not (directory / ".epoch=0-step=4.ckpt.partial").exists()
    assert open_sharded(directory / "epoch=0-step=4.ckpt").info["global_step"] == 3


@pytest.mark.slow
def test_async_checkpoints_are_written_while_training_goes_on(tmp_path, monkeypatch):
    release, seen = threading.Event(), {}
    write_tensors = sharded.write_tensors

    def write_when_released(*args, **kwargs):
        assert release.wait(timeout=120)
        write_tensors(*args, **kwargs)

    class LookWhileTheSaveIsInFlight(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 3:  # the save after step 2 is still blocked in its thread
                seen["partial"] = (tmp_path / "async" / ".epoch=0-step=2.ckpt.partial").is_dir()
                seen["complete"] = (tmp_path / "async" / "epoch=0-step=2.ckpt").exists()
                release.set()

    monkeypatch.setattr(sharded, "write_tensors", write_when_released)
    _, losses = fit(tmp_path / "async", 4, save_every=2, async_checkpoint=True,
                    callbacks=[LookWhileTheSaveIsInFlight()])
    assert seen == {"partial": True, "complete": False}
    monkeypatch.setattr(sharded, "write_tensors", write_tensors)
    assert open_sharded(tmp_path / "async" / "epoch=0-step=4.ckpt").info["global_step"] == 4  # complete at teardown
    _, resumed = fit(tmp_path / "resumed", 4, ckpt_path=tmp_path / "async" / "epoch=0-step=2.ckpt")
    assert resumed == losses[2:]


def damaged_copy(checkpoint, tmp_path, damage):
    copy = tmp_path / "damaged.ckpt"
    shutil.copytree(checkpoint, copy)
    damage(copy)
    return copy


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.slow
@pytest.mark.parametrize("damage, message", [
    (lambda c: (c / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
    (lambda c: truncate(c / "__0_0.distcp"), "__0_0.distcp is truncated"),
    (lambda c: (c / ".metadata").unlink(), "incomplete: .metadata is missing"),
    (lambda c: (c / "megatron_3d.json").write_text("{"), "megatron_3d.json is not valid JSON"),
    (lambda c: (c / "megatron_3d.json").write_text('{"format": "other"}'), "not a lightning-megatron sharded"),
    (lambda c: truncate(c / "trainer_state.pt"), "trainer_state.pt"),
], ids=["missing-shard", "truncated-shard", "no-index", "bad-json", "wrong-format", "truncated-trainer-state"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(checkpoint, tmp_path, damage, message):
    damaged = damaged_copy(checkpoint, tmp_path, damage)
    before = {p.name: p.stat().st_size for p in damaged.iterdir()}
    with pytest.raises((RuntimeError, FileNotFoundError), match=message):
        fit(tmp_path / "run", 3, ckpt_path=damaged)
    assert {p.name: p.stat().st_size for p in damaged.iterdir()} == before  # nothing on disk was touched


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_refused(checkpoint, tmp_path):
    with pytest.raises(RuntimeError, match=r"'state_dict/model\.embedding\.wte\.weight' has shape \(257, 32\) but "
                                           r"this model's is \(257, 64\)"):
        fit(tmp_path / "wider", 3, ckpt_path=checkpoint, options={"hidden": 64})
    bert = BERT(BERTConfig(vocab_size=261, max_seq_length=32, hidden_size=32, num_layers=2, num_heads=4))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=Megatron3DStrategy(), logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1)
    with pytest.raises(RuntimeError, match=r"has no model tensor 'state_dict/model\.embeddings.*lightning_megatron\.models\.gpt\.GPT"):
        trainer.validate(bert, datamodule=BERTDataModule(seq_length=32, global_batch_size=4), ckpt_path=checkpoint)


@pytest.mark.slow
def test_a_checkpoint_of_a_deeper_model_is_refused_unless_loading_is_not_strict(checkpoint, tmp_path):
    with pytest.raises(RuntimeError, match=r"holds model tensors this model does not have: "
                                           r"'state_dict/model\.blocks\.1\..*strict_loading = False"):
        fit(tmp_path / "shallower", 3, ckpt_path=checkpoint, options={"layers": 1})
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=Megatron3DStrategy(), logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1)
    deeper = model({"layers": 3})
    deeper.strict_loading = False  # take the two saved layers, keep the third as initialised
    trainer.validate(deeper, datamodule=datamodule({}), ckpt_path=checkpoint)
    saved, loaded = consolidated_state_dict(checkpoint), trainer.strategy.full_state_dict()
    assert all(torch.equal(loaded[name], value) for name, value in saved.items())
    assert "model.blocks.2.attn.qkv.weight" in loaded and "model.blocks.2.attn.qkv.weight" not in saved


@pytest.mark.slow
def test_an_interrupted_replace_without_its_new_checkpoint_gives_the_previous_one_its_name_back(checkpoint, tmp_path):
    # The old checkpoint moved aside, the new one gone (damaged, deleted): the old one is restored and resumed.
    shutil.copytree(checkpoint, tmp_path / ".last.ckpt.replaced")
    trainer, losses = fit(tmp_path / "run", 3, ckpt_path=tmp_path / "last.ckpt")
    assert trainer.global_step == 3 and len(losses) == 1
    assert open_sharded(tmp_path / "last.ckpt").info["global_step"] == 2
    assert not (tmp_path / ".last.ckpt.replaced").exists()


@pytest.mark.slow
def test_checkpoint_command_inspects_and_consolidates(checkpoint, tmp_path, capsys):
    cli_main(["checkpoint", "inspect", str(checkpoint), "--keys"])
    shown = capsys.readouterr().out
    assert "global_step=2" in shown and "tensor_parallel_size=1" in shown
    assert "model.embedding.wte.weight  (257, 32)  float32" in shown and "/exp_avg_sq" in shown
    cli_main(["checkpoint", "consolidate", str(checkpoint), str(tmp_path / "model.safetensors")])
    consolidated = load_file(tmp_path / "model.safetensors")
    assert consolidated.keys() == consolidated_state_dict(checkpoint).keys()
    gpt = model({})
    gpt.configure_model()
    gpt.load_state_dict(consolidated)  # a plain single-process model takes it as it is
    with pytest.raises(SystemExit):
        cli_main(["checkpoint", "consolidate", str(checkpoint), str(tmp_path / "model.bin")])
    assert "must end in .safetensors or .pt" in capsys.readouterr().err


@pytest.mark.slow
def test_load_from_checkpoint_reads_a_sharded_directory(checkpoint):
    loaded = GPT.load_from_checkpoint(checkpoint, learning_rate=1e-4)
    assert loaded.hparams.learning_rate == 1e-4 and loaded.config.hidden_size == 32  # saved config, new recipe
    for name, value in consolidated_state_dict(checkpoint).items():
        assert torch.equal(loaded.state_dict()[name], value), name


@pytest.mark.slow
def test_checkpoint_command_converts_to_and_from_hugging_face(checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers")
    cli_main(["checkpoint", "convert", str(checkpoint), str(tmp_path / "hf")])
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ours = consolidated_state_dict(checkpoint)
    gpt = model({})
    gpt.configure_model()
    gpt.load_state_dict(ours)
    tokens = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        assert (gpt.model(tokens) - hf(tokens).logits).abs().max() < 1e-4
    cli_main(["checkpoint", "convert", str(tmp_path / "hf"), str(tmp_path / "back.ckpt")])
    back = consolidated_state_dict(tmp_path / "back.ckpt")
    for name, value in ours.items():
        assert torch.equal(back[name], value), name
    # The converted checkpoint evaluates like the original.
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=Megatron3DStrategy(), logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2)
    from_converted = trainer.validate(model({}), datamodule=datamodule({}), ckpt_path=tmp_path / "back.ckpt")
    from_original = trainer.validate(model({}), datamodule=datamodule({}), ckpt_path=checkpoint)
    assert from_converted == from_original


@pytest.mark.slow
def test_checkpoint_command_converts_a_post_norm_bert_and_back(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = BERTConfig(vocab_size=261, max_seq_length=32, hidden_size=32, num_layers=2, num_heads=4,
                        norm_position="post")
    bert = BERT(config)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=Megatron3DStrategy(), max_steps=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        limit_val_batches=0)
    trainer.fit(bert, datamodule=BERTDataModule(seq_length=32, global_batch_size=4))
    trainer.save_checkpoint(tmp_path / "bert.ckpt")
    cli_main(["checkpoint", "convert", str(tmp_path / "bert.ckpt"), str(tmp_path / "hf")])
    hf = transformers.BertForPreTraining.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(5, 261, (2, 16))
    with torch.no_grad():
        ours = bert.model(tokens)
        theirs = hf(tokens)
    assert (ours[0][..., :261] - theirs.prediction_logits).abs().max() < 1e-4  # ours: vocab padded to 384
    cli_main(["checkpoint", "convert", str(tmp_path / "hf"), str(tmp_path / "back.ckpt")])
    back, saved = consolidated_state_dict(tmp_path / "back.ckpt"), consolidated_state_dict(tmp_path / "bert.ckpt")
    assert all(torch.equal(back[name], value) for name, value in saved.items())



@pytest.mark.slow
def test_generate_command_continues_prompts_from_a_sharded_checkpoint(checkpoint, capsys):
    from lightning_megatron.data.tokenizers import load_tokenizer
    from lightning_megatron.commands.generate import main as generate_main

    generate_main(["--checkpoint", str(checkpoint), "--prompt", "def f(x):", "--prompt", "import",
                   "--max-new-tokens", "12", "--temperature", "0.8", "--seed", "3", "--no-eos"])
    printed = capsys.readouterr()
    byte = load_tokenizer("byte")
    gpt = GPT.load_from_checkpoint(checkpoint)
    expected = gpt.generate([byte.encode("def f(x):"), byte.encode("import")], max_new_tokens=12, temperature=0.8, seed=3)
    assert printed.out.split("-" * 40 + "\n")[:2] == [byte.decode(tokens) + "\n" for tokens in expected]
    assert "24 new tokens in" in printed.err
