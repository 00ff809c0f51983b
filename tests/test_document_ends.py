"""PREFIX.ends, each document's last token beside an indexed dataset: written with the data, read instead of the
.bin by the GPT index build, written for an existing dataset by a command, and never trusted once stale."""

import warnings
from pathlib import Path

import numpy as np
import pytest

from lightning_megatron.cli import main as cli_main
from lightning_megatron.data import GPTDataset, IndexedDataset, indexed
from lightning_megatron.data.document_ends import document_ends_file
from lightning_megatron.data.file_array import FileArray
from lightning_megatron.data.gpt_dataset import split_documents
from lightning_megatron.data.indexed import IndexedDatasetWriter, data_file, index_file
from lightning_megatron.data.preprocess import preprocess

EOS = 7


def _documents(seed):
    """Documents of 0-30 tokens in 1-3 sequences; about half end with EOS, some are empty (the last one too)."""
    rng = np.random.default_rng(seed)
    documents = []
    for i in range(40):
        tokens = rng.integers(0, 20, int(rng.integers(1, 30)))
        tokens[-1] = EOS if i % 2 else (tokens[-1] if tokens[-1] != EOS else 8)
        cuts = np.sort(rng.integers(0, len(tokens) + 1, int(rng.integers(0, 3))))
        documents.append((tokens, np.diff(np.concatenate([[0], cuts, [len(tokens)]])).tolist()))
    for i in (3, 17, 39):
        documents[i] = (np.zeros(0, np.int64), [0])
    documents[10] = (documents[10][0], [0, len(documents[10][0]), 0])  # empty sequences around the tokens
    return documents


def _write(prefix, documents):
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        for tokens, sequence_lengths in documents:
            writer.add_document(tokens, sequence_lengths)
    return str(prefix)


def _memory_map_reference(prefix, documents, eos_id):
    """The document arrays as the index build computed them before PREFIX.ends: the .idx parsed here with numpy,
    each document's last token read through a memory map of the whole .bin."""
    raw = index_file(prefix).read_bytes()
    count, index_count = np.frombuffer(raw[18:34], np.uint64).astype(np.int64)
    lengths = np.frombuffer(raw, np.int32, count, 34)
    pointers = np.frombuffer(raw, np.int64, count, 34 + 4 * count)
    first_sequence = np.frombuffer(raw, np.int64, index_count, 34 + 12 * count)
    ends = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    stored = ends[first_sequence[1:]] - ends[first_sequence[:-1]]
    picked = [d for d in documents if stored[d] > 0]
    starts = pointers[first_sequence[picked]] // 2
    tokens = np.memmap(data_file(prefix), dtype=np.uint16, mode="r")
    lengths = stored[picked] + (tokens[starts + stored[picked] - 1] != eos_id)
    return {"starts": starts, "stored": stored[picked], "lengths": lengths, "tokens": [lengths.sum()]}


def _assert_same(arrays, reference):
    for name in ("starts", "stored", "lengths", "tokens"):
        assert np.array_equal(arrays[name], reference[name]), name


def test_the_index_build_gives_the_same_documents_with_the_record_without_it_and_by_the_old_memory_map(tmp_path,
                                                                                                     monkeypatch):
    documents = _documents(0)
    prefix = _write(tmp_path / "corpus", documents)
    ends = document_ends_file(prefix)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.bin", "corpus.ends", "corpus.idx"]
    dataset = IndexedDataset(prefix)
    written = [tokens[-1] if len(tokens) else 0 for tokens, _ in documents]
    assert dataset.recorded_last_tokens(range(40)).tolist() == written
    assert dataset.last_tokens_from_bin(range(40)).tolist() == written
    assert dataset.recorded_last_tokens(range(5, 12)).tolist() == written[5:12]

    for split in (range(0, 40), range(5, 23), range(39, 40)):
        reference = _memory_map_reference(prefix, split, EOS)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the record is used: nothing to say
            _assert_same(split_documents(dataset, split, EOS), reference)
            with monkeypatch.context() as patch:  # read in parts of 3 documents, empty ones at their edges
                patch.setattr(indexed, "_DOCUMENTS_PER_PASS", 3)
                _assert_same(split_documents(dataset, split, EOS), reference)

    # without the record (Megatron-LM's files): read from the .bin, said once, the same arrays
    recorded = ends.read_bytes()
    ends.unlink()
    with pytest.warns(UserWarning, match=r"corpus.ends does not exist .*`lightning-megatron document-ends "):
        _assert_same(split_documents(dataset, range(0, 40), EOS), _memory_map_reference(prefix, range(0, 40), EOS))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_same(split_documents(dataset, range(5, 23), EOS), _memory_map_reference(prefix, range(5, 23), EOS))
        monkeypatch.setattr(indexed, "_DOCUMENTS_PER_PASS", 3)
        _assert_same(split_documents(dataset, range(5, 23), EOS), _memory_map_reference(prefix, range(5, 23), EOS))
        monkeypatch.undo()

    # the command writes the record the writer wrote, and keeps one that belongs to the dataset
    idx, data = index_file(prefix).read_bytes(), data_file(prefix).read_bytes()
    cli_main(["document-ends", prefix])
    assert ends.read_bytes() == recorded
    before = ends.stat().st_mtime_ns
    cli_main(["document-ends", prefix])
    assert ends.stat().st_mtime_ns == before and ends.read_bytes() == recorded
    assert index_file(prefix).read_bytes() == idx and data_file(prefix).read_bytes() == data  # only read


def _peak_growth(function):
    """How far this process's peak resident memory (VmHWM, reset first) rises above its memory before ``function``."""
    def kib(field):
        return int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                        if line.startswith(field)).split()[1])

    Path("/proc/self/clear_refs").write_text("5")
    before = kib("VmRSS:")
    function()
    return (kib("VmHWM:") - before) * 1024


def test_the_index_build_does_not_bring_the_corpus_into_memory(tmp_path):
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(tmp_path / "corpus", dtype=np.uint16) as writer:  # 40 MB in 20k documents
        for block in range(20):
            lengths = rng.integers(200, 1800, 1000)
            tokens = rng.integers(0, 100, int(lengths.sum()), dtype=np.uint16)
            for document in np.split(tokens, np.cumsum(lengths)[:-1]):
                writer.add_document(document)
    prefix, corpus_bytes = str(tmp_path / "corpus"), data_file(tmp_path / "corpus").stat().st_size
    dataset, everything = IndexedDataset(prefix), range(20_000)
    reference = _memory_map_reference(prefix, everything, EOS)
    # the previous probe, a memory map of the .bin, holds about the corpus at its peak; the measurement sees it
    assert _peak_growth(lambda: _memory_map_reference(prefix, everything, EOS)) > 0.5 * corpus_bytes
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _peak_growth(lambda: _assert_same(split_documents(dataset, everything, EOS), reference)) < 0.05 * (
            corpus_bytes)
    document_ends_file(prefix).unlink()
    with pytest.warns(UserWarning, match="does not exist"):  # read from the .bin by pread: nothing mapped
        assert _peak_growth(lambda: _assert_same(split_documents(dataset, everything, EOS), reference)) < 0.05 * (
            corpus_bytes)


def test_preprocess_records_the_last_tokens_with_and_without_appended_eos(tmp_path):
    text = tmp_path / "in.txt"
    text.write_text("first line\nsecond\n\nthird, last\n")
    for append_eos in (False, True):
        prefix = tmp_path / f"out-{append_eos}"
        preprocess(input=text, tokenizer="byte", output_prefix=prefix, append_eos=append_eos, progress=False)
        dataset = IndexedDataset(prefix)
        expected = [256] * 3 if append_eos else [ord("e"), ord("d"), ord("t")]
        assert dataset.recorded_last_tokens(range(3)).tolist() == expected


def test_a_stale_record_is_ignored_with_its_reason_and_the_cache_stays_right(tmp_path):
    prefix = _write(tmp_path / "corpus", _documents(0))
    ends = document_ends_file(prefix)
    old_record = ends.read_bytes()
    kwargs = dict(seq_length=8, num_samples=50, seed=1, eos_id=EOS, cache_dir=tmp_path / "cache")
    GPTDataset(IndexedDataset(prefix), range(0, 40), **kwargs)

    # the corpus rewritten (other documents), the old record put back: its .idx checksum no longer matches
    new_documents = _documents(1)
    _write(prefix, new_documents)
    ends.write_bytes(old_record)
    dataset = IndexedDataset(prefix)
    with pytest.warns(UserWarning, match=r"was written for a \d+-byte .idx .* the dataset was rewritten since; it is "
                                         r"ignored: delete .*corpus.ends and run `lightning-megatron document-ends"):
        rebuilt = GPTDataset(dataset, range(0, 40), **kwargs)
    assert rebuilt.cache.built_here  # a new corpus is a new cache entry
    reference = _memory_map_reference(prefix, range(0, 40), EOS)
    assert np.array_equal(np.asarray(rebuilt._lengths), reference["lengths"])
    with pytest.raises(ValueError, match="the dataset was rewritten since. It is left as it is; delete it"):
        cli_main(["document-ends", prefix])
    assert ends.read_bytes() == old_record  # refused, not replaced

    # the .bin rewritten in place at the same size (same .idx): a changed last token is seen by the spot check
    ends.unlink()
    cli_main(["document-ends", prefix])
    data = np.fromfile(data_file(prefix), np.uint16)
    last = len(new_documents[0][0]) - 1  # document 0, the first non-empty one, is always checked
    data[last] = EOS if data[last] != EOS else 8
    data.tofile(data_file(prefix))
    with pytest.raises(ValueError, match=r"records \d+ as the last token of document 0 but corpus.bin holds \d+"):
        IndexedDataset(prefix).recorded_last_tokens(range(0, 40))

    # a truncated record, and one of another dtype's size
    ends.write_bytes(ends.read_bytes()[:-1])
    with pytest.raises(ValueError, match=r"records 40 documents of <u2 in \d+ bytes, but the dataset holds 40"):
        IndexedDataset(prefix).recorded_last_tokens(range(0, 40))
    ends.unlink()
    ends.mkdir()  # not a file at all: not used, and not replaced
    with pytest.warns(UserWarning, match=r"corpus.ends cannot be read \(\[Errno 21\] Is a directory"):
        IndexedDataset(prefix).last_tokens(range(0, 40))
    with pytest.raises(ValueError, match="Is a directory.*It is left as it is"):
        cli_main(["document-ends", prefix])
    ends.rmdir()
    ends.write_bytes(b"LMDOC")
    with pytest.warns(UserWarning, match="shorter than its"):
        assert IndexedDataset(prefix).last_tokens(range(0, 40)).tolist() == [
            data[s + n - 1] if n else 0 for s, n in zip(*IndexedDataset(prefix).document_extents(range(0, 40)))]


def test_gather_reads_any_indices_with_few_reads(tmp_path):
    path = tmp_path / "tokens.bin"
    values = np.random.default_rng(0).integers(0, 2**16, 3_000_000, dtype=np.uint16)  # 6 MB: several 1 MiB reads
    values.tofile(path)
    rng = np.random.default_rng(1)
    dense = rng.integers(0, 600_000, 20_000)  # close together: shared reads
    sparse = np.arange(1_000_000, 2_900_000, 100_000) + rng.integers(0, 1000, 19)  # far apart: one read each
    indices = np.concatenate([dense, sparse, [0, 2_999_999, 5, 5]])
    rng.shuffle(indices)
    reads = []

    class CountedReads(FileArray):
        def _read(self, start, count):
            reads.append(count)
            return super()._read(start, count)

    array = CountedReads(path, np.uint16, 0, len(values))
    assert np.array_equal(array.gather(indices), values[indices])
    # the dense 1.2 MB in two reads of at most 1 MiB, each far index (and the last item) in one of its own
    assert max(reads) <= 2**19 + 1 and len(reads) == 2 + len(sparse) + 1
    assert sum(reads) <= 600_000 + len(sparse) + 1
    assert array.gather(np.zeros(0, np.int64)).shape == (0,)
    with pytest.raises(IndexError, match="out of range"):
        array.gather([3_000_000])
