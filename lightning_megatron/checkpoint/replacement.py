"""How a checkpoint takes its name on disk, and what a save may replace.

A save writes everything under ``.<name>.partial`` beside the target and renames it into
place once it is complete. A previous checkpoint of that name is first renamed to
``.<name>.replaced`` and removed only once the new one holds the name. So at every instant
one complete checkpoint can be found: under its name or, after a crash between the two
renames, under one of the hidden names (``checkpoint.recovery`` finishes such saves).

A save only ever replaces what is recognisably a checkpoint: one of our sharded
directories, a ``torch.save`` file (Lightning overwrites its own ``.ckpt`` files too), a
Hugging Face export we wrote, or an empty directory. Anything else at the target (a
directory of the user's files, say ``runs/`` where ``runs/final.ckpt`` was meant) is refused
with an error naming what is there, and nothing is written or removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import struct
import sys
import zipfile
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

PathLike = Union[str, os.PathLike]

# The files of a sharded checkpoint directory (checkpoint.sharded names them; kept here so that
# recognising a checkpoint needs no import of the code that writes one).
INFO_FILE = "megatron_3d.json"
TRAINER_STATE_FILE = "trainer_state.pt"
INDEX_FILE = ".metadata"
SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")
# What our Hugging Face exports carry in model.safetensors' metadata (a sharded export: in every shard's, and
# in the "metadata" of model.safetensors.index.json).
EXPORT_MARK = {"written_by": "lightning-megatron"}
HF_INDEX_FILE = "model.safetensors.index.json"
HF_EXPORT_FILES = ("config.json", "model.safetensors", HF_INDEX_FILE)
LOCK_FILE = ".lightning_megatron.lock"


def partial_path(path: PathLike) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}.partial")


def replaced_path(path: PathLike) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}.replaced")


def target_of(hidden: Path) -> Optional[Path]:
    """``dir/name`` for ``dir/.name.partial`` or ``dir/.name.replaced``; None for other names."""
    match = re.fullmatch(r"\.(.+)\.(partial|replaced)", hidden.name)
    return hidden.with_name(match.group(1)) if match else None


def exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif exists(path):
        path.unlink()


def size_on_disk(path: Path) -> int:
    if path.is_file() or path.is_symlink():
        return path.lstat().st_size
    return sum(file.lstat().st_size for file in path.rglob("*") if file.is_file())


def describe(path: Path) -> str:
    """What is at ``path``, for an error message: "a file of 12 bytes", "a directory holding notes.txt, data/"."""
    if path.is_symlink() and not path.exists():
        return f"a dangling symbolic link to {os.readlink(path)}"
    if not path.is_dir():
        return f"a file of {path.stat().st_size} bytes"
    entries = sorted(path.iterdir())
    if not entries:
        return "an empty directory"
    names = [entry.name + ("/" if entry.is_dir() else "") for entry in entries[:4]]
    more = f" and {len(entries) - 4} more" if len(entries) > 4 else ""
    return f"a directory holding {', '.join(names)}{more} ({size_on_disk(path):,} bytes)"


def is_sharded_checkpoint_dir(path: Path) -> bool:
    """A directory of only our checkpoint files, with at least its index or info file (a damaged one counts)."""
    if not path.is_dir() or path.is_symlink():
        return False
    names = [entry.name for entry in path.iterdir()]
    ours = {INFO_FILE, TRAINER_STATE_FILE, INDEX_FILE}
    return (bool(names) and (INFO_FILE in names or INDEX_FILE in names)
            and all(name in ours or SHARD_FILE.fullmatch(name) for name in names))


def is_torch_file(path: Path) -> bool:
    """A complete ``torch.save`` archive (a zip whose central directory, written last, is present)."""
    if not path.is_file():
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("data.pkl") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def safetensors_metadata(path: Path) -> Optional[dict]:
    """The ``__metadata__`` of a safetensors file, read from its header alone (None if it is not one)."""
    try:
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            if length > 100_000_000:
                return None
            header = json.loads(file.read(length))
    except (OSError, ValueError, struct.error):
        return None
    return header.get("__metadata__", {}) if isinstance(header, dict) else None


def is_our_safetensors(path: Path) -> bool:
    """A file ``checkpoint consolidate`` wrote (its metadata says format=lightning-megatron)."""
    metadata = safetensors_metadata(path) if path.is_file() else None
    return metadata is not None and metadata.get("format") == "lightning-megatron"


def _index_metadata(path: Path) -> Optional[dict]:
    try:
        metadata = json.loads(path.read_text()).get("metadata")
    except (OSError, ValueError, AttributeError):
        return None
    return metadata if isinstance(metadata, dict) else None


def is_our_hf_export(path: Path) -> bool:
    """A directory whose ``model.safetensors`` (or, sharded, whose index) carries our export mark."""
    if not path.is_dir():
        return False
    single = path / "model.safetensors"
    metadata = safetensors_metadata(single) if exists(single) else _index_metadata(path / HF_INDEX_FILE)
    return metadata is not None and all(metadata.get(key) == value for key, value in EXPORT_MARK.items())


def check_replaceable(path: PathLike, *, what: str = "checkpoint", hf_export: bool = False) -> None:
    """Raise ``FileExistsError`` unless ``path`` is absent or something a save may replace.

    ``hf_export``: the save writes a Hugging Face directory, which may replace only such a
    directory that we exported (or an empty one); else a checkpoint directory or file."""
    path = Path(path)
    if not exists(path):
        return
    if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
        return
    if hf_export:  # the export writes config.json and its weight files (and index), nothing else of the directory
        if is_our_hf_export(path) or (path.is_dir() and not any(exists(path / name) for name in HF_EXPORT_FILES)):
            return
        expected = "a Hugging Face export written by lightning-megatron (or a directory without a model)"
    else:
        if is_sharded_checkpoint_dir(path) or is_torch_file(path) or is_our_safetensors(path):
            return
        expected = "a lightning-megatron checkpoint or a torch.save checkpoint file"
    raise FileExistsError(
        f"Refusing to write the {what} to {path}: it exists and is not {expected}; it is {describe(path)}. "
        f"Nothing was written or removed. Choose a new path (e.g. {path / ('final.ckpt' if not hf_export else 'hf')}) "
        f"or move {path} away first.")


def write_atomically(path: PathLike, write: Callable[[Path], None]) -> None:
    """``write(partial)`` writes one file next to ``path``, which then replaces ``path`` in one rename.
    A failed write removes its partial file and leaves ``path`` as it was."""
    path = Path(path)
    partial = partial_path(path)
    try:
        write(partial)
    except BaseException as error:
        if exists(partial):
            remove(partial)
        explained = explain_full_disk(error, path)
        if explained is error:
            raise
        raise explained from error
    os.replace(partial, path)


def move_into_place(partial: Path, path: Path) -> None:
    """The two renames of a replacement: the old checkpoint aside, the new one into its name, then the old one gone."""
    replaced = replaced_path(path)
    if exists(path):
        if exists(replaced):  # an older version left by an earlier crash; the one at ``path`` is newer
            remove(replaced)
        os.rename(path, replaced)  # the old checkpoint stays whole until the new one has its name
    os.rename(partial, path)
    if exists(replaced):
        remove(replaced)


def is_complete_save(path: Path) -> bool:
    """Whether a save got to its end: a sharded directory's info file is written last (after every
    rank's shards and the index), a ``torch.save`` file's zip directory last, a safetensors file
    is complete once its header parses. Without that mark a save is provably incomplete."""
    if path.is_dir():
        try:
            return json.loads((path / INFO_FILE).read_text()).get("format") is not None
        except (OSError, ValueError, AttributeError):
            return False
    return is_torch_file(path) or safetensors_metadata(path) is not None


def finish_interrupted(path: PathLike) -> list[str]:
    """Bring ``path`` to where the last save of it was going; return what was done, one line each.

    A complete ``.<name>.partial`` (the save crashed before or between its renames) takes the
    name; an incomplete one is removed; if neither the name nor a complete partial is there, a
    complete ``.<name>.replaced`` gets its name back; a ``.<name>.replaced`` left beside a
    checkpoint that already took the name was about to be removed, and is. Nothing complete is
    removed but the version that a complete newer one replaces. One process at a time (rank
    zero, or under ``checkpoint.recovery``'s lock)."""
    path = Path(path)
    partial, replaced = partial_path(path), replaced_path(path)
    done = []
    if exists(partial):
        if is_complete_save(partial):
            move_into_place(partial, path)
            return [f"finished an interrupted save: {partial.name} was complete and now is {path}"]
        size = size_on_disk(partial)
        remove(partial)
        done.append(f"removed {partial} ({size:,} bytes): a save that did not finish")
    if exists(replaced):
        if not exists(path) and is_complete_save(replaced):
            os.rename(replaced, path)
            done.append(f"restored {path} from {replaced.name}: a save replacing it was interrupted")
        elif exists(path) and is_complete_save(path):
            remove(replaced)
            done.append(f"removed {replaced}: the previous version of {path.name}, which a finished save replaced")
    return done


def report(lines: list[str]) -> None:
    """What recovery did, one line each, on stderr (every process that did something says so)."""
    for line in lines:
        print(f"lightning-megatron: {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive lock on ``directory`` among the processes of this machine (and NFS clients)."""
    with open(directory / LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def finish_interrupted_saves(directory: PathLike) -> list[str]:
    """``finish_interrupted`` for every name in ``directory`` that a save left hidden files for; safe to run
    from many processes at once (one at a time, under a lock file in the directory)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    with _locked(directory):
        targets = sorted({target for entry in directory.iterdir() if (target := target_of(entry)) is not None})
        return [line for target in targets for line in finish_interrupted(target)]


FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def find_full_disk_error(error: BaseException) -> Optional[OSError]:
    """The ``OSError`` for a full disk (or quota, or file-size limit) anywhere in ``error``'s causes, or in the
    per-rank failures of torch.distributed.checkpoint's ``CheckpointException``."""
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in FULL_DISK_ERRNOS:
            return current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            pending.extend(value for value in failures.values() if isinstance(value, BaseException))
        pending.extend(cause for cause in (current.__cause__, current.__context__) if cause is not None)
        pending.extend(getattr(current, "exceptions", ()))
    return None


def explain_full_disk(error: BaseException, path: Path, *, needed_bytes: Optional[int] = None) -> BaseException:
    """``error`` itself, or for a full disk an ``OSError`` that says so, with the sizes. A full disk is an
    ``ENOSPC``/``EDQUOT``/``EFBIG`` among the causes, or (some writers, torch.save's among them, drop the
    errno) any failed write while the filesystem has less room than the save needs."""
    directory = path.parent if path.parent.exists() else Path(".")
    free = shutil.disk_usage(directory).free
    full = find_full_disk_error(error)
    if full is None and (needed_bytes is None or free >= needed_bytes):
        return error
    code = full.errno if full is not None else errno.ENOSPC
    reason = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded",
              errno.EFBIG: "File size limit exceeded"}[code]
    needed = f", needs up to {needed_bytes:,} bytes" if needed_bytes is not None else ""
    previous = f" The previous checkpoint at {path} is untouched." if exists(path) else ""
    return OSError(code, f"{reason}: {path}{needed} ({free:,} bytes free on that filesystem). Nothing was saved "
                         f"and the unfinished files were removed.{previous} Free some space or save elsewhere.")
