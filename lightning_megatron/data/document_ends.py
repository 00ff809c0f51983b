"""Each document's last token, recorded beside an indexed dataset in ``PREFIX.ends``.

GPT's dataset adds the end-of-document id after every document that does not already end
with it, so its index build must know each document's last token. Read from the ``.bin``,
that is one page per document: through a memory map of a 572 MB corpus of 300k documents it
touched nearly every page, and the building rank's peak resident memory grew by 553 MB. The
writer of a dataset knows these tokens for free, so it records them here, and an index build
reads only the ``.idx`` and this file (a few bytes per document).

The file is ours alone: the ``.bin``/``.idx`` stay exactly Megatron-LM's, and Megatron-LM
ignores it. A dataset without it (made by Megatron-LM's ``preprocess_data.py``, or by an
older version of this package) still works: the last tokens are then read from the ``.bin``
(``os.pread``, nothing mapped), and ``lightning-megatron document-ends PREFIX`` writes the file.

Layout (little-endian)::

    8s   b"LMDOCEND"  magic
    <Q   version = 1
    4s   dtype of the tokens (numpy's ``dtype.str``, NUL-padded), the .bin's
    <Q   d, the document count of the .idx
    <Q   size of the .idx in bytes
    <I   CRC-32 of the .idx
    <Q   size of the .bin in bytes
    dtype[d]  the last token of each document (0 for an empty one)

The sizes and the CRC-32 tie the file to one version of the dataset: rewrite the ``.idx`` or
resize the ``.bin`` and it no longer belongs, and is then not used (:class:`StaleDocumentEnds`).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from lightning_megatron.checksums import file_crc32

MAGIC = b"LMDOCEND"
VERSION = 1
_HEADER = struct.Struct("<8sQ4sQQIQ")  # magic, version, dtype, documents, .idx bytes, .idx CRC-32, .bin bytes


class StaleDocumentEnds(ValueError):
    """``PREFIX.ends`` exists but does not belong to the dataset beside it (the message says why)."""


def document_ends_file(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.ends")


def _fingerprint(idx_path: Path, bin_path: Path) -> tuple[int, int, int]:
    """(.idx bytes, .idx CRC-32, .bin bytes): what ties the file to one version of the dataset. The .idx is
    read (not mapped), the .bin only sized."""
    return idx_path.stat().st_size, file_crc32(idx_path), bin_path.stat().st_size


def write_document_ends(path: str | os.PathLike, last_tokens: np.ndarray, *, dtype: np.dtype,
                        idx_path: Path, bin_path: Path) -> None:
    """Write ``last_tokens`` (one per document of ``idx_path``) to ``path``, tied to ``idx_path``/``bin_path`` as
    they are now. The caller writes to a temporary name and moves it into place."""
    dtype = np.dtype(dtype)
    idx_bytes, idx_crc, bin_bytes = _fingerprint(idx_path, bin_path)
    header = _HEADER.pack(MAGIC, VERSION, dtype.str.encode(), len(last_tokens), idx_bytes, idx_crc, bin_bytes)
    with open(path, "wb") as file:
        file.write(header)
        file.write(np.asarray(last_tokens).astype(dtype, copy=False).tobytes())


def read_document_ends(prefix: str | os.PathLike, documents: range, *, dtype: np.dtype, num_documents: int,
                       idx_path: Path, bin_path: Path) -> np.ndarray:
    """The recorded last tokens of ``documents`` (read, not mapped: only their bytes).

    Raises ``FileNotFoundError`` when there is no ``PREFIX.ends``, :class:`StaleDocumentEnds` when it does not
    belong to the dataset ``idx_path``/``bin_path`` of ``num_documents`` documents of ``dtype``.
    """
    path, dtype = document_ends_file(prefix), np.dtype(dtype)
    with open(path, "rb") as file:
        raw = file.read(_HEADER.size)
        if len(raw) < _HEADER.size:
            raise StaleDocumentEnds(f"{path} is {len(raw)} bytes, shorter than its {_HEADER.size}-byte header")
        magic, version, stored_dtype, count, idx_bytes, idx_crc, bin_bytes = _HEADER.unpack(raw)
        if magic != MAGIC or version != VERSION:
            raise StaleDocumentEnds(f"{path} is not a version-{VERSION} document-ends file ({magic!r}, version "
                                    f"{version})")
        stored_dtype = stored_dtype.rstrip(b"\0").decode(errors="replace")
        size, wanted_size = path.stat().st_size, _HEADER.size + num_documents * dtype.itemsize
        if (count, stored_dtype, size) != (num_documents, dtype.str, wanted_size):
            raise StaleDocumentEnds(
                f"{path} records {count} documents of {stored_dtype} in {size} bytes, but the dataset holds "
                f"{num_documents} documents of {dtype.str} ({wanted_size} bytes)")
        found = _fingerprint(idx_path, bin_path)
        if found != (idx_bytes, idx_crc, bin_bytes):
            raise StaleDocumentEnds(
                f"{path} was written for a {idx_bytes}-byte .idx (CRC-32 {idx_crc:08x}) and a {bin_bytes}-byte .bin, "
                f"but {idx_path.name} is {found[0]} bytes (CRC-32 {found[1]:08x}) and {bin_path.name} {found[2]} "
                f"bytes: the dataset was rewritten since")
        file.seek(_HEADER.size + documents.start * dtype.itemsize)
        return np.fromfile(file, dtype=dtype, count=len(documents))


def stale_advice(prefix: str | os.PathLike) -> str:
    """How to replace a ``PREFIX.ends`` that no longer belongs to its dataset."""
    return (f"delete {document_ends_file(prefix)} and run `lightning-megatron document-ends {os.fspath(prefix)}` to "
            f"record the dataset as it is now")

