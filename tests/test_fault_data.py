"""Data faults are reported, never silent: a data_prefix naming no files, inputs that hold no documents."""

import json
import re

import numpy as np
import pytest

from lightning_megatron.cli import main as cli_main
from lightning_megatron.data import GPTDataModule
from lightning_megatron.data.indexed import IndexedDataset, data_file, index_file
from lightning_megatron.data.preprocess import EmptyInputError, metadata_file, preprocess
from lightning_megatron.data.tokenizers import train_bpe_tokenizer

DATASETS = ("corpus_text_document", "corpus_code_document", "wiki")


@pytest.fixture
def data_dir(tmp_path):
    """A directory holding three preprocessed datasets, and an input they were made from."""
    (tmp_path / "in.txt").write_text("first document\nsecond document\n")
    for name in DATASETS:
        preprocess(input=tmp_path / "in.txt", tokenizer="byte", output_prefix=tmp_path / "data" / name, progress=False)
    return tmp_path / "data"


def _missing_prefix_error(prefix, **kwargs) -> str:
    """The error of the data module for ``prefix``: it must come from the constructor, which every rank runs alike
    before the Trainer exists (so before any collective), not from setup()."""
    with pytest.raises(FileNotFoundError) as error:
        GPTDataModule(data_prefix=str(prefix), **kwargs)
    return str(error.value)


@pytest.mark.parametrize("tokenizer", [None, "byte"])
@pytest.mark.parametrize("typed", ["corpus_text_document.bin", "corpus_text_document.idx"])
def test_prefix_given_with_its_file_suffix_names_the_files_and_the_prefix(data_dir, typed, tokenizer):
    message = _missing_prefix_error(data_dir / typed, tokenizer=tokenizer)
    wanted = data_dir / "corpus_text_document"
    assert f"{data_dir / typed}.bin" in message and f"{data_dir / typed}.idx" in message  # the paths looked for
    assert f"Did you mean data_prefix={str(wanted)!r}?" in message
    assert str(data_dir / "wiki") not in message  # the one right answer, not a list
    # not the old advice about a missing .meta.json and a tokenizer: the data files are what is missing
    assert "meta.json" not in message and "tokenizer" not in message


def test_shortened_or_misspelt_prefix_lists_the_close_datasets(data_dir):
    for typed in ("corpus", "corpus_txt_document"):
        message = _missing_prefix_error(data_dir / typed)
        assert f"neither {data_dir / typed}.bin nor {data_dir / typed}.idx exists" in message
        for name in ("corpus_text_document", "corpus_code_document"):
            assert repr(str(data_dir / name)) in message
        assert repr(str(data_dir / "wiki")) not in message and "meta.json" not in message


def test_prefix_far_from_every_dataset_lists_what_the_directory_holds(data_dir):
    message = _missing_prefix_error(data_dir / "zzzz")
    assert "none with a close name" in message
    assert all(repr(str(data_dir / name)) in message for name in DATASETS)
    assert "lightning-megatron preprocess" in message


def test_prefix_naming_the_data_directory_lists_its_datasets(data_dir):
    message = _missing_prefix_error(data_dir)
    assert f"{data_dir} is a directory, not a prefix" in message
    assert all(repr(str(data_dir / name)) in message for name in DATASETS)


def test_prefix_in_a_missing_directory_says_the_directory_does_not_exist(tmp_path):
    prefix = tmp_path / "no_such_dir" / "corpus"
    message = _missing_prefix_error(prefix)
    assert f"{prefix}.bin" in message and f"{prefix}.idx" in message
    assert f"the directory {tmp_path / 'no_such_dir'} does not exist" in message
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"{empty} holds no .bin/.idx dataset" in _missing_prefix_error(empty / "corpus")


def test_half_a_dataset_names_the_missing_file_and_the_present_one(data_dir):
    prefix = data_dir / "wiki"
    data_file(prefix).unlink()
    message = _missing_prefix_error(prefix)
    assert f"{data_file(prefix)} does not exist but {index_file(prefix)} does" in message
    with pytest.raises(FileNotFoundError) as error:  # the reader says the same, with the same advice
        IndexedDataset(prefix)
    assert f"{data_file(prefix)} does not exist but {index_file(prefix)} does" in str(error.value)


def test_indexed_dataset_reader_suggests_the_prefix_too(data_dir):
    with pytest.raises(FileNotFoundError, match="Did you mean prefix=") as error:
        IndexedDataset(data_dir / "corpus_text_document.bin")
    assert repr(str(data_dir / "corpus_text_document")) in str(error.value)
    assert len(IndexedDataset(data_dir / "corpus_text_document")) == 2  # the suggestion is a dataset that opens


# ---------------------------------------------------------------------------------------------- empty inputs
def _snapshot(directory):
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


# (file name, content, extra CLI arguments, what the message must say about why)
EMPTY_INPUTS = [
    ("empty.txt", b"", [], "not a single line"),
    ("empty.jsonl", b"", [], "not a single line"),
    ("blank.txt", b"\n   \n\r\n\t\n", [], "4 lines read: 4 blank"),
    ("blank.jsonl", b"\n\n", [], "2 lines read: 2 blank"),
    ("empty_texts.jsonl", b'{"text": ""}\n\n{"text": ""}\n', [], "3 lines read: 1 blank; 2 with an empty text under 'text'"),
    ("other_key.jsonl", b'{"body": "a"}\n{"body": "b"}\n{"body": "c"}\n', ["--on-error", "skip"],
     "3 lines read: 3 malformed and skipped by --on-error skip (the first: {input}:1: no key 'text'"),
]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("name, content, extra, why", EMPTY_INPUTS, ids=[case[0] for case in EMPTY_INPUTS])
def test_preprocess_of_an_input_without_documents_fails_and_leaves_the_old_dataset(tmp_path, name, content, extra,
                                                                                   why, workers):
    source = tmp_path / name
    source.write_bytes(content)
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "old.txt").write_text("an older dataset\n")
    preprocess(input=tmp_path / "old.txt", tokenizer="byte", output_prefix=out / "corpus", progress=False)
    before = _snapshot(out)
    assert sorted(before) == ["corpus.bin", "corpus.ends", "corpus.idx", "corpus.meta.json"]

    with pytest.raises(EmptyInputError) as error:
        cli_main(["preprocess", "--input", str(source), "--tokenizer", "byte", "--output-prefix", str(out / "corpus"),
                  "--workers", str(workers), "--no-progress", *extra])
    message = str(error.value)
    assert message.startswith(f"{source} gave no documents: ")
    assert why.format(input=source) in message
    assert f"Nothing was written to {out / 'corpus'}.bin" in message
    assert ("--json-key ('text')" in message) == name.endswith(".jsonl")
    assert _snapshot(out) == before  # byte for byte, and no temporary files left
    assert json.loads(metadata_file(out / "corpus").read_text())["input"] == str((tmp_path / "old.txt").resolve())


def test_preprocess_without_documents_over_two_chunks_and_workers_creates_no_directory(tmp_path):
    # 1.3 MB of records without the key: two chunks, tokenised by two processes, every line skipped.
    source = tmp_path / "big.jsonl"
    source.write_text((json.dumps({"body": "x" * 40}) + "\n") * 25_000)
    prefix = tmp_path / "new" / "dir" / "corpus"
    with pytest.raises(EmptyInputError, match=r"25000 lines read: 25000 malformed and skipped"):
        preprocess(input=source, tokenizer="byte", output_prefix=prefix, workers=2, on_error="skip", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl"]  # not even the output directory


def test_preprocess_command_exits_non_zero_on_an_empty_input(tmp_path, capsys):
    """The command's own entry point, in this process: its error is not caught, so the interpreter exits non-zero
    with it."""
    source = tmp_path / "empty.txt"
    source.write_bytes(b"")
    with pytest.raises(EmptyInputError, match=re.escape(f"{source} gave no documents: there is not a single line")):
        cli_main(["preprocess", "--input", str(source), "--tokenizer", "byte",
                  "--output-prefix", str(tmp_path / "corpus"), "--no-progress"])
    assert "documents, 0 tokens" not in capsys.readouterr().out  # no success line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]


def test_preprocess_still_writes_an_input_with_one_document(tmp_path):
    # The boundary: one real line among blank ones is a dataset.
    (tmp_path / "one.txt").write_text("\n\nonly line\n\n")
    result = preprocess(input=tmp_path / "one.txt", tokenizer="byte", output_prefix=tmp_path / "corpus", progress=False)
    dataset = IndexedDataset(tmp_path / "corpus")
    assert result.documents == 1 == len(dataset)
    assert bytes(np.asarray(dataset[0], dtype=np.uint8)).decode() == "only line"


def test_train_tokenizer_on_inputs_without_documents_fails_and_writes_nothing(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_bytes(b"\n\n")
    output = tmp_path / "tokenizer.json"
    with pytest.raises(EmptyInputError) as error:
        cli_main(["train-tokenizer", "--input", str(tmp_path / "empty.txt"), str(tmp_path / "blank.jsonl"),
                  "--vocab-size", "300", "--output", str(output)])
    message = str(error.value)
    assert f"{tmp_path / 'empty.txt'}, {tmp_path / 'blank.jsonl'} gave no documents: 2 lines read: 2 blank" in message
    assert f"Nothing was written to {output}" in message
    # The library function refuses too: no texts, or only empty ones, would train a bare byte alphabet.
    for texts in ([], ["", ""]):
        with pytest.raises(ValueError, match="No text to train a tokenizer on"):
            train_bpe_tokenizer(texts, vocab_size=300, output_path=output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blank.jsonl", "empty.txt"]
