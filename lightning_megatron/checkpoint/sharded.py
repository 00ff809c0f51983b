"""Sharded checkpoint directories: each rank writes its own boxes, any layout reads them.

A checkpoint is a directory (named like Lightning's files, e.g. ``epoch=0-step=300.ckpt``)::

    .metadata            torch.distributed.checkpoint's index: global name -> global shape, dtype, chunks
    __<rank>_<n>.distcp  the tensors, each rank writing only what it holds (replicas written once)
    trainer_state.pt     everything else Lightning saves (loops, callbacks, LR schedulers, hyper-parameters,
                         optimizer hyper-parameters, loss scaler, RNG states), read with weights_only=True
    megatron_3d.json     what ``lightning-megatron checkpoint inspect`` shows first: format, layout, step

Saves are atomic: everything is written to ``.<name>.partial`` next to the target and renamed
into place once every rank has finished, so a crash mid-save leaves the previous checkpoint
(and never a half-written one under the real name). Loading checks the files against the
index before any collective, so a missing or truncated shard or a checkpoint of another model
stops every rank with one clear error instead of a hang or a partial load.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_megatron.checkpoint.pieces import ShardedEntry

FORMAT = "lightning-megatron-sharded"
FORMAT_VERSION = 1
INFO_FILE = "megatron_3d.json"
TRAINER_STATE_FILE = "trainer_state.pt"
INDEX_FILE = ".metadata"

PathLike = Union[str, os.PathLike]
Entries = Mapping[str, Union[ShardedEntry, Tensor]]


class _SavePlanner(DefaultSavePlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index):
        entry = self.state_dict[index.fqn]
        return entry.piece_at(index.offset) if isinstance(entry, ShardedEntry) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # The default set-up rebuilds the dict through a walk that knows only torch's tensor types and would
        # drop our entries; nothing here is on the meta device or nested, so there is nothing to rebuild.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index):
        entry = self.state_dict[index.fqn]
        return entry.piece_at(index.offset) if isinstance(entry, ShardedEntry) else super().lookup_tensor(index)

    def load_bytes(self, read_item, value) -> None:
        raise RuntimeError(f"Checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; sharded checkpoints "
                           f"hold tensors only and pickles are never loaded.")


def partial_path(path: PathLike) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}.partial")


def write_atomically(path: PathLike, write: Callable[[Path], None]) -> None:
    """``write(partial)`` writes one file next to ``path``, which then replaces ``path`` in one rename."""
    partial = partial_path(path)
    write(partial)
    os.replace(partial, path)


def replaced_path(path: PathLike) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}.replaced")


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def start_save(path: PathLike) -> Path:
    """Collective. An empty ``.<name>.partial`` directory (left-overs of a crashed save are discarded)."""
    partial = partial_path(path)
    if _is_rank_zero():
        _remove(partial)
        partial.mkdir(parents=True)
    _barrier()
    return partial


def write_tensors(partial: Path, tensors: Entries, *, process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Collective: every rank writes its boxes (DCP dedupes replicas), the coordinator writes the index."""
    with warnings.catch_warnings():  # a single process without torch.distributed is a legitimate writer
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(dict(tensors), storage_writer=FileSystemWriter(partial, thread_count=1), planner=_SavePlanner(),
                 process_group=process_group, no_dist=not dist.is_initialized())


def write_trainer_state(partial: Path, trainer_state: Mapping[str, Any]) -> None:
    """Rank zero only."""
    torch.save(dict(trainer_state), partial / TRAINER_STATE_FILE)


def finish_save(partial: Path, path: PathLike, info: Mapping[str, Any]) -> None:
    """Rank zero only, after every rank's tensors are on disk: the info file, then the rename into place."""
    info_file = partial / INFO_FILE
    with open(info_file, "w") as out:
        json.dump({"format": FORMAT, "format_version": FORMAT_VERSION, **info}, out, indent=2, default=str)
        out.flush()
        os.fsync(out.fileno())
    final, replaced = Path(path), replaced_path(path)
    if final.exists() or final.is_symlink():
        _remove(replaced)
        os.rename(final, replaced)  # the old checkpoint stays whole until the new one has its name
    os.rename(partial, final)
    _remove(replaced)


def save_sharded(path: PathLike, tensors: Entries, trainer_state: Mapping[str, Any], info: Mapping[str, Any]) -> None:
    """Collective over the world: write a sharded checkpoint directory atomically."""
    partial = start_save(path)
    if _is_rank_zero():
        write_trainer_state(partial, trainer_state)
    write_tensors(partial, tensors)
    if _is_rank_zero():
        finish_save(partial, path, info)
    _barrier()


class BackgroundSaver:
    """Writes sharded checkpoints in a background thread while training goes on.

    ``save`` copies this rank's boxes to CPU memory (the only pause training sees), then a thread
    writes them over a process group of its own (the training's collectives keep the default
    one) and rank zero renames the directory into place once every rank's data is down. One
    save is in flight at a time: the next ``save``, ``wait`` or teardown waits for it.
    """

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._group: Optional[dist.ProcessGroup] = None
        self.pending: Optional[Path] = None

    def save(self, path: PathLike, tensors: Entries, trainer_state: Mapping[str, Any], info: Mapping[str, Any]) -> None:
        """Collective over the world (returns once the copies are made)."""
        self.wait()
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")  # CPU copies: gloo, whatever the training backend
        partial = start_save(path)
        if _is_rank_zero():
            write_trainer_state(partial, trainer_state)  # now: Lightning's dict refers to live objects
        staged = {name: value.to_cpu() if isinstance(value, ShardedEntry) else value.detach().to("cpu", copy=True)
                  for name, value in tensors.items()}

        def write() -> None:
            try:
                write_tensors(partial, staged, process_group=self._group)
                if _is_rank_zero():
                    finish_save(partial, path, info)
            except BaseException as error:  # re-raised by wait() in the training thread
                self._error = error

        self.pending = Path(path)
        self._thread = threading.Thread(target=write, name=f"save {Path(path).name}", daemon=True)
        self._thread.start()

    def wait(self, *, together: bool = True) -> None:
        """Block until the save in flight is complete (renamed into place on every rank's view when
        ``together``: a collective; pass False when another rank may have failed)."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread, pending = None, self.pending
        self.pending = None
        if together and dist.is_initialized():
            dist.barrier(group=self._group)
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"Saving checkpoint {pending} in the background failed: {error}") from error


def is_sharded_checkpoint(path: PathLike) -> bool:
    """A directory, or a name whose replacement was interrupted (``open_sharded`` explains how to recover)."""
    return Path(path).is_dir() or (not Path(path).exists() and replaced_path(path).is_dir())


@dataclass
class SavedCheckpoint:
    """A validated sharded checkpoint directory: its ``info`` (megatron_3d.json) and DCP index."""

    path: Path
    info: dict[str, Any]
    index: Metadata

    def tensors(self) -> dict[str, TensorStorageMetadata]:
        return {name: md for name, md in self.index.state_dict_metadata.items()
                if isinstance(md, TensorStorageMetadata)}

    def trainer_state(self) -> dict[str, Any]:
        file = self.path / TRAINER_STATE_FILE
        try:
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as error:
            raise RuntimeError(f"Could not read {file}: {error}. The checkpoint is damaged; use another one.") from error


def open_sharded(path: PathLike) -> SavedCheckpoint:
    """Check a checkpoint directory without any collective: every rank reaches the same verdict.

    Raises ``FileNotFoundError``/``RuntimeError`` naming the file and what is wrong with it.
    """
    path = Path(path)
    if not path.exists():
        replaced = replaced_path(path)
        hint = (f" A save was interrupted while replacing it; the previous checkpoint is intact at {replaced}: "
                f"rename it to {path.name}." if replaced.exists() else "")
        raise FileNotFoundError(f"Checkpoint {path} does not exist.{hint}")
    if not path.is_dir():
        raise RuntimeError(f"{path} is a file, not a sharded checkpoint directory.")
    info_file, index_file = path / INFO_FILE, path / INDEX_FILE
    for required in (info_file, index_file, path / TRAINER_STATE_FILE):
        if not required.is_file():
            raise RuntimeError(f"Checkpoint {path} is incomplete: {required.name} is missing. Only directories that "
                               f"a save finished are complete (unfinished ones are named .<name>.partial).")
    try:
        info = json.loads(info_file.read_text())
    except ValueError as error:
        raise RuntimeError(f"{info_file} is not valid JSON ({error}); the checkpoint is damaged.") from error
    if info.get("format") != FORMAT:
        raise RuntimeError(f"{info_file} says format={info.get('format')!r}, expected {FORMAT!r}: "
                           f"this is not a lightning-megatron sharded checkpoint.")
    if info.get("format_version", 0) > FORMAT_VERSION:
        raise RuntimeError(f"{info_file} has format_version {info['format_version']}; this lightning-megatron reads "
                           f"up to {FORMAT_VERSION}. Upgrade lightning-megatron.")
    try:
        index = FileSystemReader(path).read_metadata()
    except Exception as error:
        raise RuntimeError(f"Could not read the checkpoint index {index_file}: {error}. The checkpoint is damaged.") from error
    _check_shard_files(path, index)
    return SavedCheckpoint(path, info, index)


def _check_shard_files(path: Path, index: Metadata) -> None:
    needed: dict[str, int] = {}
    for item in (index.storage_data or {}).values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise RuntimeError(f"Checkpoint shard {file} is missing (the index {path / INDEX_FILE} lists it). "
                               f"Copy the whole checkpoint directory, or use another checkpoint.")
        actual = file.stat().st_size
        if actual < size:
            raise RuntimeError(f"Checkpoint shard {file} is truncated: {actual} bytes, the index needs {size}. "
                               f"Copy the whole checkpoint directory again, or use another checkpoint.")


def check_compatible(saved: SavedCheckpoint, entries: Entries, *, what: str) -> None:
    """Every entry this rank wants exists with the same global shape (else the checkpoint is of another model)."""
    available = saved.tensors()
    missing = [name for name in entries if name not in available]
    if missing:
        shown = ", ".join(repr(name) for name in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise RuntimeError(f"Checkpoint {saved.path} has no {what} {shown}. It was saved from "
                           f"{saved.info.get('model', 'another model')}; load it into that model.")
    for name, entry in entries.items():
        if tuple(available[name].size) != tuple(entry.size()):
            raise RuntimeError(f"Checkpoint {saved.path}: {what} {name!r} has shape {tuple(available[name].size)} but "
                               f"this model's is {tuple(entry.size())}. The checkpoint belongs to a model of another size.")


def read_tensors(saved: SavedCheckpoint, entries: Entries) -> None:
    """Collective: fill ``entries`` (views of this rank's tensors) from the checkpoint, resharding as needed."""
    try:
        dcp.load(dict(entries), storage_reader=FileSystemReader(saved.path), planner=_LoadPlanner())
    except Exception as error:
        raise RuntimeError(f"Reading the tensors of checkpoint {saved.path} failed: {error}") from error


def read_full_tensors(path: PathLike, names: Optional[list[str]] = None) -> dict[str, Tensor]:
    """One process, no collectives: whole tensors under their global names (for consolidation and inspection)."""
    saved = open_sharded(path)
    wanted = {name: md for name, md in saved.tensors().items() if names is None or name in names}
    tensors = {name: torch.empty(tuple(md.size), dtype=md.properties.dtype) for name, md in wanted.items()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(tensors, storage_reader=FileSystemReader(saved.path), planner=_LoadPlanner(), no_dist=True)
    except Exception as error:
        raise RuntimeError(f"Reading the tensors of checkpoint {saved.path} failed: {error}") from error
    return tensors


def consolidated_state_dict(path: PathLike) -> dict[str, Tensor]:
    """The LightningModule's full state dict from a sharded checkpoint, in one process (no collectives)."""
    prefix = "state_dict/"
    names = [name for name in open_sharded(path).tensors() if name.startswith(prefix)]
    return {name[len(prefix):]: tensor for name, tensor in read_full_tensors(path, names).items()}
