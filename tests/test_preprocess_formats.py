"""preprocess's input formats (parquet, Hugging Face datasets directories) and --split-sentences."""

import json
import sys

import numpy as np
import pytest

from lightning_megatron.cli import main as cli_main
from lightning_megatron.data import stdlib_source_files
from lightning_megatron.data.indexed import IndexedDataset, data_file, index_file
from lightning_megatron.data.preprocess import EmptyInputError, metadata_file, preprocess
from lightning_megatron.data.sentences import split_sentences

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")
datasets.disable_progress_bars()

# ~1.3 MB, so that the inputs are cut into two chunks, tokenised by two processes and put back in order; one
# empty text (no document) and one null (a malformed record, skipped) among them.
TEXTS = [f"Document {i}: naïve café. " * (30 + i % 13) + "日本語 🐍" for i in range(1700)]
TEXTS[5], TEXTS[77] = "", None


def _files(prefix):
    return data_file(prefix).read_bytes(), index_file(prefix).read_bytes()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The same records as .jsonl, .parquet, a datasets directory (3 arrow files) and a DatasetDict's split."""
    folder = tmp_path_factory.mktemp("formats")
    ids = list(range(len(TEXTS)))
    with open(folder / "in.jsonl", "w") as f:
        for i, text in zip(ids, TEXTS):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    pq.write_table(pa.table({"id": ids, "text": TEXTS}), folder / "in.parquet", row_group_size=500)
    datasets.Dataset.from_dict({"id": ids, "text": TEXTS}).save_to_disk(str(folder / "in_dataset"), num_shards=3)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS}),
                          "test": datasets.Dataset.from_dict({"text": ["held out."]})}).save_to_disk(str(folder / "dict"))
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_parquet_and_datasets_inputs_write_the_bytes_of_the_same_texts_as_jsonl(inputs, tmp_path, workers):
    kwargs = dict(tokenizer="byte", workers=workers, on_error="skip", append_eos=True, progress=False)
    expected = preprocess(input=inputs / "in.jsonl", output_prefix=tmp_path / "jsonl", **kwargs)
    assert expected.documents == len(TEXTS) - 2 and expected.skipped_lines == 1
    for name, extra in [("in.parquet", {}), ("in_dataset", {}), ("dict", {"split": "train"})]:
        result = preprocess(input=inputs / name, output_prefix=tmp_path / name, **extra, **kwargs)
        assert _files(tmp_path / name) == _files(tmp_path / "jsonl"), name
        assert (result.documents, result.tokens, result.skipped_lines) == (expected.documents, expected.tokens, 1)
        assert result.record_name == "row"
        assert json.loads(metadata_file(tmp_path / name).read_text())["input"].endswith(name if not extra else "train")


@pytest.mark.slow
def test_skipped_rows_are_reported_by_row(inputs, tmp_path, capsys):
    cli_main(["preprocess", "--input", str(inputs / "in.parquet"), "--tokenizer", "byte", "--output-prefix",
              str(tmp_path / "out"), "--on-error", "skip", "--no-progress"])
    out, err = capsys.readouterr()
    assert f"{inputs / 'in.parquet'}, row 78: 'text' is null" in err and "1 malformed rows skipped" in out
    with pytest.raises(ValueError, match=r"in\.parquet, row 78: 'text' is null; fix the record or skip"):
        preprocess(input=inputs / "in.parquet", tokenizer="byte", output_prefix=tmp_path / "stop", progress=False)
    assert not data_file(tmp_path / "stop").exists()


def test_a_missing_or_non_string_column_names_the_columns(tmp_path):
    pq.write_table(pa.table({"body": ["a", "b"], "n": [1, 2]}), tmp_path / "in.parquet")
    datasets.Dataset.from_dict({"body": ["a", "b"], "n": [1, 2]}).save_to_disk(str(tmp_path / "ds"))
    for source, name in [(tmp_path / "in.parquet", "in.parquet"), (tmp_path / "ds", "The dataset .*ds")]:
        with pytest.raises(ValueError, match=rf"{name} has no column 'text'; its columns are .*'n' \(int64\).*--json-key"):
            preprocess(input=source, tokenizer="byte", output_prefix=tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match=r"Column 'n' of .*in\.parquet is int64, not a string; its columns are "
                                         r"'body' \(string\), 'n' \(int64\)"):
        preprocess(input=tmp_path / "in.parquet", tokenizer="byte", output_prefix=tmp_path / "out", json_key="n",
                   progress=False)
    preprocess(input=tmp_path / "in.parquet", tokenizer="byte", output_prefix=tmp_path / "out", json_key="body",
               progress=False)
    assert IndexedDataset(tmp_path / "out").num_documents == 2


@pytest.mark.slow
def test_a_dataset_dict_needs_a_split_and_lists_its_splits(inputs, tmp_path):
    for split in (None, "validation"):
        with pytest.raises(ValueError, match=r"dict is a DatasetDict with the splits 'train', 'test' and .*"
                                             r"choose one with --split NAME"):
            preprocess(input=inputs / "dict", tokenizer="byte", output_prefix=tmp_path / "out", split=split,
                       progress=False)
    preprocess(input=inputs / "dict", split="test", tokenizer="byte", output_prefix=tmp_path / "out", progress=False)
    assert bytes(IndexedDataset(tmp_path / "out")[0].astype(np.uint8)) == b"held out."
    with pytest.raises(ValueError, match=r"--split 'train' selects a split of a DatasetDict directory, but .*single"):
        preprocess(input=inputs / "in_dataset", split="train", tokenizer="byte", output_prefix=tmp_path / "x")
    with pytest.raises(ValueError, match=r"--split 'train' selects a split .*in\.jsonl is a file"):
        preprocess(input=inputs / "in.jsonl", split="train", tokenizer="byte", output_prefix=tmp_path / "x")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match=r"plain is a folder that holds no file: no \.jsonl, \.txt or \.parquet file, and it is not a "
                       r"directory written by .*save_to_disk"):
        preprocess(input=tmp_path / "plain", tokenizer="byte", output_prefix=tmp_path / "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin", "out.ends", "out.idx", "out.meta.json",
                                                          "plain"]


def test_an_input_of_empty_rows_writes_nothing(tmp_path):
    pq.write_table(pa.table({"text": ["", "", ""]}), tmp_path / "empty.parquet")
    with pytest.raises(EmptyInputError, match=r"empty\.parquet gave no documents: 3 rows read: 3 with an empty text "
                                              r"under 'text'.*Nothing was written"):
        preprocess(input=tmp_path / "empty.parquet", tokenizer="byte", output_prefix=tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.parquet"]


@pytest.mark.slow
def test_missing_pyarrow_says_how_to_install_it(inputs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what `import pyarrow` meets when it is not installed
    with pytest.raises(ImportError, match=r"pip install 'lightning-megatron\[datasets\]'"):
        preprocess(input=inputs / "in.parquet", tokenizer="byte", output_prefix=tmp_path / "out")


@pytest.mark.slow
def test_train_tokenizer_reads_parquet(inputs, tmp_path):
    cli_main(["train-tokenizer", "--input", str(inputs / "in.parquet"), "--vocab-size", "300", "--output",
              str(tmp_path / "tok.json"), "--on-error", "skip"])
    assert (tmp_path / "tok.json").is_file()


# ----------------------------------------------------------------------------- sentences
SENTENCE_CASES = {
    "abbreviations": ("Use a tool, e.g. a hammer. Dr. Who agrees, i.e. Mr. Smith does. Fig. 3 shows it.",
                      ["Use a tool, e.g. a hammer.", " Dr. Who agrees, i.e. Mr. Smith does.", " Fig. 3 shows it."]),
    "decimals": ("Pi is 3.14 and e is 2.718. Version 3.12. Then 4.0 came.",
                 ["Pi is 3.14 and e is 2.718.", " Version 3.12.", " Then 4.0 came."]),
    "initials": ("J. R. R. Tolkien lived in the U.K. for years. He wrote.",
                 ["J. R. R. Tolkien lived in the U.K. for years.", " He wrote."]),
    "lowercase next": ("It ends here. but this is the same sentence.", ["It ends here. but this is the same sentence."]),
    "quotes and brackets": ('He said "Stop." Then (after a pause) he left. "Why?" she asked.',
                            ['He said "Stop."', " Then (after a pause) he left.", ' "Why?" she asked.']),
    "ellipsis and marks": ("Wait... What? No! 42 is it.", ["Wait...", " What?", " No!", " 42 is it."]),
    "line breaks": ("A wrapped\nline goes on. Ends.\nNext one\n", ["A wrapped\nline goes on.", " Ends.\n", "Next one\n"]),
    "code": ("import os\n\n\ndef f(x):\n    return x.y\n\n    # Done. Next.\n    pass\n",
             ["import os\n\n\n", "def f(x):\n    return x.y\n\n", "    # Done.", " Next.\n", "    pass\n"]),
    "no end": ("no sentence end at all", ["no sentence end at all"]),
    "only whitespace around": ("\n\n  Hello.  \n", ["\n\n  Hello.  \n"]),
    "empty": ("", []),
}


@pytest.mark.parametrize("text, expected", SENTENCE_CASES.values(), ids=SENTENCE_CASES.keys())
def test_sentence_splitter(text, expected):
    assert split_sentences(text) == expected


def test_sentences_join_back_to_the_text():
    for file in stdlib_source_files(max_files=40):
        text = file.read_text()
        sentences = split_sentences(text)
        assert "".join(sentences) == text and all(sentence.strip() for sentence in sentences), file


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_split_sentences_stores_a_sequence_per_sentence_and_the_eos_after_the_last(inputs, tmp_path, workers):
    texts = [text for text in TEXTS if text]
    kwargs = dict(tokenizer="byte", workers=workers, on_error="skip", append_eos=True, split_sentences=True,
                  progress=False)
    result = preprocess(input=inputs / "in.jsonl", output_prefix=tmp_path / "sentences", **kwargs)
    dataset = IndexedDataset(tmp_path / "sentences")
    assert result.documents == dataset.num_documents == len(texts) and len(dataset) > 2 * len(texts)
    for d in (0, 1, 500, len(texts) - 1):
        first, end = dataset.document_indices[d], dataset.document_indices[d + 1]
        sequences = [bytes(dataset[i].astype(np.uint8)) for i in range(first, end)]
        assert dataset[end - 1][-1] == 256 and all(256 not in dataset[i] for i in range(first, end - 1))
        sequences[-1] = sequences[-1][:-1]  # the end-of-document id (256: not a byte)
        assert [s.decode() for s in sequences] == split_sentences(texts[d])
        assert bytes(dataset.document(d)[:-1].astype(np.uint8)).decode() == texts[d]
    metadata = json.loads(metadata_file(tmp_path / "sentences").read_text())
    assert metadata["split_sentences"] is True and metadata["sequences"] == len(dataset)
    preprocess(input=inputs / "in.parquet", output_prefix=tmp_path / "from_parquet", **kwargs)
    assert _files(tmp_path / "from_parquet") == _files(tmp_path / "sentences")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["from_parquet.bin", "from_parquet.ends", "from_parquet.idx",
                                                          "from_parquet.meta.json", "sentences.bin", "sentences.ends",
                                                          "sentences.idx", "sentences.meta.json"]
