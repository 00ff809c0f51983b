"""The memory-mapped GPT dataset: exact packing, per-epoch orders, the cache, splits, blends and document masks."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_megatron.data import BlendedDataset, DocumentMasks, GPTDataModule, GPTDataset, IndexedDataset
from lightning_megatron.data.blend import blend_index, parse_data_prefix
from lightning_megatron.data.gpt_dataset import document_masked_sample
from lightning_megatron.data.indexed import IndexedDatasetWriter
from lightning_megatron.data.preprocess import metadata_file
from lightning_megatron.data.splits import parse_split, split_document_ranges
from lightning_megatron.models import GPTConfig
from lightning_megatron.models.gpt import GPTModel

EOS = 0


def _write(prefix, documents, *, vocab_size=100):
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        for document in documents:
            writer.add_document(document)
    metadata_file(prefix).write_text(json.dumps({"tokenizer": "byte", "vocab_size": 257, "eos_id": 256}))
    return IndexedDataset(prefix)


@pytest.fixture
def corpus(tmp_path):
    """50 documents of 0-39 tokens; every third one already ends with the end-of-document id, some are empty."""
    rng = np.random.default_rng(0)
    documents = []
    for i in range(50):
        document = rng.integers(1, 100, int(rng.integers(0, 40)))
        if i % 3 == 0 and len(document):
            document[-1] = EOS
        documents.append(document)
    return _write(tmp_path / "corpus", documents), documents


def _stream(documents, doc_range, dataset, seed):
    """The token stream the dataset must cut its samples from, written out independently: each epoch the split's
    non-empty documents in a seeded order, each ending with exactly one eos."""
    split = [documents[i] for i in doc_range if len(documents[i])]
    with_eos = [d if d[-1] == EOS else np.append(d, EOS) for d in split]
    order = [np.random.default_rng([seed, epoch, 0]).permutation(len(split)) for epoch in range(dataset.epochs + 1)]
    return np.concatenate([with_eos[i] for epoch in order for i in epoch])


def test_samples_are_windows_of_the_shuffled_document_stream(corpus, tmp_path):
    indexed, documents = corpus
    seq = 16
    dataset = GPTDataset(indexed, range(5, 45), seq_length=seq, num_samples=200, seed=3, eos_id=EOS,
                         cache_dir=tmp_path / "cache")
    assert len(dataset) == 200 and dataset.epochs > 2 and dataset.cache.built_here
    stream = _stream(documents, range(5, 45), dataset, seed=3)
    starts = [int(dataset._shuffle[i]) * seq for i in range(len(dataset))]
    for i, start in enumerate(starts):
        sample = dataset[i]
        assert torch.equal(sample["input_ids"], torch.from_numpy(stream[start : start + seq].astype(np.int64)))
        assert torch.equal(sample["labels"], torch.from_numpy(stream[start + 1 : start + seq + 1].astype(np.int64)))
    assert len(set(starts)) == len(starts), "no sample twice"
    # every epoch has its own document order, and samples are shuffled within each epoch's block
    epoch_tokens = dataset.tokens_per_epoch
    first_epoch = [s for s in starts if s < epoch_tokens]
    assert first_epoch != sorted(first_epoch)
    assert sorted(s // epoch_tokens for s in starts) == [s // epoch_tokens for s in sorted(starts)]
    assert not np.array_equal(stream[:epoch_tokens], stream[epoch_tokens : 2 * epoch_tokens])


def test_a_longer_run_sees_the_same_samples_first_and_one_epoch_without_num_samples(corpus, tmp_path):
    indexed, _ = corpus
    kwargs = dict(seq_length=16, seed=3, eos_id=EOS, cache_dir=tmp_path / "cache")
    short = GPTDataset(indexed, range(0, 50), num_samples=150, **kwargs)
    long = GPTDataset(indexed, range(0, 50), num_samples=700, **kwargs)
    assert long.epochs > short.epochs
    assert all(np.array_equal(short.window(i), long.window(i)) for i in range(len(short)))
    one_epoch = GPTDataset(indexed, range(0, 50), num_samples=None, **kwargs)
    assert one_epoch.epochs == 1 and len(one_epoch) == -(-one_epoch.tokens_per_epoch // 16)
    assert not one_epoch.shuffles_samples and short.shuffles_samples
    with pytest.raises(IndexError, match="out of range"):
        one_epoch[len(one_epoch)]


def test_index_is_cached_and_a_damaged_or_stale_cache_is_rebuilt(corpus, tmp_path, capsys):
    indexed, _ = corpus
    kwargs = dict(seq_length=16, num_samples=120, seed=3, eos_id=EOS, cache_dir=tmp_path / "cache")
    first = GPTDataset(indexed, range(0, 40), **kwargs)
    again = GPTDataset(indexed, range(0, 40), **kwargs)
    assert first.cache.built_here and not again.cache.built_here and again.cache.directory == first.cache.directory
    samples = [first.window(i) for i in range(len(first))]

    shuffle = first.cache.directory / "shuffle.npy"
    data = bytearray(shuffle.read_bytes())
    data[-3] ^= 0xFF  # a flipped byte in the array, same size: only the checksum can tell
    shuffle.write_bytes(bytes(data))
    repaired = GPTDataset(indexed, range(0, 40), **kwargs)
    assert repaired.cache.built_here and "shuffle.npy fails its checksum); rebuilding it" in capsys.readouterr().err
    assert all(np.array_equal(repaired.window(i), s) for i, s in enumerate(samples))

    (first.cache.directory / "sample_offset.npy").write_bytes(b"")  # truncated
    assert GPTDataset(indexed, range(0, 40), **kwargs).cache.built_here
    manifest = first.cache.directory / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"seed": 3', '"seed": 4'))  # an entry for other settings
    assert GPTDataset(indexed, range(0, 40), **kwargs).cache.built_here
    # any change of what the index depends on selects another entry
    other = {GPTDataset(indexed, range(0, 40), **{**kwargs, **change}).cache.directory
             for change in ({"seed": 4}, {"seq_length": 8}, {"num_samples": 2000})}
    assert first.cache.directory not in other and len(other) == 3
    assert GPTDataset(indexed, range(0, 39), **kwargs).cache.directory != first.cache.directory


def test_megatron_split_string_gives_disjoint_contiguous_document_ranges():
    assert parse_split("969,30,1") == pytest.approx((0.969, 0.030, 0.001))
    assert parse_split("98,2") == pytest.approx((0.98, 0.02, 0.0))
    ranges = split_document_ranges("969,30,1", 1000)
    assert [(r.start, r.stop) for r in ranges.values()] == [(0, 969), (969, 999), (999, 1000)]
    ranges = split_document_ranges("969,30,1", 50065)  # Megatron-Core's own ranges for this corpus size
    assert [(r.start, r.stop) for r in ranges.values()] == [(0, 48513), (48513, 50015), (50015, 50065)]
    assert [len(r) for r in split_document_ranges("1,1,1", 10).values()] == [3, 4, 3]
    for bad in ("a,b", "0,1,0", "1,-1", "1,2,3,4"):
        with pytest.raises(ValueError, match="split="):
            parse_split(bad)


def test_blend_keeps_every_share_within_one_sample_and_reads_each_dataset_in_its_own_order(tmp_path):
    weights = [0.2, 0.3, 0.5]
    dataset, sample = blend_index(weights, 1000)
    counts = np.zeros(3)
    for n, d in enumerate(dataset, start=1):
        counts[d] += 1
        assert np.all(np.abs(counts - np.array(weights) * n) <= 1.0), (n, counts)
    assert np.all(np.abs(counts / 1000 - weights) <= 1 / 1000)
    for d in range(3):  # the k-th sample taken from a dataset is its k-th sample
        assert sample[dataset == d].tolist() == list(range(int(counts[d])))

    rng = np.random.default_rng(1)
    corpora = [_write(tmp_path / name, [rng.integers(1, 100, 30) for _ in range(40)]) for name in "abc"]
    parts = [GPTDataset(c, range(0, 40), seq_length=8, num_samples=int(counts[d]), seed=d, eos_id=EOS,
                        cache_dir=tmp_path / "cache") for d, c in enumerate(corpora)]
    blend = BlendedDataset(parts, ["a", "b", "c"], dataset, sample)
    for i in (0, 1, 2, 500, 999):
        d = int(dataset[i])
        assert torch.equal(blend[i]["input_ids"], parts[d][int(sample[i])]["input_ids"])
    assert blend.sample_counts(1000) == {"a": 200, "b": 300, "c": 500}
    assert sum(blend.sample_counts(10).values()) == 10


def test_data_prefix_blend_forms_and_errors(tmp_path):
    assert parse_data_prefix("data/a") == (["data/a"], [1.0])
    assert parse_data_prefix([0.3, "data/a", 0.7, "data/b"]) == (["data/a", "data/b"], [0.3, 0.7])
    assert parse_data_prefix("0.3 data/a 0.7 data/b") == (["data/a", "data/b"], [0.3, 0.7])
    assert parse_data_prefix(["1", "data/a", "2", "data/b"]) == (["data/a", "data/b"], [1.0, 2.0])
    with pytest.raises(ValueError, match="pairs of weight and path"):
        parse_data_prefix([0.3, "data/a", 0.7])
    with pytest.raises(ValueError, match="stands where a weight belongs"):
        parse_data_prefix(["data/a", 0.3, "data/b", 0.7])
    with pytest.raises(ValueError, match="must be positive"):
        parse_data_prefix([0.0, "data/a", 1.0, "data/b"])
    with pytest.raises(ValueError, match="more than once"):
        parse_data_prefix([0.5, "data/a", 0.5, "data/a"])


def test_blended_data_module_trains_on_shares_and_counts_consumed_tokens(tmp_path):
    rng = np.random.default_rng(2)
    for name in ("code", "prose"):
        _write(tmp_path / name, [rng.integers(0, 256, int(rng.integers(20, 200))) for _ in range(60)])
    dm = GPTDataModule(data_prefix=[0.25, str(tmp_path / "code"), 0.75, str(tmp_path / "prose")], seq_length=16,
                       global_batch_size=8, split="90,10,0")
    dm.trainer = type("T", (), {"max_steps": 50, "accumulate_grad_batches": 1})()
    dm.setup("fit")
    assert isinstance(dm.train_dataset, BlendedDataset) and len(dm.train_dataset) == 400
    assert dm.train_dataset.totals == {str(tmp_path / "code"): 100, str(tmp_path / "prose"): 300}
    assert dm.test_dataloader() == [], "a split weighted 0 has no loader"
    assert isinstance(dm.val_dataset, BlendedDataset) and len(dm.val_dataset) > 0
    assert next(iter(dm.train_dataloader()))["input_ids"].shape == (8, 16)


@pytest.mark.slow
def test_document_masks_make_a_packed_sample_equal_to_its_documents_alone(tmp_path):
    window = np.array([5, 6, 7, EOS, 8, 9, EOS, EOS, 3, 4, 2])
    sample = document_masked_sample(window, EOS, DocumentMasks(True, True, True))
    assert sample["input_ids"].tolist() == [5, 6, 7, EOS, 8, 9, EOS, EOS, 3, 4]
    assert sample["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 0, 1]
    assert sample["document_ids"].tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 3, 3]
    assert sample["labels"].tolist() == [6, 7, EOS, -100, 9, EOS, -100, -100, 4, 2]
    assert set(document_masked_sample(window, EOS, DocumentMasks())) == {"input_ids", "labels"}

    # the model then computes each document as if it were alone (learned and rotary positions)
    for preset in ("gpt-tiny", "llama-tiny"):
        torch.manual_seed(0)
        model = GPTModel(GPTConfig.from_name(preset, max_seq_length=32)).eval()
        first, second = torch.randint(1, 200, (1, 9)), torch.randint(1, 200, (1, 13))
        packed = torch.cat([first, second], dim=1)
        logits = model(packed, position_ids=torch.tensor([list(range(9)) + list(range(13))]),
                       document_ids=torch.tensor([[0] * 9 + [1] * 13]))
        torch.testing.assert_close(logits[:, :9], model(first), atol=1e-5, rtol=0)
        torch.testing.assert_close(logits[:, 9:], model(second), atol=1e-5, rtol=0)
        assert (logits[:, 9:] - model(packed)[:, 9:]).abs().max() > 1e-3, "without the masks it attends across"


def _rank_module(prefix, dp, rank, max_steps, tmp_path):
    dm = GPTDataModule(data_prefix=prefix, seq_length=16, global_batch_size=8, seed=9, split="95,5,0",
                       index_cache_dir=str(tmp_path / "cache"))
    dm.trainer = SimpleNamespace(max_steps=max_steps, accumulate_grad_batches=1, world_size=1,
                                 strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": dp, "rank": rank}))
    dm.setup("fit")
    return dm


def test_blend_gives_the_same_global_batches_at_dp_1_2_4_and_after_a_resume(tmp_path):
    rng = np.random.default_rng(3)
    for name in ("a", "b"):
        _write(tmp_path / name, [rng.integers(0, 256, int(rng.integers(20, 300))) for _ in range(80)])
    prefix = [0.4, str(tmp_path / "a"), 0.6, str(tmp_path / "b")]
    steps = 12

    def global_batches(dp, resume_at=None):
        batches = [[] for _ in range(steps)]
        for rank in range(dp):
            loader = _rank_module(prefix, dp, rank, steps, tmp_path).train_dataloader()
            if resume_at is not None:  # what Lightning hands back from a checkpoint taken at step resume_at
                loader.load_state_dict({"epoch": 0, "consumed_batches": resume_at})
            for step, batch in enumerate(loader, start=resume_at or 0):
                batches[step] += [tuple(row.tolist()) for row in batch["input_ids"]]
        return [sorted(batch) for batch in batches]

    single = global_batches(1)
    assert len(single) == steps and all(len(batch) == 8 for batch in single)
    assert global_batches(2) == single and global_batches(4) == single
    assert global_batches(4, resume_at=5)[5:] == single[5:] and global_batches(2, resume_at=7)[7:] == single[7:]
    assert len({row for batch in single for row in batch}) == steps * 8


def test_an_unwritable_cache_directory_says_which_setting_to_change(corpus, tmp_path):
    indexed, _ = corpus
    (tmp_path / "not-a-directory").write_text("a file where the cache would go")
    with pytest.raises(OSError, match=r"Cannot write the GPT documents index to .*not-a-directory.*index_cache_dir="):
        GPTDataset(indexed, range(0, 40), seq_length=16, num_samples=10, seed=0, eos_id=EOS,
                   cache_dir=tmp_path / "not-a-directory")
    assert (tmp_path / "not-a-directory").read_text() == "a file where the cache would go"
