"""A one-dimensional array on disk, read by ``os.pread`` where it is indexed: nothing of it is mapped.

A memory map of a corpus or of its index arrays counts every page a process touches in its
resident memory, and on current kernels a random read maps a whole large page-cache folio
(hundreds of kilobytes) around the few bytes it wants, so a rank that reads a few hundred
random samples of a large corpus shows tens of megabytes more resident memory than on a
small one. A ``pread`` copies just the bytes read; what the kernel caches stays in its page
cache, shared by all ranks and reclaimable. A sample costs a handful of system calls, far
below a training step. (Megatron-LM offers the same choice: ``mmap_bin_files=False``.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Union

import numpy as np

_GATHER_GAP_BYTES = 64 << 10  # items of a gather closer than this share one read: one syscall, a few pages more
_GATHER_READ_BYTES = 1 << 20  # and no read is larger: no big buffer left in the heap


class FileArray:
    """``length`` items of ``dtype`` stored from byte ``offset`` of ``path``.

    ``array[i]`` reads one item, ``array[a:b]`` a contiguous range (a new ``ndarray``),
    ``np.asarray(array)`` all of it. The file descriptor is opened lazily in each process (also
    in forked or spawned DataLoader workers: ``pread`` takes its own offset, so sharing one is safe).
    """

    def __init__(self, path: Union[str, os.PathLike], dtype: np.dtype, offset: int, length: int) -> None:
        self.path, self.dtype, self.offset, self.length = Path(path), np.dtype(dtype), offset, length
        self._fd: int | None = None

    @classmethod
    def of_npy(cls, path: Union[str, os.PathLike]) -> "FileArray":
        """The array of a 1-D ``.npy`` file (written by ``np.save``)."""
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran_order, dtype = read_header(f)
            offset = f.tell()
        if len(shape) != 1 or fortran_order or dtype.hasobject:
            raise ValueError(f"{path} holds a {shape} array of {dtype}; only 1-D plain arrays are read this way.")
        return cls(path, dtype, offset, shape[0])

    @property
    def shape(self) -> tuple[int]:
        return (self.length,)

    def __len__(self) -> int:
        return self.length

    def _read(self, start: int, count: int) -> np.ndarray:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        size = count * self.dtype.itemsize
        data = os.pread(self._fd, size, self.offset + start * self.dtype.itemsize)
        if len(data) != size:
            raise OSError(f"{self.path} is shorter than its {self.length} items of {self.dtype}: it changed on disk.")
        return np.frombuffer(data, dtype=self.dtype)

    def __getitem__(self, index: Union[int, slice]) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(self.length)
            if step != 1:
                raise IndexError("a FileArray reads contiguous ranges only (step 1)")
            return self._read(start, max(0, stop - start)).copy()
        index = int(index)
        if index < 0:
            index += self.length
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} items of {self.path}")
        return self._read(index, 1)[0]

    def gather(self, indices: np.ndarray) -> np.ndarray:
        """The items at ``indices`` (any order; a new array), read with one ``pread`` per run of nearby ones.

        Items less than 64 KiB apart share a read of at most 1 MiB, so a gather that touches every
        part of the file reads it once, in pieces, and a sparse one reads only around its items;
        nothing is mapped, so what was read stays in the kernel's page cache and out of this
        process (the end-of-document probe of a corpus without ``PREFIX.ends``: one item per document).
        """
        indices = np.asarray(indices, dtype=np.int64)
        out = np.empty(len(indices), self.dtype)
        if not len(indices):
            return out
        if indices.min() < 0 or indices.max() >= self.length:
            raise IndexError(f"indices {indices.min()}..{indices.max()} out of range for {self.length} items of "
                             f"{self.path}")
        order = np.argsort(indices, kind="stable")
        wanted = indices[order]
        gap, span = max(1, _GATHER_GAP_BYTES // self.dtype.itemsize), max(1, _GATHER_READ_BYTES // self.dtype.itemsize)
        # runs of items with gaps below `gap`, cut into reads of at most `span` items from each run's first
        far = np.diff(wanted) > gap
        run_of = np.concatenate([[0], np.cumsum(far)])
        piece = (wanted - wanted[np.concatenate([[0], np.flatnonzero(far) + 1])][run_of]) // span
        read_starts = np.flatnonzero(np.concatenate([[True], far | (np.diff(piece) != 0)]))
        values = np.empty(len(wanted), self.dtype)
        for a, b in zip(read_starts.tolist(), np.append(read_starts[1:], len(wanted)).tolist()):
            first = int(wanted[a])
            values[a:b] = self._read(first, int(wanted[b - 1]) - first + 1)[wanted[a:b] - first]
        out[order] = values
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        array = self[:]
        return array if dtype is None else array.astype(dtype)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fd": None}  # descriptors do not cross to spawned workers

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
