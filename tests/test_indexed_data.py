"""Megatron indexed datasets, tokenizers, preprocessing, and GPTDataModule on preprocessed data."""

import json
import struct
import sys

import lightning as L
import numpy as np
import pytest
import torch

from lightning_megatron.cli import main as cli_main
from lightning_megatron.data import GPTDataModule, stdlib_source_files
from lightning_megatron.data.indexed import IndexedDataset, IndexedDatasetWriter, data_file, index_file
from lightning_megatron.data.preprocess import MalformedInputError, metadata_file, preprocess
from lightning_megatron.data.tokenizers import HFTokenizer, check_vocab_fits, load_tokenizer
from lightning_megatron.models import GPT, GPTConfig

# Megatron-LM's dtype codes, written out here independently of the module under test.
MEGATRON_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7,
                  np.uint16: 8}


def megatron_idx_bytes(code, sequence_lengths, sequence_pointers, document_indices):
    """An .idx file laid out field by field as Megatron-LM's indexed_dataset.py writes it."""
    n = len(sequence_lengths)
    return (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code) + struct.pack("<Q", n)
            + struct.pack("<Q", len(document_indices)) + struct.pack(f"<{n}i", *sequence_lengths)
            + struct.pack(f"<{n}q", *sequence_pointers) + struct.pack(f"<{len(document_indices)}q", *document_indices))


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.uint16, np.int32, np.int64, np.float32])
def test_writer_is_byte_compatible_and_round_trips(tmp_path, dtype):
    docs = [np.array([1, 2, 3]), np.array([], dtype=np.int64), np.array([7]), np.array([4, 5, 6, 100])]
    prefix = tmp_path / "data"
    with IndexedDatasetWriter(prefix, dtype=dtype) as writer:
        for doc in docs:
            writer.add_document(doc)
    itemsize = np.dtype(dtype).itemsize
    lengths = [3, 0, 1, 4]
    expected_idx = megatron_idx_bytes(MEGATRON_CODES[dtype], lengths, [0, 3 * itemsize, 3 * itemsize, 4 * itemsize],
                                      [0, 1, 2, 3, 4])
    assert index_file(prefix).read_bytes() == expected_idx
    assert data_file(prefix).read_bytes() == np.concatenate(docs).astype(dtype).tobytes()
    # no temporary files left; the last tokens beside the two Megatron-LM files, which stay as they were
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.bin", "data.ends", "data.idx"]

    ds = IndexedDataset(prefix)
    assert len(ds) == ds.num_documents == 4 and ds.dtype == np.dtype(dtype)
    assert ds.sequence_lengths.tolist() == lengths and ds.document_indices.tolist() == [0, 1, 2, 3, 4]
    for i, doc in enumerate(docs):
        assert ds[i].dtype == np.dtype(dtype) and ds[i].tolist() == doc.tolist() == ds.document(i).tolist()
    assert ds[-1].tolist() == [4, 5, 6, 100]
    assert ds.recorded_last_tokens(range(4)).tolist() == [3, 0, 7, 100]
    with pytest.raises(IndexError):
        ds[4]


def test_reads_hand_built_megatron_files_with_multi_sequence_documents(tmp_path):
    # Two documents: sentences [10, 11] + [12] form document 0, [13, 14, 15] is document 1 (int32, code 4).
    prefix = tmp_path / "megatron"
    index_file(prefix).write_bytes(megatron_idx_bytes(4, [2, 1, 3], [0, 8, 12], [0, 2, 3]))
    data_file(prefix).write_bytes(struct.pack("<6i", 10, 11, 12, 13, 14, 15))
    ds = IndexedDataset(prefix)
    assert (len(ds), ds.num_documents, ds.dtype) == (3, 2, np.dtype(np.int32))
    assert [ds[i].tolist() for i in range(3)] == [[10, 11], [12], [13, 14, 15]]
    assert ds.document(0).tolist() == [10, 11, 12] and ds.document(1).tolist() == [13, 14, 15]
    assert ds.document_indices.tolist() == [0, 2, 3]


def _corrupt(prefix, how):
    idx, bin_ = index_file(prefix), data_file(prefix)
    if how == "missing .bin":
        bin_.unlink()
        return bin_, "does not exist"
    if how == "missing .idx":
        idx.unlink()
        return idx, "does not exist"
    if how == "truncated .bin":
        bin_.write_bytes(bin_.read_bytes()[:-2])
        return bin_, "Index/bin mismatch"
    if how == "truncated .idx":
        idx.write_bytes(idx.read_bytes()[:-8])
        return idx, "truncated"
    data = bytearray(idx.read_bytes())
    offset, value, message = {"bad magic": (0, b"XX", "magic"), "bad version": (9, b"\x02", "version 2"),
                              "bad dtype code": (17, b"\x09", "dtype code 9")}[how]
    data[offset : offset + len(value)] = value
    idx.write_bytes(bytes(data))
    return idx, message


@pytest.mark.parametrize("how", ["missing .bin", "missing .idx", "truncated .bin", "truncated .idx", "bad magic",
                                 "bad version", "bad dtype code"])
def test_broken_dataset_errors_name_the_file(tmp_path, how):
    prefix = tmp_path / "data"
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        writer.add_document([1, 2, 3])
    path, message = _corrupt(prefix, how)
    with pytest.raises((ValueError, FileNotFoundError)) as error:
        IndexedDataset(prefix)
    assert str(path) in str(error.value) and message in str(error.value)


def test_writer_refuses_values_outside_its_dtype_and_leaves_nothing_on_error(tmp_path):
    prefix = tmp_path / "data"
    with pytest.raises(ValueError, match=r"0\.\.300 do not fit the dataset dtype uint8"):
        with IndexedDatasetWriter(prefix, dtype=np.uint8) as writer:
            writer.add_document([1, 2])
            writer.add_document([0, 300])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="no Megatron-LM dtype code"):
        IndexedDatasetWriter(prefix, dtype=np.uint32)


def _write_jsonl(path, texts, bad_lines):
    """``texts`` as JSON lines, with raw ``bad_lines`` ({line number: bytes}) spliced in."""
    lines = [json.dumps({"text": t, "id": i}).encode() for i, t in enumerate(texts)]
    for number, raw in sorted(bad_lines.items()):
        lines.insert(number - 1, raw)
    path.write_bytes(b"\n".join(lines) + b"\n")


def _texts(prefix):
    ds = IndexedDataset(prefix)
    return [bytes(ds[i].astype(np.uint8)).decode() for i in range(len(ds))]


BAD_LINES = {3: b'{"text": "unterminated', 5: b'{"body": "no text key"}', 7: b'{"text": "\xff\xfe"}', 9: b"[1, 2]"}


def test_preprocess_skips_malformed_lines_in_order_over_two_workers(tmp_path, capsys):
    # ~1.3 MB so the file is cut into two chunks, tokenised by two processes and put back in order.
    texts = [f"document {i}: " + "héllo wörld " * (40 + i % 7) for i in range(2500)]
    _write_jsonl(tmp_path / "in.jsonl", texts, {**BAD_LINES, 2000: b"not json at all"})
    cli_main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--tokenizer", "byte", "--output-prefix",
              str(tmp_path / "out"), "--workers", "2", "--on-error", "skip", "--no-progress"])
    out, err = capsys.readouterr()
    assert _texts(tmp_path / "out") == texts
    tokens = sum(len(t.encode()) for t in texts)
    assert f"{len(texts)} documents, {tokens} tokens" in out and "5 malformed lines skipped" in out
    assert "tokens/s" in out
    for number, reason in [(3, "invalid JSON"), (5, "no key 'text'"), (7, "invalid utf-8"), (9, "expected a JSON object"),
                           (2000, "invalid JSON")]:
        assert f"in.jsonl:{number}: {reason}" in err
    assert json.loads(metadata_file(tmp_path / "out").read_text())["skipped_lines"] == 5


def test_preprocess_stops_at_the_first_malformed_line_and_writes_nothing(tmp_path):
    _write_jsonl(tmp_path / "in.jsonl", ["first", "second", "third", "fourth"], BAD_LINES)
    with pytest.raises(MalformedInputError, match=r"in\.jsonl:3: invalid JSON .*--on-error skip"):
        cli_main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--tokenizer", "byte", "--output-prefix",
                  str(tmp_path / "out"), "--no-progress"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_preprocess_txt_is_one_document_per_non_empty_line_with_optional_eos(tmp_path):
    (tmp_path / "in.txt").write_text("first line\n\n   \nsecond, naïve\r\nthird")
    result = preprocess(input=tmp_path / "in.txt", tokenizer="byte", output_prefix=tmp_path / "out",
                        append_eos=True, progress=False)
    ds = IndexedDataset(tmp_path / "out")
    assert result.documents == 3 and result.skipped_lines == 0 and ds.dtype == np.uint16
    assert [ds[i][-1] for i in range(3)] == [256] * 3
    assert [bytes(ds[i][:-1].astype(np.uint8)).decode() for i in range(3)] == ["first line", "second, naïve", "third"]


@pytest.fixture(scope="module")
def stdlib_jsonl(tmp_path_factory):
    """The first 20 stdlib files as JSON lines: the built-in corpus, as a user's file would hold it."""
    path = tmp_path_factory.mktemp("corpus") / "stdlib.jsonl"
    with open(path, "w") as f:
        for file in stdlib_source_files(max_files=20):
            f.write(json.dumps({"text": file.read_bytes().decode("utf-8")}) + "\n")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("append_eos", [False, True])
def test_byte_preprocessed_stdlib_gives_the_same_batches_as_the_built_in_corpus(tmp_path, stdlib_jsonl, append_eos):
    preprocess(input=stdlib_jsonl, tokenizer="byte", output_prefix=tmp_path / "stdlib", append_eos=append_eos,
               progress=False)
    config = dict(seq_length=32, global_batch_size=8, split="90,5,5", seed=5)
    built_in = GPTDataModule(max_files=20, **config)
    indexed = GPTDataModule(data_prefix=str(tmp_path / "stdlib"), **config)
    assert indexed.vocab_size == 257 and indexed.tokenizer.eos_id == 256
    built_in.setup("fit"), indexed.setup("fit")
    for split in ("train_dataset", "val_dataset"):  # the same documents, packed alike, whether they end in eos or not
        ours, theirs = getattr(indexed, split), getattr(built_in, split)
        assert len(ours) == len(theirs) > 0
        assert all(np.array_equal(ours.window(i), theirs.window(i)) for i in range(len(ours)))
    for loader in ("train_dataloader", "val_dataloader"):
        expected, got = next(iter(getattr(built_in, loader)())), next(iter(getattr(indexed, loader)()))
        assert got["input_ids"].shape == (8, 32) and torch.equal(got["input_ids"], expected["input_ids"])
        assert torch.equal(got["labels"], expected["labels"])


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory):
    """A byte-level BPE trained offline, through the CLI, on about 6 KB of stdlib source."""
    folder = tmp_path_factory.mktemp("bpe")
    text = "".join(f.read_text() for f in stdlib_source_files(max_files=4))[:6000]
    (folder / "train.txt").write_text(text)
    cli_main(["train-tokenizer", "--input", str(folder / "train.txt"), "--vocab-size", "300",
              "--output", str(folder / "tokenizer.json")])
    return folder / "tokenizer.json"


def test_trained_bpe_round_trips_and_trains_through_the_data_module(tmp_path, bpe_tokenizer):
    tok = load_tokenizer(str(bpe_tokenizer))
    assert isinstance(tok, HFTokenizer) and 257 < tok.vocab_size <= 300 and tok.eos_token == "<|endoftext|>"
    text = "def naïve(x):\n    return x + 1  # 日本語 🐍"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode()) and max(ids) < tok.vocab_size and tok.eos_id not in ids
    assert tok.decode(ids) == text and tok.decode(ids + [tok.eos_id]) == text

    docs = [f"def f{i}(x):\n    return x * {i}\n" * 20 for i in range(40)]
    _write_jsonl(tmp_path / "code.jsonl", docs, {})
    preprocess(input=tmp_path / "code.jsonl", tokenizer=str(bpe_tokenizer), output_prefix=tmp_path / "code",
               progress=False)
    ds = IndexedDataset(tmp_path / "code")
    assert [tok.decode(ds[i]) for i in range(len(ds))] == docs
    dm = GPTDataModule(data_prefix=str(tmp_path / "code"), seq_length=16, global_batch_size=4, split="90,5,5")
    assert dm.vocab_size == tok.vocab_size and dm.tokenizer.eos_id == tok.eos_id
    dm.setup("fit")
    assert next(iter(dm.train_dataloader()))["input_ids"].shape == (4, 16)


def test_tokenizer_vocab_larger_than_the_model_fails_in_setup(tmp_path, bpe_tokenizer):
    vocab = load_tokenizer(str(bpe_tokenizer)).vocab_size
    with pytest.raises(ValueError, match=rf"tokenizer has {vocab} ids but the model's vocab_size is 257"):
        check_vocab_fits(tokenizer_vocab_size=vocab, model_vocab_size=257)
    check_vocab_fits(tokenizer_vocab_size=257, model_vocab_size=384)  # a padded model vocabulary is fine

    _write_jsonl(tmp_path / "code.jsonl", [f"x = {i}\n" * 50 for i in range(20)], {})
    preprocess(input=tmp_path / "code.jsonl", tokenizer=str(bpe_tokenizer), output_prefix=tmp_path / "code",
               progress=False)
    dm = GPTDataModule(data_prefix=str(tmp_path / "code"), seq_length=16, global_batch_size=2, split="90,5,5")
    model = GPT(GPTConfig(vocab_size=257, max_seq_length=16, hidden_size=16, num_layers=1, num_heads=2))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=rf"tokenizer has {vocab} ids but the model's vocab_size is 257"):
        trainer.fit(model, datamodule=dm)


def test_data_module_needs_the_tokenizer_the_data_was_made_with(tmp_path, bpe_tokenizer):
    _write_jsonl(tmp_path / "code.jsonl", [f"value = {i} * {i}\n" * 30 for i in range(20)], {})
    preprocess(input=tmp_path / "code.jsonl", tokenizer=str(bpe_tokenizer), output_prefix=tmp_path / "code",
               progress=False)
    prefix = str(tmp_path / "code")
    with pytest.raises(ValueError, match=r"has 257 ids but data_prefix=.* was made with .*tokenizer\.json"):
        GPTDataModule(data_prefix=prefix, tokenizer="byte")
    metadata_file(prefix).unlink()  # as for data made by Megatron-LM's own tools
    with pytest.raises(ValueError, match=r"code\.meta\.json naming its tokenizer.*tokenizer='byte' or the path"):
        GPTDataModule(data_prefix=prefix)
    wrong = GPTDataModule(data_prefix=prefix, tokenizer="byte", seq_length=16, global_batch_size=2)
    wrong.setup("fit")
    with pytest.raises(ValueError, match=r"holds token id 2\d\d but the tokenizer has only 257 ids"):
        next(iter(wrong.train_dataloader()))
    GPTDataModule(data_prefix=prefix, tokenizer=str(bpe_tokenizer), seq_length=16, global_batch_size=2).setup("fit")
    with pytest.raises(ValueError, match="max_files=3 selects files of the built-in corpus"):
        GPTDataModule(data_prefix=prefix, max_files=3)


def test_missing_tokenizers_package_says_how_to_install_it(bpe_tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # what `import tokenizers` meets when it is not installed
    with pytest.raises(ImportError, match=r"pip install 'lightning-megatron\[hf\]'"):
        load_tokenizer(str(bpe_tokenizer))
    assert load_tokenizer("byte").vocab_size == 257
