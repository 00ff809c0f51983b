"""Text to a Megatron indexed dataset, and the documents a tokenizer is trained on: the library under
``lightning-megatron preprocess``, ``document-ends`` and ``train-tokenizer`` (``commands.preprocess``).

The input is a ``.jsonl``, ``.txt`` or ``.parquet`` file, a directory written by Hugging
Face ``datasets``, a folder of such files, or several of these, read one after the other in the
order given, a folder's files sorted by path (the formats: :mod:`lightning_megatron.data.readers`).
Blank lines and empty texts are skipped and a document that tokenises to nothing is left out; an input left with
no document at all is an error (:class:`EmptyInputError`) and writes nothing. A malformed
record (invalid utf-8, invalid JSON, not an object, no ``--json-key``, a value that is not a
string, a null) is reported as ``FILE:LINE: reason`` (``FILE, row N: reason`` for parquet
and arrow); ``--on-error stop`` (the default) raises at the first one and writes nothing,
``--on-error skip`` leaves such records out and counts them.

The records are tokenised in chunks by a pool of ``--workers`` processes while the main
process reads the input and writes the results in input order. Every process encodes on one
thread (``TOKENIZERS_PARALLELISM=false``: the Hugging Face library would otherwise thread
each batch over all cores, in every worker at once), so ``--workers N`` is what uses N cores.
The output is ``PREFIX.bin`` and ``PREFIX.idx`` (Megatron-LM's format; see
:mod:`lightning_megatron.data.indexed`), ``PREFIX.ends``, each document's last token (so that
GPT index builds need not read the ``.bin``; :mod:`lightning_megatron.data.document_ends`;
``lightning-megatron document-ends PREFIX`` writes it for a dataset made elsewhere), and
``PREFIX.meta.json``, which records the tokenizer so that ``GPTDataModule(data_prefix=PREFIX)``
and ``BERTDataModule(data_prefix=PREFIX)`` know the vocabulary and end-of-document id.

Each document is one sequence of the index; with ``--split-sentences`` it is one sequence per
sentence (:mod:`lightning_megatron.data.sentences`), as Megatron-LM stores BERT data, and
``BERTDataModule`` cuts its segments at those boundaries. ``--append-eos`` ends every document
(its last sentence) with the tokenizer's end-of-document id (``[SEP]`` for WordPiece).

Example::

    lightning-megatron preprocess --input corpus.jsonl --tokenizer byte --output-prefix data/corpus --workers 4
    lightning-megatron preprocess --input books/ extra.txt --tokenizer byte --output-prefix data/all
    lightning-megatron preprocess --input wiki/ --split train --tokenizer bert.json --split-sentences \\
        --output-prefix data/wiki
"""

from __future__ import annotations

import contextlib
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tqdm import tqdm

from lightning_megatron.data.document_ends import StaleDocumentEnds, document_ends_file, write_document_ends
from lightning_megatron.data.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    check_dataset_files,
    data_file,
    index_file,
    token_dtype,
)
from lightning_megatron.data.readers import (
    Chunk,
    InputReader,
    MalformedRecord,
    open_input,
    open_inputs,
    parse_record,
)
from lightning_megatron.data.sentences import split_sentences
from lightning_megatron.data.tokenizers import Tokenizer, encode_batch, load_tokenizer

_MAX_REPORTED_SKIPS = 10  # malformed records printed one by one in skip mode; the rest are only counted


class MalformedInputError(ValueError):
    """A record of the input cannot be read as a document (raised with ``--on-error stop``)."""


class EmptyInputError(ValueError):
    """The input holds no document (an empty file, only blank lines or empty texts, every record skipped);
    nothing is written."""


@dataclass
class _RecordCounts:
    """What the records (lines or rows) of an input turned into, to say why it gave no documents."""

    records: int = 0
    blank: int = 0
    empty: int = 0  # an empty text, or one that tokenises to nothing
    skipped: int = 0
    first_skipped: str | None = None

    def no_documents_error(self, source: str, *, record_name: str, keyed: bool, json_key: str,
                           written: str) -> EmptyInputError:
        if self.records == 0:
            why = f"there is not a single {record_name} (empty input)"
        else:
            parts = [f"{self.blank} blank"] if self.blank else []
            if self.empty:
                parts.append(f"{self.empty} with an empty text" + (f" under {json_key!r}" if keyed else "")
                             + " or one that tokenises to nothing")
            if self.skipped:
                parts.append(f"{self.skipped} malformed and skipped by --on-error skip (the first: {self.first_skipped})")
            plural = "s" if self.records != 1 else ""
            why = f"{self.records} {record_name}{plural} read: " + "; ".join(parts)
        fix = (f"check that the records hold their text as a non-empty string under --json-key ({json_key!r})" if keyed
               else "give a file with at least one non-blank line")
        return EmptyInputError(f"{source} gave no documents: {why}. Nothing was written to {written}; {fix}.")


def _stop_message(where: str, reason: str) -> str:
    return f"{where}: {reason}; fix the record or skip malformed records with --on-error skip."


def iter_documents(
    path: str | os.PathLike, *, json_key: str = "text", on_error: str = "stop", split: str | None = None,
    counts: _RecordCounts | None = None,
) -> Iterator[str]:
    """The documents of one input, read in this process, with the same rules as ``preprocess``
    (``counts``, when given, is told what every record became)."""
    reader = open_input(path, json_key=json_key, split=split)
    counts = _RecordCounts() if counts is None else counts
    for number, record in reader.records():
        counts.records += 1
        try:
            text = parse_record(record, kind=reader.kind, json_key=json_key)
        except MalformedRecord as error:
            if on_error == "stop":
                raise MalformedInputError(_stop_message(reader.where(number), str(error))) from None
            counts.skipped += 1
            counts.first_skipped = counts.first_skipped or f"{reader.where(number)}: {error}"
            continue
        if text is None:
            counts.blank += 1
        elif not text:
            counts.empty += 1
        else:
            yield text


class _EncodedChunk(NamedTuple):
    tokens: np.ndarray  # the chunk's sequences back to back
    sequence_lengths: np.ndarray  # tokens per sequence
    document_sequences: np.ndarray  # sequences per document (1 unless sentences are split)
    errors: list[tuple[int, str]]  # (record number, reason) of malformed records
    blank: int = 0  # blank lines
    empty: int = 0  # records whose text is empty or tokenises to nothing

    def documents(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Each document's tokens and the lengths of its sequences."""
        token_offsets = np.concatenate([[0], np.cumsum(self.sequence_lengths)])
        sequence_offsets = np.concatenate([[0], np.cumsum(self.document_sequences)])
        for first, end in zip(sequence_offsets[:-1], sequence_offsets[1:]):
            yield self.tokens[token_offsets[first] : token_offsets[end]], self.sequence_lengths[first:end]


class _ChunkEncoder:
    """Turns a chunk of records into tokens; one lives in each worker process."""

    def __init__(self, *, tokenizer: str, json_key: str, append_eos: bool, split_sentences: bool,
                 dtype: np.dtype) -> None:
        self.tokenizer = load_tokenizer(tokenizer)
        self.json_key, self.dtype = json_key, dtype
        self.append_eos, self.split_sentences = append_eos, split_sentences

    def __call__(self, chunk: Chunk) -> _EncodedChunk:
        documents, errors, blank, empty = [], [], 0, 0  # documents: each a list of its texts (sentences)
        for number, record in chunk.records:
            try:
                text = parse_record(record, kind=chunk.kind, json_key=self.json_key)
            except MalformedRecord as error:
                errors.append((number, str(error)))
                continue
            if text is None:
                blank += 1
            elif not text:
                empty += 1
            else:
                documents.append(split_sentences(text) if self.split_sentences else [text])
        encoded = iter(encode_batch(self.tokenizer, [text for texts in documents for text in texts]))
        sequences, document_sequences = [], []
        for texts in documents:
            ids = [sequence for sequence in itertools.islice(encoded, len(texts)) if sequence]
            if not ids:
                empty += 1
                continue
            if self.append_eos:
                ids[-1] = ids[-1] + [self.tokenizer.eos_id]
            sequences += ids
            document_sequences.append(len(ids))
        lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
        tokens = np.fromiter(itertools.chain.from_iterable(sequences), dtype=self.dtype, count=int(lengths.sum()))
        return _EncodedChunk(tokens, lengths, np.array(document_sequences, dtype=np.int64), errors, blank, empty)


_worker_encoder: _ChunkEncoder | None = None


def _start_worker(encoder_kwargs: dict[str, Any]) -> None:
    global _worker_encoder
    _worker_encoder = _ChunkEncoder(**encoder_kwargs)


def _encode_in_worker(chunk: Chunk) -> _EncodedChunk:
    assert _worker_encoder is not None, "worker started without _start_worker"
    return _worker_encoder(chunk)


@contextlib.contextmanager
def _single_threaded_tokenizers() -> Iterator[None]:
    """``TOKENIZERS_PARALLELISM=false`` while preprocessing, restored afterwards. The library reads it at every
    call, and workers inherit it; set before they are forked, it also spares each of them the library's warning
    about a fork after its thread pool was used."""
    name, before = "TOKENIZERS_PARALLELISM", os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ[name] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _encode_chunks(
    chunks: Iterable[tuple[InputReader, Chunk]], *, workers: int, encoder_kwargs: dict[str, Any]
) -> Iterator[tuple[InputReader, Chunk, _EncodedChunk]]:
    """Each chunk (with its reader) and its encoding, in input order.

    At most ``2 * workers`` chunks are in flight, so memory stays flat however large the
    input (``Pool.imap`` would read ahead without bound). Workers are forked on Linux: they
    run only tokenisation, and a fork skips re-importing torch and Lightning in each one.
    """
    with _single_threaded_tokenizers():
        if workers == 1:
            encoder = _ChunkEncoder(**encoder_kwargs)
            for reader, chunk in chunks:
                yield reader, chunk, encoder(chunk)
            return
        context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        with context.Pool(workers, initializer=_start_worker, initargs=(encoder_kwargs,)) as pool:
            in_flight: deque = deque()
            for reader, chunk in chunks:
                in_flight.append((reader, chunk, pool.apply_async(_encode_in_worker, (chunk,))))
                if len(in_flight) >= 2 * workers:
                    reader_done, chunk_done, result = in_flight.popleft()
                    yield reader_done, chunk_done, result.get()
            while in_flight:
                reader_done, chunk_done, result = in_flight.popleft()
                yield reader_done, chunk_done, result.get()


@dataclass(frozen=True)
class PreprocessResult:
    documents: int
    tokens: int
    skipped_lines: int  # malformed records skipped: lines, or rows of parquet and arrow
    seconds: float
    record_name: str = "line"

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


@contextlib.contextmanager
def _output_directory(directory: Path) -> Iterator[None]:
    """Create ``directory`` and its missing parents; remove those created here again (they are then empty)
    when the body fails, so a failed run leaves nothing behind."""
    created = [d for d in (directory, *directory.parents) if not d.exists()]  # deepest first
    directory.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for new_directory in created:
            with contextlib.suppress(OSError):
                new_directory.rmdir()
        raise


def metadata_file(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.meta.json")


def read_metadata(prefix: str | os.PathLike) -> dict[str, Any] | None:
    """What ``preprocess`` recorded about the dataset at ``prefix``; ``None`` when it has no record
    (e.g. data made by Megatron-LM's own tools)."""
    path = metadata_file(prefix)
    return json.loads(path.read_text()) if path.is_file() else None


def load_dataset_tokenizer(prefix: str, spec: str | None = None) -> Tokenizer:
    """The tokenizer the indexed dataset at ``prefix`` was made with: ``spec`` (``"byte"`` or a
    ``tokenizer.json``), else the one ``preprocess`` recorded in ``PREFIX.meta.json``.

    Raises ``FileNotFoundError`` for a prefix without its ``.bin``/``.idx`` (naming the datasets
    close to it), and ``ValueError`` when there is neither ``spec`` nor a record, or when
    ``spec``'s vocabulary is not the recorded one.
    """
    check_dataset_files(prefix, argument="data_prefix")  # before the tokenizer: no files, no advice on it
    metadata = read_metadata(prefix)
    if spec is None and metadata is None:
        raise ValueError(
            f"data_prefix={prefix!r} has no {metadata_file(prefix).name} naming its tokenizer (it was not written by "
            f"`lightning-megatron preprocess`); pass tokenizer='byte' or the path of the tokenizer.json the data was "
            f"made with."
        )
    tokenizer = load_tokenizer(spec if spec is not None else metadata["tokenizer"])
    if metadata is not None and tokenizer.vocab_size != metadata["vocab_size"]:
        raise ValueError(
            f"tokenizer={spec!r} has {tokenizer.vocab_size} ids but data_prefix={prefix!r} was made with "
            f"{metadata['tokenizer']!r} ({metadata['vocab_size']} ids); pass that tokenizer or leave tokenizer unset."
        )
    return tokenizer


def preprocess(
    *,
    input: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer: str,
    output_prefix: str | os.PathLike,
    json_key: str = "text",
    workers: int = 1,
    on_error: str = "stop",
    append_eos: bool = False,
    split_sentences: bool = False,
    split: str | None = None,
    progress: bool = True,
) -> PreprocessResult:
    """Tokenise ``input`` into the indexed dataset ``output_prefix`` (see the module docstring).

    ``input``: one input or a list of them (files, folders of files, datasets directories), read in that order;
    the documents of all of them make one dataset.

    ``append_eos`` ends every stored document with the tokenizer's end-of-document id, as
    Megatron-LM's ``--append-eod`` does (Megatron's GPT dataset relies on it; ``GPTDataModule``
    accepts data with or without it). ``split_sentences`` stores each sentence of a document as
    a sequence of its own, for BERT. ``split`` names the split of a Hugging Face ``DatasetDict``
    directory.
    """
    if on_error not in ("skip", "stop"):
        raise ValueError(f"on_error must be 'skip' or 'stop', got {on_error!r}.")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}.")
    readers = open_inputs(input, json_key=json_key, split=split)
    tokenizer_spec = tokenizer if tokenizer == "byte" else str(Path(tokenizer).resolve())
    loaded = load_tokenizer(tokenizer_spec)
    dtype = token_dtype(loaded.vocab_size)
    encoder_kwargs = dict(tokenizer=tokenizer_spec, json_key=json_key, append_eos=append_eos,
                          split_sentences=split_sentences, dtype=dtype)

    start, skipped, counts = time.perf_counter(), 0, _RecordCounts()
    units = [reader.progress_unit for reader in readers]
    unit = "B" if "B" in units else units[0]  # over inputs of both kinds the bar counts the line files' bytes
    bar = tqdm(total=sum(reader.progress_total() for reader in readers if reader.progress_unit == unit), unit=unit,
               unit_scale=True, desc=f"preprocess {_inputs_named(readers, short=True)}", disable=not progress,
               file=sys.stderr)
    encoded_chunks = _encode_chunks(((reader, chunk) for reader in readers for chunk in reader.chunks()),
                                    workers=workers, encoder_kwargs=encoder_kwargs)
    # closing() stops the worker pool at once when a malformed record ends the run
    with (_output_directory(Path(output_prefix).parent), bar,
          IndexedDatasetWriter(output_prefix, dtype=dtype) as writer, contextlib.closing(encoded_chunks)):
        for reader, chunk, encoded in encoded_chunks:
            counts.records += len(chunk.records)
            counts.blank, counts.empty = counts.blank + encoded.blank, counts.empty + encoded.empty
            for number, reason in encoded.errors:
                if on_error == "stop":
                    raise MalformedInputError(_stop_message(reader.where(number), reason))
                message = f"{reader.where(number)}: {reason}"
                counts.first_skipped = counts.first_skipped or message
                skipped += 1
                if skipped <= _MAX_REPORTED_SKIPS:
                    bar.write(f"skipped {message}", file=sys.stderr)
            for tokens, sequence_lengths in encoded.documents():
                writer.add_document(tokens, sequence_lengths)
            bar.update(chunk.progress if reader.progress_unit == unit else 0)
        documents, tokens = writer.num_documents, writer.num_tokens
        if documents == 0:  # raised inside the writer: it deletes its temporary files, an old dataset stays
            counts.skipped = skipped
            raise counts.no_documents_error(_inputs_named(readers), record_name=_record_name(readers),
                                            keyed=any(r.keyed for r in readers), json_key=json_key,
                                            written=f"{output_prefix}.bin/.idx/.ends/.meta.json")
        # The new .bin/.idx replace the old ones as the writer closes; a crash before the new record
        # is written then leaves no record rather than the old tokenizer's, which would misdescribe them.
        meta_path = metadata_file(output_prefix)
        meta_path.unlink(missing_ok=True)
    result = PreprocessResult(documents, tokens, skipped, time.perf_counter() - start, _record_name(readers))

    read = [str(reader.path.resolve()) for reader in readers]
    metadata = dict(tokenizer=tokenizer_spec, vocab_size=loaded.vocab_size, eos_id=loaded.eos_id,
                    append_eos=append_eos, split_sentences=split_sentences, input=read[0] if len(read) == 1 else read,
                    documents=documents, sequences=writer.num_sequences, tokens=tokens, skipped_lines=skipped)
    tmp = meta_path.with_name(meta_path.name + ".tmp")
    tmp.write_text(json.dumps(metadata, indent=2) + "\n")
    os.replace(tmp, meta_path)
    return result


def _inputs_named(readers: Sequence[InputReader], *, short: bool = False) -> str:
    """The inputs read, for messages (``short``: for the progress bar)."""
    if len(readers) == 1:
        return readers[0].path.name if short else str(readers[0].path)
    return f"{len(readers)} inputs" if short else f"--input {', '.join(str(r.path) for r in readers)}"


def _record_name(readers: Sequence[InputReader]) -> str:
    names = {reader.record_name for reader in readers}
    return names.pop() if len(names) == 1 else "record"


def training_texts(files: Sequence[Path], *, json_key: str, split: str | None, on_error: str,
                   output: str) -> Iterator[str]:
    """The documents of ``files`` read as :func:`preprocess` reads them, for training a tokenizer written to
    ``output``. Opens every input and reads the first document at once, so that a bad input, or inputs without a
    document (:class:`EmptyInputError`), fail before anything is trained or written."""
    counts = _RecordCounts()
    readers = open_inputs(files, json_key=json_key, split=split)
    texts = (text for path in files
             for text in iter_documents(path, json_key=json_key, on_error=on_error, split=split, counts=counts))
    first = next(texts, None)
    if first is None:
        raise counts.no_documents_error(_inputs_named(readers), record_name=_record_name(readers),
                                        keyed=any(reader.keyed for reader in readers), json_key=json_key,
                                        written=output)
    return itertools.chain([first], texts)


def write_document_ends_of(prefix: str | os.PathLike) -> str:
    """Write ``PREFIX.ends`` (:mod:`lightning_megatron.data.document_ends`) for the existing dataset at ``prefix``,
    reading each document's last token from its ``.bin``; what was done, in words. The ``.bin``/``.idx`` are
    only read, and an existing ``PREFIX.ends`` is never replaced: one that belongs to the dataset is kept, a
    stale one is refused (``ValueError``) for the user to delete."""
    dataset, path = IndexedDataset(prefix), document_ends_file(prefix)
    everything = range(dataset.num_documents)
    if path.exists():
        try:
            dataset.recorded_last_tokens(everything)
        except (StaleDocumentEnds, OSError) as error:
            raise ValueError(f"{error}. It is left as it is; delete it and run this command again.") from None
        return f"{path}: already records the {dataset.num_documents} documents; nothing written"
    start = time.perf_counter()
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        write_document_ends(tmp, dataset.last_tokens_from_bin(everything), dtype=dataset.dtype,
                            idx_path=index_file(prefix), bin_path=data_file(prefix))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return (f"{path}: the last tokens of {dataset.num_documents} documents, {path.stat().st_size:,} bytes, in "
            f"{time.perf_counter() - start:.1f} s")
