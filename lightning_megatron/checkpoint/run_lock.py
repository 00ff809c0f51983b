"""One training run at a time per checkpoint folder: a lock file held for the run's life.

Two runs saving into one folder would both train, give each other's names ``-v1`` suffixes, and leave a
``last`` that is either run's; the second one's start would also finish or remove the first one's save in
flight (``replacement.finish_interrupted_saves``). So global rank zero of a fitting run takes an exclusive
``flock`` on ``<folder>/.lightning_megatron.run.lock`` before the first step and keeps it until the run ends,
with who holds it written inside (pid, host, start, command). A second run is refused with the folder, the
holder and the fix. The kernel drops the lock of a process that died, so a crashed run's lock is taken over
by the next one, which says whose it was. A run that ends removes the file, so a finished run leaves only its
checkpoints in the folder (scripts that list it see no extra entry); a lock taken on a file that was removed
meanwhile is dropped and taken again on the file now there, so a removal never lets two runs hold the lock. Taking
the lock also creates the folder, so a folder this run cannot write is reported at the start rather than at the
first save, steps later.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from pathlib import Path
from typing import IO, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

RUN_LOCK_FILE = ".lightning_megatron.run.lock"


def _holder(file: IO) -> Optional[dict]:
    """Who the lock file says holds (or last held) it; None for an empty (released) or unreadable one."""
    file.seek(0)
    try:
        holder = json.loads(file.read() or "null")
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: Optional[dict]) -> str:
    if holder is None:
        return "a run that did not say who it is"
    return (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')} "
            f"({holder.get('command')})")


def _in_use(directory: Path, holder: Optional[dict]) -> RuntimeError:
    return RuntimeError(
        f"Checkpoint directory {directory} is in use by another training run: {_describe(holder)}. Two runs saving "
        f"into one folder would mix their checkpoints, and ckpt_path=\"last\" would resume either. Wait for that run "
        f"to end, or give this one its own folder (ModelCheckpoint(dirpath=...) or Trainer(default_root_dir=...)). "
        f"If that run is gone but its machine holds the lock (a hung process), end it; the lock is "
        f"{directory / RUN_LOCK_FILE}.")


def _unwritable(directory: Path, error: OSError) -> RuntimeError:
    return RuntimeError(
        f"Checkpoint directory {directory} cannot be written ({type(error).__name__}: {error.strerror or error}). "
        f"Checkpoints would fail at the first save; choose a folder this run can write "
        f"(ModelCheckpoint(dirpath=...) or Trainer(default_root_dir=...)).")


def _try_lock(file: IO, directory: Path) -> bool:
    """An exclusive, non-blocking flock; False where another process holds it. A filesystem without locks is
    warned about (concurrent runs then go unnoticed) and counts as locked."""
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        rank_zero_warn(f"The filesystem of {directory} does not support locks ({error.strerror}): a second run "
                       f"started with this checkpoint folder would not be noticed.")
    return True


def check_not_in_use(directory: Path) -> None:
    """Without taking it: raise if a live run holds ``directory``'s lock. Every process of a starting run calls
    this before touching the folder, so all of them refuse alike, before any collective."""
    try:
        file = open(directory / RUN_LOCK_FILE)
    except OSError:
        return  # no lock file (or none that can be read): RunLock.take, at the start of training, says why
    with file:
        if not _try_lock(file, directory):
            raise _in_use(directory, _holder(file))
        fcntl.flock(file, fcntl.LOCK_UN)


class RunLock:
    """The lock of one checkpoint folder, held by this process from :meth:`take` to :meth:`release`."""

    def __init__(self, directory: Path, file: IO) -> None:
        self.directory, self._file = directory, file

    @classmethod
    def take(cls, directory) -> "RunLock":
        """Create ``directory`` if needed and lock it; raises ``RuntimeError`` when it cannot be written or
        another run holds it. A lock left by a run that ended without releasing it is taken over, said in the log."""
        directory = Path(directory)
        while True:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                file = open(directory / RUN_LOCK_FILE, "a+")
                if not os.access(directory, os.W_OK | os.X_OK):  # the lock file may exist where no new file can go
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(directory))
            except OSError as error:
                raise _unwritable(directory, error) from error
            if not _try_lock(file, directory):
                holder = _holder(file)
                file.close()
                raise _in_use(directory, holder)
            if _is_the_file_at(file, directory / RUN_LOCK_FILE):
                break
            file.close()  # a run that just ended removed the file we opened: lock the one there now
        previous = _holder(file)
        if previous is not None:
            rank_zero_info(f"Checkpoint directory {directory}: taking over the lock of a run that ended without "
                           f"releasing it ({_describe(previous)}).")
        file.seek(0)
        file.truncate()
        json.dump({"pid": os.getpid(), "host": socket.gethostname(),
                   "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                   "command": " ".join(sys.argv)}, file)
        file.flush()
        return cls(directory, file)

    def release(self) -> None:
        """Remove the file while still holding its lock, then unlock it. A process that opened the file before
        the removal and locks it afterwards finds it is no longer the file at that path and takes again."""
        if self._file.closed:
            return
        try:
            (self.directory / RUN_LOCK_FILE).unlink()
        except FileNotFoundError:
            pass
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()


def _is_the_file_at(file: IO, path: Path) -> bool:
    """Whether the open ``file`` is still the one ``path`` names (not removed, nor replaced by a new file)."""
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(file.fileno())
    return (opened.st_dev, opened.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def take_all(directories) -> list[RunLock]:
    """:meth:`RunLock.take` for each directory, or none of them (those taken are released when one fails)."""
    locks: list[RunLock] = []
    try:
        for directory in directories:
            locks.append(RunLock.take(directory))
    except BaseException:
        release_all(locks)
        raise
    return locks


def release_all(locks) -> None:
    for lock in locks or []:
        lock.release()
