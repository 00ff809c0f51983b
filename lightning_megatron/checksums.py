"""CRC-32 of files: what checkpoints record per file and what the data index cache checks its arrays by."""

from __future__ import annotations

import os
import zlib

_CHUNK = 1 << 20  # 1 MiB reads: as fast as larger ones, and no large buffer left in the heap of every rank


def file_crc32(path: str | os.PathLike) -> int:
    """zlib's CRC-32 of a file, read in chunks (not memory-mapped, so the pages read stay out of this process).
    It catches bytes changed in place at about the speed of reading the file back."""
    crc = 0
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc
