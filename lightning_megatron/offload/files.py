"""The ``"nvme"`` tier's files: one flat file per stream (fp32 main parameters, each optimizer state tensor, and
the gradients where they need a host fp32 copy), in a folder of this rank's own under ``offload_path``.

Two ways in, for two jobs:

* :meth:`OffloadFiles.piece`: a range of a stream as a tensor memory-mapped from its file (``numpy.memmap``,
  shared), whose storage is exactly that range. It is what the optimizer's param groups and state dict, the
  checkpoint code and ``copy_from_model`` see, so they work unchanged; its pages are the page cache's
  (reclaimable, written back by the kernel), never this process's private memory. (A view into one mapping of the
  whole stream would do for reading and writing, but torch.distributed.checkpoint copies a tensor whose storage is
  larger than itself before saving it: a state-sized private copy at every save.)
* :meth:`OffloadFiles.read` / :meth:`OffloadFiles.write`: a tile of a stream into or out of a host buffer with
  ``os.preadv`` / ``os.pwritev``. The optimizer step uses these from worker threads (they release the GIL), so
  the next tile's read and the previous tile's write overlap the current tile's update
  (``offload.tiled_step``). The bytes moved are counted.

Every file is allocated in full when the folder is made (``posix_fallocate``): a disk too small fails then,
before training, not in the middle of a step. :meth:`close` removes the folder it made and nothing else.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Mapping

import numpy
import torch
from torch import Tensor


class OffloadFiles:
    """``streams``: name -> (numel, dtype) of each flat file, made under a fresh folder in ``root``."""

    def __init__(self, root: str | os.PathLike, streams: Mapping[str, tuple[int, torch.dtype]], *, prefix: str) -> None:
        Path(root).mkdir(parents=True, exist_ok=True)
        self.folder = Path(tempfile.mkdtemp(prefix=prefix, dir=root))  # ours alone: close() removes only it
        self.streams = dict(streams)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = self.bytes_written = 0
        try:
            for name, (numel, dtype) in self.streams.items():
                path = self.path(name)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                self._fds[name] = fd
                nbytes = numel * element_size(dtype)
                if nbytes:
                    os.posix_fallocate(fd, 0, nbytes)  # the disk space, now; ENOSPC here, not mid-step
        except BaseException:
            self.close()
            raise

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.bin"

    @property
    def nbytes(self) -> int:
        return sum(numel * element_size(dtype) for numel, dtype in self.streams.values())

    def piece(self, name: str, start: int, numel: int) -> Tensor:
        """Elements ``[start, start + numel)`` of a stream, memory-mapped from its file (shared: writes reach it)."""
        total, dtype = self.streams[name]
        if start < 0 or start + numel > total:
            raise IndexError(f"elements [{start}, {start + numel}) are outside stream {name!r} of {total}")
        if not numel:
            return torch.empty(0, dtype=dtype)
        item = element_size(dtype)
        array = numpy.memmap(self.path(name), dtype=numpy.uint8, mode="r+", offset=start * item, shape=(numel * item,))
        return torch.from_numpy(array).view(dtype)

    def read(self, name: str, start: int, buffer: Tensor) -> None:
        """Fill ``buffer`` (a contiguous host tensor) from elements ``[start, start + buffer.numel())``."""
        self._transfer(os.preadv, name, start, buffer)
        with self._lock:
            self.bytes_read += buffer.numel() * buffer.element_size()

    def write(self, name: str, start: int, buffer: Tensor) -> None:
        """Write ``buffer`` to elements ``[start, start + buffer.numel())``."""
        self._transfer(os.pwritev, name, start, buffer)
        with self._lock:
            self.bytes_written += buffer.numel() * buffer.element_size()

    def _transfer(self, call, name: str, start: int, buffer: Tensor) -> None:
        if not buffer.numel():
            return
        memory = memoryview(buffer.view(torch.uint8).numpy()).cast("B")
        offset, done = start * buffer.element_size(), 0
        while done < len(memory):  # both calls may move fewer bytes than asked
            moved = call(self._fds[name], [memory[done:]], offset + done)
            if moved <= 0:
                raise OSError(f"{call.__name__} moved no bytes of {self.path(name)} at byte {offset + done}: the "
                              f"file is shorter than the offload tier made it (changed by something else?).")
            done += moved

    def close(self) -> None:
        """Close and delete this rank's folder (only the one this object made); mapped pieces stay readable until
        they are dropped."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        shutil.rmtree(self.folder, ignore_errors=True)


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
