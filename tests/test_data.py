"""The built-in corpus, sample packing, and the dp-layout invariance of GPTDataModule batches."""

import sysconfig
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from lightning_megatron.data import ByteTokenizer, GPTDataModule, PackedTokenDataset, stdlib_source_files
from lightning_megatron.data.corpus import load_stdlib_token_documents


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "naïve café — 日本語 🐍"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids + [tok.eos_id]) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert (tok.eos_id, tok.vocab_size) == (256, 257)


def test_packed_dataset_exact_samples():
    docs = [np.array([1, 2, 3], dtype=np.uint16), np.array([4, 5], dtype=np.uint16), np.array([6], dtype=np.uint16)]
    ds = PackedTokenDataset(docs, eos_id=9, seq_length=3)
    # stream: 1 2 3 9 | 4 5 9 6 | 9  -> two windows of 4 tokens, the last token dropped
    assert ds.tokens.tolist() == [1, 2, 3, 9, 4, 5, 9, 6, 9]
    assert len(ds) == 2
    assert ds[0]["input_ids"].tolist() == [1, 2, 3] and ds[0]["labels"].tolist() == [2, 3, 9]
    assert ds[1]["input_ids"].tolist() == [4, 5, 9] and ds[1]["labels"].tolist() == [5, 9, 6]
    assert ds[1]["input_ids"].dtype == torch.long and ds[1]["labels"].dtype == torch.long
    with pytest.raises(IndexError):
        ds[2]


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


def _datamodule(dp_size, dp_rank, **kwargs):
    """A set-up data module that sees the dp size and rank a parallel strategy would report."""
    dm = GPTDataModule(**kwargs)
    strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": dp_size, "rank": dp_rank})
    dm.trainer = SimpleNamespace(strategy=strategy)
    dm.setup("fit")
    return dm


def _rows(batch):
    return [tuple(row) for row in torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1).tolist()]


def _documents(dataset, eos_id):
    """The documents packed into ``dataset``, as bytes, each with its trailing eos removed."""
    ends = np.flatnonzero(dataset.tokens == eos_id)
    return [doc[:-1].tobytes() for doc in np.split(dataset.tokens, ends + 1)[:-1]]


def test_global_batch_is_the_same_for_every_dp_size():
    config = dict(seq_length=32, global_batch_size=8, max_files=20, val_fraction=0.1)
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

    eos = single.tokenizer.eos_id
    train_docs, val_docs = _documents(single.train_dataset, eos), _documents(single.val_dataset, eos)
    test_docs = _documents(single.test_dataset, eos)
    all_docs = [d.tobytes() for d in load_stdlib_token_documents(max_files=20)]
    assert len(val_docs) == len(test_docs) == 2
    assert not set(train_docs) & set(val_docs) and not set(train_docs) & set(test_docs)
    assert not set(val_docs) & set(test_docs)
    assert sorted(train_docs + val_docs + test_docs) == sorted(all_docs)


def test_global_batch_not_divisible_by_dp_raises():
    dm = GPTDataModule(global_batch_size=10, max_files=20)
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 4, "rank": 1}))
    with pytest.raises(ValueError, match=r"global_batch_size=10.*4"):
        dm.setup("fit")


def test_without_trainer_data_module_is_single_process():
    dm = GPTDataModule(global_batch_size=4, seq_length=16, max_files=3, val_fraction=0.3)
    assert (dm.data_parallel_size, dm.data_parallel_rank, dm.per_rank_batch_size) == (1, 0, 4)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 16)
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
