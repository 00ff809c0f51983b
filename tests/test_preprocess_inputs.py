"""``preprocess`` over several inputs and folders: every input is read, in the order given, a folder's files in
sorted path order; a missing input or a folder without documents ends the command with one line, no traceback."""

import json
import re

import pytest

from lightning_megatron.cli import main as cli_main
from lightning_megatron.data.indexed import IndexedDataset, data_file, index_file
from lightning_megatron.data.preprocess import metadata_file


def documents(prefix):
    dataset = IndexedDataset(prefix)
    return [bytes(dataset.document(i).tolist()).decode() for i in range(dataset.num_documents)]


def run(*argv):
    cli_main(["preprocess", *map(str, argv), "--tokenizer", "byte", "--no-progress"])


@pytest.fixture
def files(tmp_path):
    (tmp_path / "a.txt").write_text("alpha one\nalpha two\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "beta"}) + "\n")
    return tmp_path


@pytest.mark.parametrize("form", ["repeated", "listed"])
def test_several_inputs_are_all_read_in_the_order_given(files, form):
    inputs = ["--input", files / "b.jsonl", "--input", files / "a.txt"] if form == "repeated" else \
        ["--input", files / "b.jsonl", files / "a.txt"]
    run(*inputs, "--output-prefix", files / "out")
    assert documents(files / "out") == ["beta", "alpha one", "alpha two"]
    recorded = json.loads(metadata_file(files / "out").read_text())["input"]
    assert recorded == [str((files / "b.jsonl").resolve()), str((files / "a.txt").resolve())]


def test_a_folder_is_read_in_sorted_path_order_whatever_the_order_files_were_made_in(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    for name, text in [("z.txt", "zed\n"), ("sub/m.txt", "em\n"), (".hidden/h.txt", "hidden\n"),
                       ("b.jsonl", json.dumps({"text": "bee"}) + "\n"), ("README.md", "not a document\n")]:
        (corpus / name).parent.mkdir(parents=True, exist_ok=True)
        (corpus / name).write_text(text)
    run("--input", corpus, "--output-prefix", tmp_path / "folder")
    assert documents(tmp_path / "folder") == ["bee", "em", "zed"]
    assert "not read (neither .jsonl, .txt nor .parquet): 1 files" in capsys.readouterr().err
    # the same bytes as the files named one by one in that order, and a folder mixed with a file
    run("--input", corpus / "b.jsonl", corpus / "sub" / "m.txt", corpus / "z.txt",
        "--output-prefix", tmp_path / "named")
    for read in (data_file, index_file):
        assert read(tmp_path / "folder").read_bytes() == read(tmp_path / "named").read_bytes()
    (tmp_path / "more.txt").write_text("more\n")
    run("--input", tmp_path / "more.txt", corpus, "--output-prefix", tmp_path / "mixed")
    assert documents(tmp_path / "mixed") == ["more", "bee", "em", "zed"]


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing.txt", "missing.txt does not exist"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "is a folder that holds no file: no .jsonl, .txt or .parquet"),
    (lambda p: (p / "notes").mkdir() or (p / "notes" / "x.md").write_text("x") and p / "notes",
     r"holds 1 other files \(e.g. x.md\)"),
])
def test_a_missing_input_or_a_folder_without_documents_is_one_line_and_writes_nothing(tmp_path, capsys, make,
                                                                                      message):
    with pytest.raises(SystemExit) as exit_info:
        run("--input", make(tmp_path), "--output-prefix", tmp_path / "out" / "x")
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("lightning-megatron preprocess: error: Input ")
    assert re.search(message, last)
    assert not (tmp_path / "out").exists()


def test_train_tokenizer_reads_folders_and_several_inputs_as_preprocess_does(files, tmp_path):
    pytest.importorskip("tokenizers")
    from lightning_megatron.data.tokenizers import HFTokenizer

    (files / "corpus").mkdir()
    (files / "corpus" / "c.txt").write_text("gamma gamma gamma\n" * 50)
    cli_main(["train-tokenizer", "--input", str(files / "corpus"), "--input", str(files / "a.txt"),
              "--vocab-size", "300", "--output", str(tmp_path / "tok.json")])
    merged = HFTokenizer(tmp_path / "tok.json")
    assert len(merged.encode("gamma")) == 1  # learned from the folder's file, which a last --input alone would drop
