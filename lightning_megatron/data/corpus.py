"""The built-in corpus: the Python standard library's own source code, as bytes.

Every Python install carries a few megabytes of ordinary, varied code, so the default
training run and the tests need no download and no tokenizer files. A byte-level
tokenizer keeps the vocabulary tiny (257) and makes every file encodable.
"""

from __future__ import annotations

import os
import pathlib
import sysconfig
from collections.abc import Iterable

import numpy as np

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
