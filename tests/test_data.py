"""The built-in corpus and the dp-layout invariance of GPTDataModule batches."""

import sysconfig
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from lightning_megatron.data import ByteTokenizer, GPTDataModule, IndexedDataset, stdlib_source_files
from lightning_megatron.data.corpus import load_stdlib_token_documents, stdlib_indexed_corpus


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "naïve café — 日本語 🐍"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids + [tok.eos_id]) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert (tok.eos_id, tok.vocab_size) == (256, 257)


def test_stdlib_corpus_is_deterministic_plain_library_code():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_source_files()
    assert len(files) > 100
    assert files == stdlib_source_files()
    relative = [f.relative_to(root) for f in files]
    assert relative == sorted(relative)
    excluded = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"}
    assert not any(excluded & set(p.parts) for p in relative)
    assert all(f.suffix == ".py" and f.is_file() for f in files)
    assert root / "os.py" in files

    docs = load_stdlib_token_documents(max_files=5)
    assert 0 < len(docs) <= 5
    assert all(d.dtype == np.uint16 and len(d) > 0 for d in docs)
    assert bytes(docs[0].astype(np.uint8)) == files[0].read_bytes()

    # the data module reads it as an indexed dataset written once into the cache: the same documents
    indexed = IndexedDataset(stdlib_indexed_corpus(max_files=5))
    assert [indexed.document(i).tobytes() for i in range(indexed.num_documents)] == [d.tobytes() for d in docs]


def _datamodule(dp_size, dp_rank, **kwargs):
    """A set-up data module that sees the dp size and rank a parallel strategy would report."""
    dm = GPTDataModule(**kwargs)
    strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": dp_size, "rank": dp_rank})
    dm.trainer = SimpleNamespace(strategy=strategy)
    dm.setup("fit")
    return dm


def _rows(batch):
    return [tuple(row) for row in torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1).tolist()]


def _documents(dataset):
    """The stdlib documents whose bytes make up ``dataset``'s samples."""
    corpus = dataset.dataset
    return {corpus.document(int(i)).astype(np.uint8).tobytes() for i in dataset.documents}


@pytest.mark.slow
def test_global_batch_is_the_same_for_every_dp_size():
    config = dict(seq_length=32, global_batch_size=8, max_files=40, split="80,10,10")
    single = _datamodule(1, 0, **config)
    ranks = [_datamodule(2, r, **config) for r in range(2)]
    assert single.per_rank_batch_size == 8 and [dm.per_rank_batch_size for dm in ranks] == [4, 4]
    assert single.vocab_size == 257

    for name in ("train_dataloader", "val_dataloader"):
        single_batches = list(getattr(single, name)())
        rank_batches = [list(getattr(dm, name)()) for dm in ranks]
        assert len(single_batches) >= 3 and all(len(b) == len(single_batches) for b in rank_batches)
        for step in range(3):
            expected = _rows(single_batches[step])
            got = _rows(rank_batches[0][step]) + _rows(rank_batches[1][step])
            assert len(expected) == 8 and sorted(got) == sorted(expected)
    # training is shuffled: the first global batch is not simply the first samples
    first_samples = default_collate([single.train_dataset[i] for i in range(8)])
    assert _rows(next(iter(single.train_dataloader()))) != _rows(first_samples)

    # contiguous document ranges: 80% / 10% / 10% of the documents, disjoint, covering the corpus
    splits = [single.train_dataset.documents, single.val_dataset.documents, single.test_dataset.documents]
    assert [(r.start, r.stop) for r in splits] == [(0, 32), (32, 36), (36, 40)]
    train_docs, val_docs, test_docs = (_documents(d) for d in (single.train_dataset, single.val_dataset,
                                                               single.test_dataset))
    assert not train_docs & val_docs and not train_docs & test_docs and not val_docs & test_docs
    assert train_docs | val_docs | test_docs == {d.astype(np.uint8).tobytes() for d in load_stdlib_token_documents(max_files=40)}
    # every validation sample is made of validation documents only (and their end-of-document ids)
    val_bytes = b"".join(sorted(val_docs))
    for i in range(len(single.val_dataset)):
        window = single.val_dataset.window(i)
        pieces = np.split(window, np.flatnonzero(window == single.tokenizer.eos_id))
        assert all(piece[piece != 256].astype(np.uint8).tobytes() in val_bytes for piece in pieces)


def test_global_batch_not_divisible_by_dp_raises():
    dm = GPTDataModule(global_batch_size=10, max_files=20)
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 4, "rank": 1}))
    with pytest.raises(ValueError, match=r"global_batch_size=10.*4"):
        dm.setup("fit")


def test_without_trainer_data_module_is_single_process():
    dm = GPTDataModule(global_batch_size=4, seq_length=16, max_files=3, split="1,1,1")
    assert (dm.data_parallel_size, dm.data_parallel_rank, dm.per_rank_batch_size) == (1, 0, 4)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 16)
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])


def _tiny_trainer(**kwargs):
    import lightning as L

    from lightning_megatron import Megatron3DStrategy

    return L.Trainer(accelerator="cpu", devices=1, strategy=Megatron3DStrategy(), logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, **kwargs)


def _tiny_gpt():
    from lightning_megatron.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=257, max_seq_length=16, hidden_size=16, num_layers=1, num_heads=2))


def test_overfit_batches_trains_on_the_same_ordered_batches_every_epoch():
    import lightning as L

    seen = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((trainer.current_epoch, _rows(batch)))

    trainer = _tiny_trainer(overfit_batches=2, max_epochs=3, callbacks=[Record()])
    trainer.fit(_tiny_gpt(), datamodule=GPTDataModule(seq_length=16, global_batch_size=4, max_files=6))
    assert [epoch for epoch, _ in seen] == [0, 0, 1, 1, 2, 2]
    assert [rows for _, rows in seen[:2]] == [rows for _, rows in seen[2:4]] == [rows for _, rows in seen[4:]]


def test_validation_split_smaller_than_a_global_batch_is_evaluated_with_a_smaller_batch(tmp_path):
    from lightning_megatron.data.indexed import IndexedDatasetWriter

    with IndexedDatasetWriter(tmp_path / "few", dtype=np.uint16) as writer:
        for i in range(50):
            writer.add_document(np.full(30, i % 250, dtype=np.uint16))
    data = GPTDataModule(data_prefix=str(tmp_path / "few"), tokenizer="byte", seq_length=16, global_batch_size=8,
                         split="96,4,0")
    trainer = _tiny_trainer(max_steps=2, val_check_interval=2)
    with pytest.warns(UserWarning, match=r"validation split has 4 samples, fewer than one global batch \(8\); its "
                                         r"loader uses batches of 4"):
        trainer.fit(_tiny_gpt(), datamodule=data)
    assert "val_loss" in trainer.callback_metrics, "validation ran (and ModelCheckpoint/EarlyStopping can use it)"
