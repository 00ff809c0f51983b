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
before training, not in the middle of a step. :meth:`close` removes the folder it made and nothing else; so does
the interpreter's exit (a normal one or after an uncaught error) if nothing closed it.

A rank killed outright (SIGKILL, the out-of-memory killer, a node reboot) cannot remove its folder: its whole
optimizer share stays on disk. So each folder holds an owner record (pid, process start time, host, boot, pid
namespace), and :func:`clear_stale_folders`, run by the next tier made under the same ``offload_path``, removes
the folders whose owner is certainly gone and names those whose owner it cannot check (another host or container:
their size and the command that removes them); a folder whose owner may be alive is never touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Iterator, Mapping, Optional

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
        # At close(), at the interpreter's exit, or when this object is collected: whichever comes first, once.
        self._remove = weakref.finalize(self, _close_and_remove, self._fds, self.folder)
        try:
            write_owner_record(self.folder)
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
        self._remove()


def _close_and_remove(fds: dict[str, int], folder: Path) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()
    shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------ folders of runs that are gone
OWNER_FILE = "owner.json"
FOLDER_PREFIX = "lightning-megatron-rank"  # the tier's folders: lightning-megatron-rank<r>-<random>
_YOUNG_SECONDS = 60  # a folder without an owner record this young may be one being made right now


def process_start_time(pid: int) -> Optional[int]:
    """When process ``pid`` started (clock ticks since boot, Linux's ``/proc/<pid>/stat``), None if there is no
    such process (or no ``/proc``). With the pid it names one process: a pid reused later has another start."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])  # a zombie has exited already


def machine_identity() -> dict[str, Optional[str]]:
    """Where a pid means this process: the host name, the boot (a reboot ends every process) and the pid
    namespace (containers on one host, even sharing its host name, number their processes apart)."""
    def read(how, path: str) -> Optional[str]:
        try:
            return how(path).strip()
        except OSError:  # no /proc (not Linux): the host name alone
            return None

    return {"host": socket.gethostname(),
            "boot_id": read(lambda name: Path(name).read_text(), "/proc/sys/kernel/random/boot_id"),
            "pid_namespace": read(os.readlink, "/proc/self/ns/pid")}


def write_owner_record(folder: Path) -> None:
    """This process as the owner of ``folder``, written whole (a reader never sees half a record)."""
    record = {"pid": os.getpid(), "start_time": process_start_time(os.getpid()), **machine_identity()}
    partial = folder / f".{OWNER_FILE}.partial"
    partial.write_text(json.dumps(record))
    os.replace(partial, folder / OWNER_FILE)


def owner_state(record: dict) -> str:
    """``"gone"``: the process that wrote ``record`` has certainly ended (it ran in this boot of this machine, in
    this pid namespace, and no process with its pid and start time is left); ``"alive"``: it is running here;
    ``"unknown"``: it ran elsewhere (another host, container or boot: two machines may share a host name), and
    may be alive."""
    here = machine_identity()
    if any(record.get(key) != here[key] for key in ("host", "boot_id", "pid_namespace")):
        return "unknown"
    started = process_start_time(int(record["pid"]))
    return "gone" if started is None or started != record.get("start_time") else "alive"


def clear_stale_folders(root: str | os.PathLike) -> list[str]:
    """Remove the tier's folders under ``root`` left by processes that are gone; return one line for each folder
    removed and for each one left whose owner cannot be checked from here (size, owner, how to remove it). A
    folder of a process alive here is left alone without a word. Safe from many processes at once: one at a
    time, under a lock on ``root``."""
    root = Path(root)
    if not root.is_dir():
        return []
    lines = []
    with _locked(root):
        for folder in sorted(root.glob(f"{FOLDER_PREFIX}*")):
            if not folder.is_dir():
                continue
            try:
                record = json.loads((folder / OWNER_FILE).read_text())
            except (OSError, ValueError):
                record = None
            state = owner_state(record) if record is not None else "unrecorded"
            size = format_bytes(folder_bytes(folder))
            if state == "gone":
                shutil.rmtree(folder, ignore_errors=True)
                lines.append(f"removed {folder} ({size}): 'nvme' offload files of a run that is gone "
                             f"(pid {record['pid']} on this host).")
            elif state == "unrecorded" and time.time() - folder.stat().st_mtime > _YOUNG_SECONDS:
                lines.append(f"{folder} holds {size} of 'nvme' offload files with no owner record (an older "
                             f"version's run?); if no run is using it: rm -r {folder}")
            elif state == "unknown":
                lines.append(f"{folder} holds {size} of 'nvme' offload files of pid {record['pid']} on host "
                             f"{record.get('host')} (another machine, container or boot), left alone; if that run is "
                             f"over: rm -r {folder}")
    return lines


def folder_bytes(folder: Path) -> int:
    """Disk space the files in ``folder`` take (allocated blocks: the tier allocates its files in full)."""
    total = 0
    for entry in folder.rglob("*"):
        with contextlib.suppress(OSError):
            total += entry.lstat().st_blocks * 512
    return total


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive lock on ``directory`` itself among the processes of this machine (no file is added)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def format_bytes(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
