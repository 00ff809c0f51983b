"""Preprocess a corpus, train, stop mid-epoch, resume: the same samples and the same losses as one straight run."""

import json
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
import pytest

from lightning_megatron import Megatron3DStrategy
from lightning_megatron.cli import main as cli_main
from lightning_megatron.data import GPTDataModule, stdlib_source_files
from lightning_megatron.models import GPT, GPTConfig

STEPS, STOP_AT = 6, 3


class RecordBatches(L.Callback):
    def __init__(self):
        self.losses, self.samples = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.samples.append([hash(tuple(row.tolist())) for row in batch["input_ids"]])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small jsonl from stdlib files, preprocessed with the byte tokenizer."""
    root = tmp_path_factory.mktemp("corpus")
    with open(root / "corpus.jsonl", "w") as out:
        for path in stdlib_source_files(max_files=12):
            out.write(json.dumps({"text": path.read_text(encoding="utf-8", errors="replace")}) + "\n")
    cli_main(["preprocess", "--input", str(root / "corpus.jsonl"), "--tokenizer", "byte",
              "--output-prefix", str(root / "corpus"), "--workers", "1"])
    return root / "corpus"


def fit(prefix, root_dir, max_steps, ckpt_path=None):
    """Checkpoints every STOP_AT steps, mid-epoch, as a long run does."""
    L.seed_everything(11)
    record = RecordBatches()
    checkpoints = ModelCheckpoint(dirpath=root_dir, every_n_train_steps=STOP_AT, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=Megatron3DStrategy(), max_steps=max_steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[record, checkpoints], default_root_dir=root_dir,
    )
    model = GPT(GPTConfig(max_seq_length=32, hidden_size=32, num_layers=2), learning_rate=3e-3, warmup_steps=2)
    data = GPTDataModule(seq_length=32, global_batch_size=4, data_prefix=str(prefix), seed=5)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return trainer, record


@pytest.mark.slow
def test_resume_mid_epoch_repeats_and_skips_nothing(corpus, tmp_path):
    _, straight = fit(corpus, tmp_path / "straight", STEPS)
    mid_epoch = tmp_path / "straight" / f"epoch=0-step={STOP_AT}.ckpt"
    assert mid_epoch.exists(), sorted(p.name for p in (tmp_path / "straight").iterdir())
    resumed, after = fit(corpus, tmp_path / "resumed", STEPS, ckpt_path=str(mid_epoch))
    assert resumed.global_step == STEPS
    assert after.samples == straight.samples[STOP_AT:], "the resumed run must see exactly the samples still due"
    assert after.losses == pytest.approx(straight.losses[STOP_AT:], abs=1e-6), "same weights and optimizer state"
    assert len({s for batch in straight.samples for s in batch}) == STEPS * 4
