"""The input formats of ``lightning-megatron preprocess`` and ``train-tokenizer``: records to document texts.

Chosen by the input's path:

* ``FILE.jsonl``: one JSON object per line; the document is the string under ``--json-key``.
* ``FILE.txt``: one document per line (so a document cannot hold a newline).
* ``FILE.parquet``: one document per row, in the string column ``--json-key``; read one record
  batch at a time, so memory stays flat whatever the file's size.
* a directory written by Hugging Face ``datasets``' ``Dataset.save_to_disk`` (``state.json``
  and ``data-*.arrow`` files): one document per row of the column ``--json-key``, the arrow
  files memory-mapped and read batch by batch in the dataset's order. A ``DatasetDict``
  directory (``dataset_dict.json``, one sub-directory per split) needs ``split``
  (``--split``) to name one.
* any other folder: every ``.jsonl``, ``.txt`` and ``.parquet`` file under it (sub-folders included, hidden
  ones not), read in the order of their paths within it, sorted, so that the dataset written does not depend on
  the order the file system lists them in (:func:`input_files`).

Several inputs are read one after the other, in the order given.

Parquet and arrow need the optional ``pyarrow`` (``pip install 'lightning-megatron[datasets]'``);
the ``datasets`` library itself is not needed to read them.

A reader cuts its records into :class:`Chunk` s of about ``chunk_bytes`` of text, which
preprocessing hands to its worker processes; :func:`parse_record` turns one record into its
text there. Blank lines and empty texts are no documents. A record that cannot be a document
(invalid utf-8 or JSON, not an object, no ``--json-key``, a value that is not a string, a null)
raises :class:`MalformedRecord` with the reason, which the caller reports as ``WHERE: reason``.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import NamedTuple, Optional, Union

LINE_SUFFIXES = (".jsonl", ".txt")
PARQUET_SUFFIX = ".parquet"
_ROWS_PER_BATCH = 1024  # rows pyarrow decodes at a time; chunks gather batches up to chunk_bytes
CHUNK_BYTES = 1 << 20  # text per chunk: enough that handing it to a worker costs little, few enough to stream


class MalformedRecord(Exception):
    """A record's problem, before its place in the input is attached."""


#: A record as read: a raw line (``bytes``) of a line format, or a column value (``str``, ``None`` for a null).
Record = Union[bytes, str, None]


class Chunk(NamedTuple):
    records: list[tuple[int, Record]]  # (line or row number, counted from 1; the record)
    progress: int  # how far the chunk moves the progress bar, in the reader's progress_unit
    kind: str  # the reader's kind ("jsonl", "txt" or "column"): how parse_record reads the records


def _import_pyarrow() -> ModuleType:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as error:
        raise ImportError(
            "Reading .parquet files and Hugging Face datasets directories needs the optional `pyarrow` package: "
            "pip install 'lightning-megatron[datasets]'  (or give a .jsonl or .txt file)."
        ) from error
    return pyarrow


def parse_record(record: Record, *, kind: str, json_key: str) -> str | None:
    """The document text of one record of an input of ``kind`` (:attr:`InputReader.kind`); ``None`` for a blank line.

    Raises :class:`MalformedRecord` with the reason when the record cannot be a document.
    """
    if kind == "column":
        if record is None:
            raise MalformedRecord(f"{json_key!r} is null")
        return record
    if not record.strip():
        return None
    try:
        line = record.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as error:
        raise MalformedRecord(f"invalid utf-8 ({error.reason} at byte {error.start})") from None
    if kind == "txt":
        return line
    try:
        value = json.loads(line)
    except json.JSONDecodeError as error:
        raise MalformedRecord(f"invalid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(value, dict):
        raise MalformedRecord(f"expected a JSON object, got {type(value).__name__}")
    if json_key not in value:
        raise MalformedRecord(f"no key {json_key!r} (keys: {', '.join(map(repr, value)) or 'none'})")
    text = value[json_key]
    if not isinstance(text, str):
        raise MalformedRecord(f"{json_key!r} is a {type(text).__name__}, not a string")
    return text


class InputReader(ABC):
    """An input's records, in order, cut into chunks.

    ``kind`` is ``"jsonl"``, ``"txt"`` or ``"column"`` (parquet and arrow), which is all that
    :func:`parse_record` needs to know; ``record_name`` is ``"line"`` or ``"row"``, for messages.
    """

    def __init__(self, path: Path, kind: str, json_key: str) -> None:
        self.path, self.kind, self.json_key = path, kind, json_key

    @property
    def record_name(self) -> str:
        return "row" if self.kind == "column" else "line"

    @property
    def keyed(self) -> bool:
        """Whether documents are found under ``json_key`` (every format but .txt)."""
        return self.kind != "txt"

    def where(self, number: int) -> str:
        """The place of record ``number`` for a message: ``FILE:LINE`` or ``FILE, row N``."""
        return f"{self.path}:{number}" if self.kind != "column" else f"{self.path}, row {number}"

    @property
    def progress_unit(self) -> str:
        return "B" if self.kind != "column" else "rows"

    @abstractmethod
    def progress_total(self) -> int:
        """The progress bar's end, in :attr:`progress_unit`."""

    @abstractmethod
    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[Chunk]:
        """The records in order, cut into chunks of about ``chunk_bytes`` of text."""

    def records(self) -> Iterator[tuple[int, Record]]:
        """Every record with its number, read in this process."""
        for chunk in self.chunks():
            yield from chunk.records


class LineReader(InputReader):
    """A .jsonl or .txt file: raw lines, decoded by the workers (so reading costs the main process little)."""

    def progress_total(self) -> int:
        return self.path.stat().st_size

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[Chunk]:
        with open(self.path, "rb") as f:
            records, size = [], 0
            for number, raw in enumerate(f, start=1):
                records.append((number, raw))
                size += len(raw)
                if size >= chunk_bytes:
                    yield Chunk(records, size, self.kind)
                    records, size = [], 0
            if records:
                yield Chunk(records, size, self.kind)


class _ColumnReader(InputReader):
    """Rows of one string column, from pyarrow record batches; the texts travel to the workers already decoded."""

    @abstractmethod
    def _batches(self) -> Iterator:
        """pyarrow RecordBatches holding the text column, in row order."""

    def _check_column(self, schema, source: str) -> None:
        pa = _import_pyarrow()
        columns = ", ".join(f"{name!r} ({field_type})" for name, field_type in zip(schema.names, schema.types))
        if self.json_key not in schema.names:
            raise ValueError(f"{source} has no column {self.json_key!r}; its columns are {columns}. Name the column "
                             f"that holds the text with --json-key.")
        field_type = schema.field(self.json_key).type
        if not (pa.types.is_string(field_type) or pa.types.is_large_string(field_type)):
            raise ValueError(f"Column {self.json_key!r} of {source} is {field_type}, not a string; its columns are "
                             f"{columns}. Name the column that holds the text with --json-key.")

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[Chunk]:
        records, size, number = [], 0, 0
        for batch in self._batches():
            for text in batch.column(self.json_key).to_pylist():  # a chunk may end inside a batch of long texts
                number += 1
                records.append((number, text))
                size += len(text) if text is not None else 0
                if size >= chunk_bytes:
                    yield Chunk(records, len(records), self.kind)
                    records, size = [], 0
        if records:
            yield Chunk(records, len(records), self.kind)


class ParquetReader(_ColumnReader):
    def __init__(self, path: Path, json_key: str) -> None:
        super().__init__(path, "column", json_key)
        pa = _import_pyarrow()
        try:
            self._file = pa.parquet.ParquetFile(self.path)
        except pa.ArrowException as error:
            raise ValueError(f"{self.path} is not a readable parquet file: {error}") from None
        self._check_column(self._file.schema_arrow, str(self.path))

    def progress_total(self) -> int:
        return self._file.metadata.num_rows

    def _batches(self) -> Iterator:
        return self._file.iter_batches(batch_size=_ROWS_PER_BATCH, columns=[self.json_key])


class ArrowDatasetReader(_ColumnReader):
    """A ``Dataset.save_to_disk`` directory: its ``state.json`` lists the arrow files (IPC streams) in row order."""

    def __init__(self, path: Path, json_key: str) -> None:
        super().__init__(path, "column", json_key)
        _import_pyarrow()
        state = json.loads((self.path / "state.json").read_text())
        self.files = [self.path / entry["filename"] for entry in state.get("_data_files", [])]
        missing = [str(file) for file in self.files if not file.is_file()]
        if not self.files or missing:
            raise FileNotFoundError(
                f"{self.path / 'state.json'} lists the arrow files {[file.name for file in self.files]}, but "
                f"{', '.join(missing) or 'none'} {'are' if len(missing) != 1 else 'is'} missing; save the dataset "
                f"again with Dataset.save_to_disk."
            )
        with self._open(self.files[0]) as reader:
            self._check_column(reader.schema, f"The dataset {self.path}")

    @staticmethod
    def _open(file: Path):  # pyarrow.ipc.RecordBatchStreamReader over the memory-mapped file
        pa = _import_pyarrow()
        return pa.ipc.open_stream(pa.memory_map(str(file)))

    def progress_total(self) -> int:
        total = 0
        for file in self.files:  # memory-mapped: counting reads the batch headers only
            with self._open(file) as reader:
                total += sum(batch.num_rows for batch in reader)
        return total

    def _batches(self) -> Iterator:
        for file in self.files:
            with self._open(file) as reader:
                for batch in reader:
                    yield batch.select([self.json_key])


def _dataset_directory(path: Path, split: str | None) -> Path:
    """The ``save_to_disk`` directory of ``path``: itself, or the ``split`` of the DatasetDict it holds."""
    splits_file = path / "dataset_dict.json"
    if splits_file.is_file():
        splits = json.loads(splits_file.read_text()).get("splits", [])
        if split is None or split not in splits:
            given = "no --split" if split is None else f"--split {split!r}"
            raise ValueError(f"{path} is a DatasetDict with the splits {', '.join(map(repr, splits))} and {given} "
                             f"names one of them; choose one with --split NAME.")
        path = path / split
    elif split is not None:
        raise ValueError(f"--split {split!r} selects a split of a DatasetDict directory, but {path} holds a single "
                         f"dataset (it has no dataset_dict.json); leave --split out.")
    if not (path / "state.json").is_file():
        raise ValueError(
            f"{path} is a directory but not one written by Hugging Face datasets' save_to_disk (no state.json); "
            f"give a .jsonl, .txt or .parquet file, or a directory written by Dataset.save_to_disk."
        )
    return path


def open_input(path: str | os.PathLike, *, json_key: str = "text", split: str | None = None) -> InputReader:
    """The reader of ``path`` by its format (see the module docstring); ``split`` names a DatasetDict's split."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Input {path} does not exist.")
    if path.is_dir():
        return ArrowDatasetReader(_dataset_directory(path, split), json_key)
    if split is not None:
        raise ValueError(f"--split {split!r} selects a split of a Hugging Face DatasetDict directory; {path} is a "
                         f"file: leave --split out.")
    if path.suffix == PARQUET_SUFFIX:
        return ParquetReader(path, json_key)
    if path.suffix in LINE_SUFFIXES:
        return LineReader(path, path.suffix[1:], json_key)
    raise ValueError(
        f"Input {path} must end in .jsonl (one JSON object per line), .txt (one document per line) or .parquet "
        f"(one document per row), or be a directory written by Hugging Face datasets' save_to_disk."
    )


INPUT_SUFFIXES = (*LINE_SUFFIXES, PARQUET_SUFFIX)


def _is_dataset_directory(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def input_files(inputs: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]) -> tuple[list[Path], list[Path]]:
    """The files (and Hugging Face datasets directories) that ``inputs`` name, in reading order, and the files
    under folders that are left out (another suffix), for the caller to mention.

    A file or a datasets directory is read as it is; another folder stands for its ``.jsonl``, ``.txt`` and
    ``.parquet`` files, sub-folders included and hidden names left out, sorted by their path within it. The
    inputs keep the order they are given in. A missing input, or a folder with none of those files, raises.
    """
    given = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    if not given:
        raise ValueError("No input was given; name a .jsonl, .txt or .parquet file, a folder of them, or a Hugging "
                         "Face datasets directory.")
    files: list[Path] = []
    left_out: list[Path] = []
    for path in map(Path, given):
        if not path.exists():
            raise FileNotFoundError(f"Input {path} does not exist.")
        if not path.is_dir() or _is_dataset_directory(path):
            files.append(path)
            continue
        found = sorted((file for file in path.rglob("*") if file.is_file()
                        and not any(part.startswith(".") for part in file.relative_to(path).parts)),
                       key=lambda file: file.relative_to(path).as_posix())
        readable = [file for file in found if file.suffix in INPUT_SUFFIXES]
        if not readable:
            held = f"holds {len(found)} other files (e.g. {found[0].name})" if found else "holds no file"
            raise ValueError(f"Input {path} is a folder that {held}: no .jsonl, .txt or .parquet file, and it is not a "
                             f"directory written by Hugging Face datasets' save_to_disk (no state.json); put the "
                             f"documents in such files or name the files with --input.")
        files += readable
        left_out += [file for file in found if file.suffix not in INPUT_SUFFIXES]
    return files, left_out


def open_inputs(inputs: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]], *, json_key: str = "text",
                split: Optional[str] = None) -> list[InputReader]:
    """A reader for each file of :func:`input_files`, in reading order (each opened, so that a bad one fails
    before anything is read)."""
    return [open_input(path, json_key=json_key, split=split) for path in input_files(inputs)[0]]
