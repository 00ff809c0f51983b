"""The built-in corpus: the Python standard library's own source code, as bytes.

Every Python install carries a few megabytes of ordinary, varied code, so the default
training run and the tests need no download and no tokenizer files. A byte-level
tokenizer keeps the vocabulary tiny (257) and makes every file encodable.

The GPT data module reads it as any other corpus: written once as an indexed dataset
(``stdlib_indexed_corpus``) into the cache directory (``$LIGHTNING_MEGATRON_CACHE``, by
default ``~/.cache/lightning_megatron``), so small data is not a separate code path.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys
import sysconfig
from collections.abc import Iterable

import numpy as np

from lightning_megatron.data.document_ends import document_ends_file
from lightning_megatron.data.index_cache import Ranks, build_once, say
from lightning_megatron.data.indexed import IndexedDataset, IndexedDatasetWriter

# Third-party packages are not the standard library; the test suites and IDLE are skipped
# so the corpus is ordinary library code of a modest size (about 13 MB).
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"})


def stdlib_source_files(max_files: int | None = None) -> list[pathlib.Path]:
    """The ``.py`` files of the running Python's standard library, in a deterministic order.

    Files are sorted by their path relative to the stdlib root, so two machines with the same
    Python version produce the same corpus. ``max_files`` keeps the first files of that order.

    Example::

        >>> files = stdlib_source_files(max_files=3)
        >>> [f.suffix for f in files]
        ['.py', '.py', '.py']
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    relative = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        base = pathlib.Path(dirpath).relative_to(root)
        relative += [base / name for name in filenames if name.endswith(".py")]
    if not relative:
        raise RuntimeError(f"No standard-library .py files found under {root}; is this a full Python install?")
    relative.sort()
    return [root / path for path in relative[:max_files]]


class ByteTokenizer:
    """Byte-level tokenizer: ids 0..255 are the utf-8 bytes, 256 is end-of-document.

    Example::

        >>> tok = ByteTokenizer()
        >>> tok.encode("hé")
        [104, 195, 169]
        >>> tok.decode([104, 195, 169, tok.eos_id])
        'hé'
    """

    eos_id: int = 256
    vocab_size: int = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Text for ``ids``; eos and out-of-range ids are skipped, broken utf-8 becomes U+FFFD."""
        data = bytes(i for i in map(int, ids) if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")


def load_stdlib_token_documents(max_files: int | None = None) -> list[np.ndarray]:
    """One uint16 token array per non-empty stdlib file (see :func:`stdlib_source_files`).

    The bytes of a file are its :class:`ByteTokenizer` ids, so files are read as bytes and
    never decoded; the whole corpus loads in about a second.
    """
    documents = []
    for path in stdlib_source_files(max_files):
        data = path.read_bytes()
        if data:
            documents.append(np.frombuffer(data, dtype=np.uint8).astype(np.uint16))
    return documents


def cache_root() -> pathlib.Path:
    """Where the package caches what it derives from data: ``$LIGHTNING_MEGATRON_CACHE`` or
    ``~/.cache/lightning_megatron``."""
    configured = os.environ.get("LIGHTNING_MEGATRON_CACHE")
    return pathlib.Path(configured) if configured else pathlib.Path.home() / ".cache" / "lightning_megatron"


def index_cache_dir(beside: str | os.PathLike | None, configured: str | os.PathLike | None = None) -> pathlib.Path:
    """Where index arrays derived from a data file go: ``configured``, else ``index_cache`` in the directory of
    ``beside`` (the data) when that is writable, else the user cache's ``index`` (every rank decides alike from the
    file system, before any build)."""
    if configured is not None:
        return pathlib.Path(configured)
    if beside is not None:
        directory = pathlib.Path(beside).resolve().parent / "index_cache"
        if os.access(directory if directory.exists() else directory.parent, os.W_OK):
            return directory
    return cache_root() / "index"


def stdlib_indexed_corpus(max_files: int | None = None, *, cache_dir: str | os.PathLike | None = None,
                          ranks: Ranks = Ranks()) -> str:
    """The prefix of the stdlib corpus (:func:`load_stdlib_token_documents`) as an indexed dataset, one
    document per file, written once by one rank (``data/index_cache.py``) under ``cache_dir``
    (default :func:`cache_root`) and reused while the stdlib's file list and sizes stay the same."""
    files = stdlib_source_files(max_files)
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    listing = [[str(path.relative_to(root)), path.stat().st_size] for path in files]
    key = {"python": sys.version.split()[0], "files": listing}
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    directory = pathlib.Path(cache_dir) if cache_dir is not None else cache_root() / "stdlib"
    prefix = directory / f"stdlib-{len(files)}-files-{digest}"
    record = pathlib.Path(f"{prefix}.meta.json")

    def valid() -> bool:
        try:
            IndexedDataset(prefix)
            # one written before PREFIX.ends existed is written again, with it
            return document_ends_file(prefix).is_file() and json.loads(record.read_text()).get("source") == key
        except (OSError, ValueError):
            return False

    def build() -> None:
        if valid():
            return
        directory.mkdir(parents=True, exist_ok=True)
        record.unlink(missing_ok=True)
        documents = tokens = 0
        with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
            for document in load_stdlib_token_documents(max_files):
                writer.add_document(document)
                documents, tokens = documents + 1, tokens + len(document)
        metadata = dict(tokenizer="byte", vocab_size=ByteTokenizer.vocab_size, eos_id=ByteTokenizer.eos_id,
                        append_eos=False, documents=documents, tokens=tokens, source=key)
        tmp = record.with_name(record.name + ".tmp")
        tmp.write_text(json.dumps(metadata) + "\n")
        os.replace(tmp, record)
        say(f"wrote the built-in corpus ({documents} stdlib files, {tokens:,} tokens) to {prefix}.bin/.idx")

    build_once(ranks, needs_build=lambda: not valid(), build=build, what="built-in corpus", where=str(directory))
    if not valid():
        raise RuntimeError(f"The built-in corpus at {prefix} is not readable after it was written; is {directory} "
                           f"writable and seen by every rank of a node? Set LIGHTNING_MEGATRON_CACHE to such a place.")
    return str(prefix)
