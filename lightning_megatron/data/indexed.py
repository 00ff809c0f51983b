"""Megatron-LM's indexed dataset: token sequences in a ``.bin`` file, described by an ``.idx`` file.

The files are byte-compatible with ``megatron/core/datasets/indexed_dataset.py``
(``MMapIndexedDataset``), so data tokenised here trains in Megatron-LM and data tokenised
by Megatron-LM's ``tools/preprocess_data.py`` trains here. Both files are memory-mapped:
opening a dataset of any size reads only its header.

Layout (little-endian; ``n`` sequences, ``d`` documents)::

    .idx  b"MMIDIDX\\x00\\x00"   9-byte magic
          <Q  version = 1
          <B  dtype code (see DTYPE_CODES)
          <Q  n, the sequence count
          <Q  d + 1, the length of document_indices
          int32[n]     sequence lengths, in tokens
          int64[n]     sequence pointers, in bytes from the start of the .bin
          int64[d + 1] document indices: document k is sequences [doc[k], doc[k + 1]),
                       so the array starts at 0 and ends at n
    .bin  the sequences' tokens, back to back, in the dtype of the code

A document may hold several sequences (Megatron splits BERT data into sentences):
:meth:`IndexedDatasetWriter.add_document` takes their lengths, as Megatron-LM's does.

The writer also records each document's last token in ``PREFIX.ends``
(:mod:`lightning_megatron.data.document_ends`), beside the two files and unknown to Megatron-LM,
so that :meth:`IndexedDataset.last_tokens` need not read the ``.bin``.
"""

from __future__ import annotations

import array as stdlib_array  # typed lists: an item costs its bytes, not a Python int
import os
import struct
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType

import numpy as np
from numpy.typing import DTypeLike

from lightning_megatron.data.document_ends import (
    StaleDocumentEnds,
    document_ends_file,
    read_document_ends,
    stale_advice,
    write_document_ends,
)
from lightning_megatron.data.file_array import FileArray

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
#: Megatron-LM's dtype codes; the code is stored in the .idx header.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}
# magic, version, dtype code, sequence count, document-index count
_HEADER = struct.Struct("<9sQBQQ")


def index_file(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def data_file(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


_MAX_LISTED_ENTRIES = 10_000  # directory entries read to suggest a prefix: enough for any data directory, still cheap
_MAX_SUGGESTIONS = 5


def _datasets_in(directory: Path) -> list[str]:
    """Names ``N`` of the complete datasets ``N.bin`` + ``N.idx`` in ``directory`` (temporary files left out)."""
    stems: dict[str, set[str]] = {}
    try:
        with os.scandir(directory) as entries:
            for count, entry in enumerate(entries):
                if count >= _MAX_LISTED_ENTRIES:
                    break
                stem, dot, suffix = entry.name.rpartition(".")
                if dot and stem and suffix in ("bin", "idx") and not stem.endswith(".tmp"):
                    stems.setdefault(stem, set()).add(suffix)
    except OSError:
        return []
    return sorted(stem for stem, suffixes in stems.items() if len(suffixes) == 2)


def _close_datasets(name: str, candidates: list[str]) -> list[str]:
    """``candidates`` that ``name`` was probably meant to be: itself with a file suffix, a longer or shorter
    form of it (``corpus`` for ``corpus_text_document``), then spelling neighbours."""
    import difflib

    suffixes = (".bin", ".idx", ".ends", ".meta.json", ".")
    stripped = [name[: -len(suffix)] for suffix in suffixes if name.endswith(suffix)]
    ranked = [c for c in candidates if c in stripped]
    if ranked:  # the dataset's own files were named: no other guess is as good
        return ranked
    ranked += [c for c in candidates if name and (c.startswith(name) or name.startswith(c))]
    ranked += difflib.get_close_matches(name, candidates, n=_MAX_SUGGESTIONS, cutoff=0.6)
    return list(dict.fromkeys(ranked))[:_MAX_SUGGESTIONS]


def check_dataset_files(prefix: str | os.PathLike, *, argument: str = "prefix") -> None:
    """Raise ``FileNotFoundError`` unless both ``prefix.bin`` and ``prefix.idx`` exist.

    The message names the paths looked for, says whether their directory exists, and lists the
    datasets of that directory close to ``prefix`` (a prefix given with its ``.bin``/``.idx``
    suffix, a shortened name, a typo), so a wrong prefix fails with the right one. It reads
    only the file system (one directory listing, on failure), so every rank raises it alike,
    before any collective. ``argument`` is how the user passed ``prefix``, for the message.
    """
    prefix = os.fspath(prefix)
    idx_path, bin_path = index_file(prefix), data_file(prefix)
    missing = [path for path in (bin_path, idx_path) if not path.is_file()]
    if not missing:
        return
    if len(missing) == 1:
        present = idx_path if missing[0] == bin_path else bin_path
        raise FileNotFoundError(
            f"Indexed dataset file {missing[0]} does not exist but {present} does; a dataset at {argument}={prefix!r} "
            f"needs both {idx_path.name} and {bin_path.name}: copy the missing file, or write both again with "
            f"`lightning-megatron preprocess`."
        )
    directory = bin_path.parent
    message = f"No indexed dataset at {argument}={prefix!r}: neither {bin_path} nor {idx_path} exists"
    hint = (" A prefix is the path of PREFIX.bin and PREFIX.idx without the suffix; write them with "
            "`lightning-megatron preprocess --input FILE --tokenizer byte --output-prefix PREFIX`.")
    if not directory.is_dir():
        message += f", and the directory {directory} does not exist"
        if not directory.is_absolute():
            message += f" (relative to the working directory {os.getcwd()})"
        raise FileNotFoundError(message + "." + hint)
    if Path(prefix).is_dir():  # the directory of the data rather than a prefix in it
        given_dir, listed = prefix, _datasets_in(Path(prefix))
        close, lead, what = listed, f"; {prefix} is a directory, not a prefix", "Datasets in it"
    else:
        given_dir, listed = os.path.dirname(prefix), _datasets_in(directory)
        close, lead, what = _close_datasets(bin_path.stem, listed), "", f"Datasets in {directory} with a close name"

    def paths(names: list[str]) -> str:
        more = f" and {len(names) - _MAX_SUGGESTIONS} more" if len(names) > _MAX_SUGGESTIONS else ""
        return ", ".join(repr(os.path.join(given_dir, name)) for name in names[:_MAX_SUGGESTIONS]) + more

    if len(close) == 1:
        message += f"{lead}. Did you mean {argument}={paths(close)}?"
    elif close:
        message += f"{lead}. {what}: {paths(close)}."
    elif listed:
        message += f". {directory} holds the datasets {paths(listed)}, none with a close name."
    else:
        message += f"; {directory} holds no .bin/.idx dataset."
    raise FileNotFoundError(message + ("" if close else hint))


def token_dtype(vocab_size: int) -> np.dtype:
    """The dtype Megatron-LM stores a vocabulary's tokens in: uint16 below 65,500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


class IndexedDatasetWriter:
    """Writes documents to ``prefix.bin`` and, on :meth:`finalize`, their index to ``prefix.idx`` and their last
    tokens to ``prefix.ends``.

    The files are written under temporary names and renamed into place by :meth:`finalize`,
    the ``.idx`` last, so a crash or an error never leaves a half-written dataset behind a
    valid-looking index. Used as a context manager it finalizes on success and deletes the
    temporary files on an exception.

    Example::

        >>> with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:  # doctest: +SKIP
        ...     writer.add_document([72, 105, 256])
    """

    def __init__(self, prefix: str | os.PathLike, *, dtype: DTypeLike) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF_DTYPE:
            supported = ", ".join(str(d) for d in DTYPE_CODES.values())
            raise ValueError(f"dtype {self.dtype} has no Megatron-LM dtype code; use one of: {supported}.")
        self.prefix = os.fspath(prefix)
        self._bin_tmp = data_file(f"{self.prefix}.tmp")
        self._idx_tmp = index_file(f"{self.prefix}.tmp")
        self._ends_tmp = document_ends_file(f"{self.prefix}.tmp")
        self._bin = open(self._bin_tmp, "wb")
        self._lengths: list[int] = []  # per sequence
        # per document (0 for an empty one), for PREFIX.ends
        self._last_tokens = stdlib_array.array(self.dtype.char)
        self._document_indices = [0]  # document k is sequences [k, k + 1) of these
        self._closed = False

    @property
    def num_documents(self) -> int:
        return len(self._document_indices) - 1

    @property
    def num_sequences(self) -> int:
        return len(self._lengths)

    @property
    def num_tokens(self) -> int:
        return sum(self._lengths)

    def add_document(self, tokens: Iterable[int] | np.ndarray, sequence_lengths: Sequence[int] | None = None) -> None:
        """Append one document: ``tokens`` back to back, cut into sequences of ``sequence_lengths`` tokens (one
        sequence when ``None``; e.g. its sentences for BERT); values that the dtype cannot hold are refused."""
        if self._closed:
            raise RuntimeError(f"The writer for {self.prefix} is already finalized or aborted.")
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"A document must be a 1-D sequence of tokens, got shape {array.shape}.")
        if array.size > np.iinfo(np.int32).max:
            raise ValueError(f"A document of {array.size} tokens exceeds the int32 length field of the .idx format.")
        if array.size and self.dtype.kind in "iu" and array.dtype != self.dtype:
            info = np.iinfo(self.dtype)
            low, high = array.min(), array.max()
            if low < info.min or high > info.max:
                raise ValueError(
                    f"Token values {low}..{high} do not fit the dataset dtype {self.dtype} ({info.min}..{info.max}); "
                    f"write the dataset with a wider dtype."
                )
        lengths = [int(array.size)] if sequence_lengths is None else [int(n) for n in sequence_lengths]
        if min(lengths, default=0) < 0 or sum(lengths) != array.size:
            raise ValueError(f"sequence_lengths {lengths} must be non-negative and add up to the document's "
                             f"{array.size} tokens.")
        stored = array.astype(self.dtype, copy=False)
        self._bin.write(stored.tobytes(order="C"))
        self._lengths.extend(lengths)
        self._document_indices.append(len(self._lengths))
        self._last_tokens.append(stored[-1].item() if stored.size else 0)

    def finalize(self) -> None:
        """Write the index and the last tokens and move the files into place (``.bin`` first, ``.idx`` last)."""
        if self._closed:
            raise RuntimeError(f"The writer for {self.prefix} is already finalized or aborted.")
        self._closed = True
        self._bin.close()
        lengths = np.array(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        document_indices = np.array(self._document_indices, dtype=np.int64)
        header = _HEADER.pack(INDEX_MAGIC, INDEX_VERSION, _CODE_OF_DTYPE[self.dtype], len(lengths), len(document_indices))
        with open(self._idx_tmp, "wb") as f:
            f.write(header)
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(document_indices.tobytes())
        write_document_ends(self._ends_tmp, np.frombuffer(self._last_tokens, dtype=self.dtype), dtype=self.dtype,
                            idx_path=self._idx_tmp, bin_path=self._bin_tmp)
        os.replace(self._bin_tmp, data_file(self.prefix))
        os.replace(self._ends_tmp, document_ends_file(self.prefix))
        os.replace(self._idx_tmp, index_file(self.prefix))

    def abort(self) -> None:
        """Delete the temporary files; the dataset at ``prefix`` (if any) is left as it was."""
        self._closed = True
        self._bin.close()
        self._bin_tmp.unlink(missing_ok=True)
        self._idx_tmp.unlink(missing_ok=True)
        self._ends_tmp.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def _index_arrays(index: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Views of the sequence lengths, sequence pointers and document indices in a mapped ``.idx``."""
    offset = _HEADER.size
    lengths = index[offset : offset + 4 * count].view(np.int32)
    offset += 4 * count
    pointers = index[offset : offset + 8 * count].view(np.int64)
    return lengths, pointers, index[offset + 8 * count :].view(np.int64)


_CHECKED_PER_READ = 1 << 16  # items of the .idx read at a time by the checks of an IndexedDataset when it opens


def _non_decreasing(values: FileArray) -> bool:
    """Checked a part at a time: a corpus of millions of documents costs no array of their size."""
    return all(not np.any(np.diff(values[i : i + _CHECKED_PER_READ + 1]) < 0)
               for i in range(0, max(len(values) - 1, 1), _CHECKED_PER_READ))


def _extents(boundaries: np.ndarray, lengths: np.ndarray, pointers: np.ndarray,
             itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    """``(first token, tokens)`` of the documents whose first sequences are ``boundaries[:-1]`` (``boundaries[-1]``
    ends the last), from the ``lengths`` and ``pointers`` of the sequences ``boundaries[0]`` to ``boundaries[-1]``."""
    first = int(boundaries[0])
    sequence_ends = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    stored = sequence_ends[boundaries[1:] - first] - sequence_ends[boundaries[:-1] - first]
    starts = np.zeros(len(stored), np.int64)
    non_empty = stored > 0  # an empty document may sit after the last sequence: it has no pointer
    starts[non_empty] = np.asarray(pointers[boundaries[:-1][non_empty] - first]) // itemsize
    return starts, stored


_SPOT_CHECKS = 16  # last tokens of PREFIX.ends compared with the .bin before the file is trusted
_DOCUMENTS_PER_PASS = 1 << 14  # extents computed at a time by a pass over many documents: well under 1 MiB


class IndexedDataset:
    """A read-only, memory-mapped Megatron-LM indexed dataset: ``dataset[i]`` is sequence ``i``.

    The header, the sizes of both files and the document indices are checked on opening, so
    a truncated, mismatched or foreign file fails here with its path, not later as garbage
    tokens.

    Example::

        >>> ds = IndexedDataset("data/wiki_text_document")  # doctest: +SKIP
        >>> len(ds), ds.dtype, ds[0][:5]                      # doctest: +SKIP
        (1000, dtype('uint16'), memmap([ 464, 3290,  286,  262, 1578], dtype=uint16))
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        idx_path, bin_path = index_file(prefix), data_file(prefix)
        check_dataset_files(prefix)
        size = idx_path.stat().st_size
        with open(idx_path, "rb") as file:
            header = file.read(_HEADER.size)
        if len(header) < _HEADER.size:
            raise ValueError(f"{idx_path} is {size} bytes, shorter than the {_HEADER.size}-byte header.")
        magic, version, code, count, index_count = _HEADER.unpack(header)
        if magic != INDEX_MAGIC:
            raise ValueError(f"{idx_path} starts with {magic!r}, not the indexed-dataset magic {INDEX_MAGIC!r}.")
        if version != INDEX_VERSION:
            raise ValueError(f"{idx_path} has index version {version}; only version {INDEX_VERSION} is supported.")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path} has dtype code {code}; known codes are {sorted(DTYPE_CODES)}.")
        expected = _HEADER.size + 12 * count + 8 * index_count
        if size != expected:
            raise ValueError(
                f"{idx_path} is {size} bytes but its header ({count} sequences, {index_count} document "
                f"indices) implies {expected}; the index is truncated or not a plain-text Megatron index."
            )
        self.dtype: np.dtype = DTYPE_CODES[code]
        # The checks read the .idx by pread, a part at a time: nothing of it is mapped into this process (the .idx
        # of a corpus of a billion documents is 20 GB), and the arrays below are mapped afterwards, touched as used.
        lengths = FileArray(idx_path, np.int32, _HEADER.size, count)
        docs = FileArray(idx_path, np.int64, _HEADER.size + 12 * count, index_count)
        if index_count == 0 or docs[0] != 0 or docs[-1] != count or not _non_decreasing(docs):
            raise ValueError(f"{idx_path} has invalid document indices: they must rise from 0 to {count}.")

        num_bytes = sum(int(lengths[i : i + _CHECKED_PER_READ].sum(dtype=np.int64))
                        for i in range(0, count, _CHECKED_PER_READ)) * self.dtype.itemsize
        bin_size = bin_path.stat().st_size
        if bin_size != num_bytes:
            raise ValueError(
                f"Index/bin mismatch: {idx_path} describes {num_bytes} bytes of {self.dtype} tokens but {bin_path} "
                f"is {bin_size} bytes; the .bin is truncated or belongs to another index. Re-run the preprocessing."
            )
        del lengths, docs
        index = np.memmap(idx_path, dtype=np.uint8, mode="r")
        self.sequence_lengths, self.sequence_pointers, self.document_indices = _index_arrays(index, count)
        self._tokens = np.memmap(bin_path, dtype=self.dtype, mode="r") if bin_size else np.empty(0, self.dtype)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        """The tokens of sequence ``index`` (a read-only view into the memory-mapped ``.bin``)."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"sequence {index} out of range for {len(self)} sequences in {self.prefix}")
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize
        return self._tokens[start : start + int(self.sequence_lengths[index])]

    def document_extents(self, documents: range) -> tuple[np.ndarray, np.ndarray]:
        """``(first token, tokens)`` of each document of ``documents`` in the ``.bin`` (int64 each; 0 and 0 for an
        empty document), from the ``.idx`` alone."""
        self._check_range(documents)
        boundaries = np.asarray(self.document_indices[documents.start : documents.stop + 1])
        span = slice(int(boundaries[0]), int(boundaries[-1]))
        return _extents(boundaries, self.sequence_lengths[span], self.sequence_pointers[span], self.dtype.itemsize)

    def extents_by_chunk(self, documents: range) -> Iterator[tuple[range, np.ndarray, np.ndarray]]:
        """``(part, first token, tokens)``: :meth:`document_extents` of consecutive parts of ``documents``, read from
        the ``.idx`` by ``pread`` (not through its mapping), so that a pass over every document of a large corpus
        holds one part's arrays and leaves none of the ``.idx``'s pages in this process."""
        self._check_range(documents)
        path, count = index_file(self.prefix), len(self.sequence_lengths)
        lengths = FileArray(path, np.int32, _HEADER.size, count)
        pointers = FileArray(path, np.int64, _HEADER.size + 4 * count, count)
        document_indices = FileArray(path, np.int64, _HEADER.size + 12 * count, self.num_documents + 1)
        for start in range(documents.start, documents.stop, _DOCUMENTS_PER_PASS):
            part = range(start, min(start + _DOCUMENTS_PER_PASS, documents.stop))
            boundaries = document_indices[part.start : part.stop + 1]
            first, end = int(boundaries[0]), int(boundaries[-1])
            yield (part, *_extents(boundaries, lengths[first:end], pointers[first:end], self.dtype.itemsize))

    def last_tokens(self, documents: range) -> np.ndarray:
        """The last token of each document of ``documents`` (0 for an empty one).

        Read from ``PREFIX.ends`` when it belongs to this dataset (a few bytes per document); else
        from the ``.bin`` (:meth:`last_tokens_from_bin`), saying once per dataset why, and how to
        write the file.
        """
        try:
            return self.recorded_last_tokens(documents)
        except FileNotFoundError:
            _tell_once(self.prefix, f"{document_ends_file(self.prefix)} does not exist (the dataset was not written by "
                       f"this package, or by an older version); `lightning-megatron document-ends {self.prefix}` "
                       f"writes it")
        except StaleDocumentEnds as error:
            _tell_once(self.prefix, f"{error}; it is ignored: {stale_advice(self.prefix)}")
        except OSError as error:  # optional: an unreadable one is not worth failing the build over
            _tell_once(self.prefix, f"{document_ends_file(self.prefix)} cannot be read ({error})")
        return self.last_tokens_from_bin(documents)

    def recorded_last_tokens(self, documents: range) -> np.ndarray:
        """The last tokens ``PREFIX.ends`` records for ``documents``, checked against the ``.bin`` at a few of them
        (a ``.bin`` rewritten in place at the same size is what the file's own checks cannot see).

        Raises ``FileNotFoundError`` without the file, :class:`StaleDocumentEnds` when it does not belong here.
        """
        self._check_range(documents)
        recorded = read_document_ends(self.prefix, documents, dtype=self.dtype, num_documents=self.num_documents,
                                      idx_path=index_file(self.prefix), bin_path=data_file(self.prefix))
        spread = np.linspace(documents.start, documents.stop - 1, min(_SPOT_CHECKS, len(documents)))
        checked, positions = [], []
        for k in np.unique(spread.astype(np.int64)).tolist():
            _, (start,), (stored,) = next(self.extents_by_chunk(range(k, k + 1)))  # read, not mapped
            if stored:
                checked.append(k)
                positions.append(start + stored - 1)
        for k, token in zip(checked, self._token_file().gather(np.array(positions, np.int64)).tolist()):
            if recorded[k - documents.start] != token:
                raise StaleDocumentEnds(f"{document_ends_file(self.prefix)} records {recorded[k - documents.start]} "
                                        f"as the last token of document {k} but {data_file(self.prefix).name} holds "
                                        f"{token}: the dataset was rewritten since")
        return recorded

    def last_tokens_from_bin(self, documents: range) -> np.ndarray:
        """The last token of each document of ``documents`` (0 for an empty one), read from the ``.bin`` by
        ``pread`` (``FileArray.gather``): a page or so per document, none of it mapped, so the pages stay in the
        kernel's shared page cache and out of this process."""
        last = np.zeros(len(documents), self.dtype)
        tokens = self._token_file()
        for part, starts, stored in self.extents_by_chunk(documents):
            non_empty = stored > 0
            last[part.start - documents.start:part.stop - documents.start][non_empty] = tokens.gather(
                starts[non_empty] + stored[non_empty] - 1)
        return last

    def _check_range(self, documents: range) -> None:
        if documents.step != 1 or not 0 <= documents.start <= documents.stop <= self.num_documents:
            raise ValueError(f"documents={documents} is not a contiguous range of the {self.num_documents} documents "
                             f"of {self.prefix}.")

    def _token_file(self) -> FileArray:
        return FileArray(data_file(self.prefix), self.dtype, 0, len(self._tokens))

    def document(self, index: int) -> np.ndarray:
        """The tokens of document ``index``: its sequences, which lie back to back in the ``.bin``."""
        if not 0 <= index < self.num_documents:
            raise IndexError(f"document {index} out of range for {self.num_documents} documents in {self.prefix}")
        first, end = int(self.document_indices[index]), int(self.document_indices[index + 1])
        if first == end:
            return self._tokens[:0]
        start = int(self.sequence_pointers[first]) // self.dtype.itemsize
        length = int(self.sequence_lengths[first:end].sum(dtype=np.int64))
        return self._tokens[start : start + length]


_TOLD: set[tuple[str, str]] = set()  # (dataset, problem) pairs this process has reported: each split would repeat it


def _tell_once(prefix: str, problem: str) -> None:
    if (key := (os.path.abspath(prefix), problem)) not in _TOLD:
        _TOLD.add(key)
        warnings.warn(f"Reading each document's last token from {data_file(prefix)}, as {problem}. With it, an index "
                      f"build reads only the .idx.", stacklevel=3)
