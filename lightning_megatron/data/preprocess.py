"""Text to a Megatron indexed dataset (``lightning-megatron preprocess``), and BPE tokenizer training.

Input formats, chosen by the file's suffix:

* ``.jsonl``: one JSON object per line; the document is the string under ``--json-key``.
* ``.txt``: one document per line (so a document cannot hold a newline).

In both, blank lines are skipped and a document that tokenises to nothing is left out; an
input left with no document at all is an error (:class:`EmptyInputError`) and writes nothing. A
malformed line (invalid utf-8, invalid JSON, not an object, no ``--json-key``, a value that
is not a string) is reported as ``FILE:LINE: reason``; ``--on-error stop`` (the default)
raises at the first one and writes nothing, ``--on-error skip`` leaves such lines out and
counts them.

Lines are tokenised in chunks by a pool of ``--workers`` processes while the main process
reads the file and writes the results in file order. The output is ``PREFIX.bin`` and
``PREFIX.idx`` (Megatron-LM's format, one sequence per document; see
:mod:`lightning_megatron.data.indexed`) and ``PREFIX.meta.json``, which records the tokenizer
so that ``GPTDataModule(data_prefix=PREFIX)`` knows the vocabulary and end-of-document id.

Example::

    lightning-megatron preprocess --input corpus.jsonl --tokenizer byte --output-prefix data/corpus --workers 4
"""

from __future__ import annotations

import argparse
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

from lightning_megatron.data.indexed import IndexedDatasetWriter, token_dtype
from lightning_megatron.data.tokenizers import load_tokenizer, train_bpe_tokenizer

_CHUNK_BYTES = 1 << 20  # lines per task: enough text that process overhead is small, few enough to stream
_MAX_REPORTED_SKIPS = 10  # malformed lines printed one by one in skip mode; the rest are only counted


class MalformedInputError(ValueError):
    """A line of the input cannot be read as a document (raised with ``--on-error stop``)."""


class EmptyInputError(ValueError):
    """The input holds no document (an empty file, only blank lines or empty texts, every line skipped);
    nothing is written."""


class _MalformedLine(Exception):
    """A line's problem, before the file name and line number are attached."""


@dataclass
class _LineCounts:
    """What the lines of an input turned into, to say why it gave no documents."""

    lines: int = 0
    blank: int = 0
    empty: int = 0  # an empty text, or one that tokenises to nothing
    skipped: int = 0
    first_skipped: str | None = None

    def no_documents_error(self, source: str, *, jsonl: bool, json_key: str, written: str) -> EmptyInputError:
        if self.lines == 0:
            why = "there is not a single line (empty input)"
        else:
            parts = [f"{self.blank} blank"] if self.blank else []
            if self.empty:
                parts.append(f"{self.empty} with an empty text" + (f" under {json_key!r}" if jsonl else "")
                             + " or one that tokenises to nothing")
            if self.skipped:
                parts.append(f"{self.skipped} malformed and skipped by --on-error skip (the first: {self.first_skipped})")
            why = f"{self.lines} line{'s' if self.lines != 1 else ''} read: " + "; ".join(parts)
        fix = (f"check that the records hold their text as a non-empty string under --json-key ({json_key!r})" if jsonl
               else "give a file with at least one non-blank line")
        return EmptyInputError(f"{source} gave no documents: {why}. Nothing was written to {written}; {fix}.")


def _is_jsonl(path: Path) -> bool:
    if path.suffix not in (".txt", ".jsonl"):
        raise ValueError(f"Input {path} must end in .jsonl (one JSON object per line) or .txt (one document per line).")
    return path.suffix == ".jsonl"


def parse_line(raw: bytes, *, jsonl: bool, json_key: str) -> str | None:
    """The document text of one raw input line, or ``None`` for a blank line.

    Raises ``_MalformedLine`` with the reason when the line cannot be a document.
    """
    if not raw.strip():
        return None
    try:
        line = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as error:
        raise _MalformedLine(f"invalid utf-8 ({error.reason} at byte {error.start})") from None
    if not jsonl:
        return line
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise _MalformedLine(f"invalid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise _MalformedLine(f"expected a JSON object, got {type(record).__name__}")
    if json_key not in record:
        raise _MalformedLine(f"no key {json_key!r} (keys: {', '.join(map(repr, record)) or 'none'})")
    text = record[json_key]
    if not isinstance(text, str):
        raise _MalformedLine(f"{json_key!r} is a {type(text).__name__}, not a string")
    return text


def _malformed(path: Path, line_number: int, reason: str) -> str:
    return f"{path}:{line_number}: {reason}"


def iter_documents(
    path: str | os.PathLike, *, json_key: str = "text", on_error: str = "stop", counts: _LineCounts | None = None
) -> Iterator[str]:
    """The documents of one input file, read in this process, with the same rules as ``preprocess``
    (``counts``, when given, is told what every line became)."""
    path = Path(path)
    jsonl = _is_jsonl(path)
    counts = _LineCounts() if counts is None else counts
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            counts.lines += 1
            try:
                text = parse_line(raw, jsonl=jsonl, json_key=json_key)
            except _MalformedLine as error:
                if on_error == "stop":
                    raise MalformedInputError(f"{_malformed(path, line_number, str(error))}; fix the line or skip "
                                              f"malformed lines with --on-error skip.") from None
                counts.skipped += 1
                counts.first_skipped = counts.first_skipped or _malformed(path, line_number, str(error))
                continue
            if text is None:
                counts.blank += 1
            elif not text:
                counts.empty += 1
            else:
                yield text


class _Chunk(NamedTuple):
    lines: list[tuple[int, bytes]]  # (line number, raw line)
    num_bytes: int


class _EncodedChunk(NamedTuple):
    tokens: np.ndarray  # the chunk's documents back to back
    lengths: list[int]  # tokens per document
    errors: list[tuple[int, str]]  # (line number, reason) of malformed lines
    blank: int = 0  # blank lines
    empty: int = 0  # lines whose text is empty or tokenises to nothing


class _ChunkEncoder:
    """Turns a chunk of raw lines into tokens; one lives in each worker process."""

    def __init__(self, *, tokenizer: str, jsonl: bool, json_key: str, append_eos: bool, dtype: np.dtype) -> None:
        self.tokenizer = load_tokenizer(tokenizer)
        self.jsonl, self.json_key, self.append_eos, self.dtype = jsonl, json_key, append_eos, dtype

    def __call__(self, chunk: _Chunk) -> _EncodedChunk:
        documents, errors, blank, empty = [], [], 0, 0
        for line_number, raw in chunk.lines:
            try:
                text = parse_line(raw, jsonl=self.jsonl, json_key=self.json_key)
            except _MalformedLine as error:
                errors.append((line_number, str(error)))
                continue
            ids = self.tokenizer.encode(text) if text else []
            if ids:
                documents.append(np.array(ids + [self.tokenizer.eos_id] if self.append_eos else ids, dtype=self.dtype))
            elif text is None:
                blank += 1
            else:
                empty += 1
        tokens = np.concatenate(documents) if documents else np.empty(0, self.dtype)
        return _EncodedChunk(tokens, [len(ids) for ids in documents], errors, blank, empty)


_worker_encoder: _ChunkEncoder | None = None


def _start_worker(encoder_kwargs: dict[str, Any]) -> None:
    global _worker_encoder
    _worker_encoder = _ChunkEncoder(**encoder_kwargs)


def _encode_in_worker(chunk: _Chunk) -> _EncodedChunk:
    assert _worker_encoder is not None, "worker started without _start_worker"
    return _worker_encoder(chunk)


def _read_chunks(path: Path) -> Iterator[_Chunk]:
    with open(path, "rb") as f:
        lines, num_bytes = [], 0
        for line_number, raw in enumerate(f, start=1):
            lines.append((line_number, raw))
            num_bytes += len(raw)
            if num_bytes >= _CHUNK_BYTES:
                yield _Chunk(lines, num_bytes)
                lines, num_bytes = [], 0
        if lines:
            yield _Chunk(lines, num_bytes)


def _encode_chunks(
    chunks: Iterable[_Chunk], *, workers: int, encoder_kwargs: dict[str, Any]
) -> Iterator[tuple[_Chunk, _EncodedChunk]]:
    """Each chunk with its encoding, in input order.

    At most ``2 * workers`` chunks are in flight, so memory stays flat however large the
    file (``Pool.imap`` would read ahead without bound). Workers are forked on Linux: they
    run only tokenisation, and a fork skips re-importing torch and Lightning in each one.
    """
    if workers == 1:
        encoder = _ChunkEncoder(**encoder_kwargs)
        for chunk in chunks:
            yield chunk, encoder(chunk)
        return
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with context.Pool(workers, initializer=_start_worker, initargs=(encoder_kwargs,)) as pool:
        in_flight: deque = deque()
        for chunk in chunks:
            in_flight.append((chunk, pool.apply_async(_encode_in_worker, (chunk,))))
            if len(in_flight) >= 2 * workers:
                chunk_done, result = in_flight.popleft()
                yield chunk_done, result.get()
        while in_flight:
            chunk_done, result = in_flight.popleft()
            yield chunk_done, result.get()


@dataclass(frozen=True)
class PreprocessResult:
    documents: int
    tokens: int
    skipped_lines: int
    seconds: float

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


def preprocess(
    *,
    input: str | os.PathLike,
    tokenizer: str,
    output_prefix: str | os.PathLike,
    json_key: str = "text",
    workers: int = 1,
    on_error: str = "stop",
    append_eos: bool = False,
    progress: bool = True,
) -> PreprocessResult:
    """Tokenise ``input`` into the indexed dataset ``output_prefix`` (see the module docstring).

    ``append_eos`` ends every stored document with the tokenizer's end-of-document id, as
    Megatron-LM's ``--append-eod`` does (Megatron's GPT dataset relies on it; ``GPTDataModule``
    accepts data with or without it).
    """
    path = Path(input)
    if not path.is_file():
        raise FileNotFoundError(f"Input file {path} does not exist.")
    if on_error not in ("skip", "stop"):
        raise ValueError(f"on_error must be 'skip' or 'stop', got {on_error!r}.")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}.")
    tokenizer_spec = tokenizer if tokenizer == "byte" else str(Path(tokenizer).resolve())
    loaded = load_tokenizer(tokenizer_spec)
    dtype = token_dtype(loaded.vocab_size)
    encoder_kwargs = dict(tokenizer=tokenizer_spec, jsonl=_is_jsonl(path), json_key=json_key,
                          append_eos=append_eos, dtype=dtype)

    start, skipped, counts = time.perf_counter(), 0, _LineCounts()
    bar = tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=f"preprocess {path.name}",
               disable=not progress, file=sys.stderr)
    encoded_chunks = _encode_chunks(_read_chunks(path), workers=workers, encoder_kwargs=encoder_kwargs)
    # closing() stops the worker pool at once when a malformed line ends the run
    with _output_directory(Path(output_prefix).parent), bar, IndexedDatasetWriter(output_prefix, dtype=dtype) as writer, \
            contextlib.closing(encoded_chunks):
        for chunk, encoded in encoded_chunks:
            counts.lines, counts.blank, counts.empty = (counts.lines + len(chunk.lines), counts.blank + encoded.blank,
                                                        counts.empty + encoded.empty)
            for line_number, reason in encoded.errors:
                message = _malformed(path, line_number, reason)
                if on_error == "stop":
                    raise MalformedInputError(f"{message}; fix the line or skip malformed lines with --on-error skip.")
                counts.first_skipped = counts.first_skipped or message
                skipped += 1
                if skipped <= _MAX_REPORTED_SKIPS:
                    bar.write(f"skipped {message}", file=sys.stderr)
            ends = np.cumsum(encoded.lengths)
            for document in np.split(encoded.tokens, ends[:-1]) if encoded.lengths else ():
                writer.add_document(document)
            bar.update(chunk.num_bytes)
        documents, tokens = writer.num_documents, writer.num_tokens
        if documents == 0:  # raised inside the writer: it deletes its temporary files, an old dataset stays
            counts.skipped = skipped
            raise counts.no_documents_error(str(path), jsonl=encoder_kwargs["jsonl"], json_key=json_key,
                                            written=f"{output_prefix}.bin/.idx/.meta.json")
        # The new .bin/.idx replace the old ones as the writer closes; a crash before the new record
        # is written then leaves no record rather than the old tokenizer's, which would misdescribe them.
        meta_path = metadata_file(output_prefix)
        meta_path.unlink(missing_ok=True)
    result = PreprocessResult(documents, tokens, skipped, time.perf_counter() - start)

    metadata = dict(tokenizer=tokenizer_spec, vocab_size=loaded.vocab_size, eos_id=loaded.eos_id,
                    append_eos=append_eos, input=str(path.resolve()), documents=documents, tokens=tokens,
                    skipped_lines=skipped)
    tmp = meta_path.with_name(meta_path.name + ".tmp")
    tmp.write_text(json.dumps(metadata, indent=2) + "\n")
    os.replace(tmp, meta_path)
    return result


def main(argv: Sequence[str] | None = None) -> None:
    """``lightning-megatron preprocess``: see the module docstring."""
    parser = argparse.ArgumentParser(
        prog="lightning-megatron preprocess",
        description="Tokenise a .jsonl (one JSON object per line) or .txt (one document per line) file into a "
        "Megatron-LM indexed dataset PREFIX.bin/PREFIX.idx plus PREFIX.meta.json.",
    )
    parser.add_argument("--input", required=True, help="a .jsonl or .txt file")
    parser.add_argument("--tokenizer", required=True, help="'byte' or the path of a Hugging Face tokenizer.json")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json")
    parser.add_argument("--json-key", default="text", help="the key holding a document's text in .jsonl input")
    parser.add_argument("--workers", type=int, default=1, help="tokenising processes")
    parser.add_argument("--on-error", choices=("skip", "stop"), default="stop",
                        help="on a malformed line: stop with an error (default), or skip it and count it")
    parser.add_argument("--append-eos", action="store_true", help="end each document with the end-of-document id")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    result = preprocess(input=args.input, tokenizer=args.tokenizer, output_prefix=args.output_prefix,
                        json_key=args.json_key, workers=args.workers, on_error=args.on_error,
                        append_eos=args.append_eos, progress=not args.no_progress)
    skipped = f", {result.skipped_lines} malformed lines skipped" if result.skipped_lines else ""
    print(f"{args.output_prefix}: {result.documents} documents, {result.tokens} tokens in {result.seconds:.1f} s "
          f"({result.tokens_per_second:,.0f} tokens/s, {args.workers} workers){skipped}")


def train_tokenizer_main(argv: Sequence[str] | None = None) -> None:
    """``lightning-megatron train-tokenizer``: a byte-level BPE ``tokenizer.json`` from .jsonl/.txt files."""
    parser = argparse.ArgumentParser(
        prog="lightning-megatron train-tokenizer",
        description="Train a byte-level BPE tokenizer (with an <|endoftext|> token) on .jsonl/.txt files, offline.",
    )
    parser.add_argument("--input", nargs="+", required=True, help=".jsonl or .txt files, read as by preprocess")
    parser.add_argument("--vocab-size", type=int, required=True, help="ids in the vocabulary, special tokens included")
    parser.add_argument("--output", required=True, help="the tokenizer.json to write")
    parser.add_argument("--json-key", default="text", help="the key holding a document's text in .jsonl input")
    parser.add_argument("--on-error", choices=("skip", "stop"), default="stop", help="on a malformed line")
    args = parser.parse_args(argv)
    counts = _LineCounts()
    texts = (text for path in args.input
             for text in iter_documents(path, json_key=args.json_key, on_error=args.on_error, counts=counts))
    first = next(texts, None)  # an input without documents fails here, before anything is trained or written
    if first is None:
        raise counts.no_documents_error(f"--input {', '.join(args.input)}", jsonl=any(
            Path(path).suffix == ".jsonl" for path in args.input), json_key=args.json_key, written=args.output)
    tokenizer = train_bpe_tokenizer(itertools.chain([first], texts), vocab_size=args.vocab_size,
                                    output_path=args.output)
    print(f"{args.output}: byte-level BPE, {tokenizer.vocab_size} ids, end of document {tokenizer.eos_token!r} "
          f"= {tokenizer.eos_id}")
