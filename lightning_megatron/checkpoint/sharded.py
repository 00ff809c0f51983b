"""Sharded checkpoint directories: each rank writes its own boxes, any layout reads them.

A checkpoint is a directory (named like Lightning's files, e.g. ``epoch=0-step=300.ckpt``)::

    .metadata            torch.distributed.checkpoint's index: global name -> global shape, dtype, chunks
    __<rank>_<n>.distcp  the tensors, each rank writing only what it holds (replicas written once)
    trainer_state.pt     everything else Lightning saves (loops, callbacks, LR schedulers, hyper-parameters,
                         optimizer hyper-parameters, loss scaler, RNG states), read with weights_only=True
    megatron_3d.json     what ``lightning-megatron checkpoint inspect`` shows first: format, layout, step

Saves are atomic: everything is written to ``.<name>.partial`` next to the target and renamed
into place once every rank has finished (``checkpoint.replacement``), so a crash mid-save leaves
the previous checkpoint (and never a half-written one under the real name). ``megatron_3d.json``
is written last and (``checksums=True``, the strategy's default) records a CRC-32 of every file, which loading
(``verify_checksums``) and ``lightning-megatron checkpoint verify`` compare. Loading checks the files against the
index before any collective, so a missing or truncated shard or a checkpoint of another model
stops every rank with one clear error instead of a hang or a partial load.
"""

from __future__ import annotations

import io
import json
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_megatron.checksums import file_crc32
from lightning_megatron.checkpoint.pieces import ShardedEntry
from lightning_megatron.checkpoint.shared_storage import check_shards_here, where
from lightning_megatron.parallel.agree import all_gather_objects
from lightning_megatron.checkpoint.replacement import (  # noqa: F401 (write_atomically, replaced_path: re-exported)
    INDEX_FILE,
    INFO_FILE,
    TRAINER_STATE_FILE,
    PathLike,
    exists,
    explain_full_disk,
    finish_interrupted,
    move_into_place,
    partial_path,
    remove,
    replaced_path,
    report,
    write_atomically,
)

FORMAT = "lightning-megatron-sharded"
FORMAT_VERSION = 1
CHECKSUM_ALGORITHM = "crc32"

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


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def start_save(path: PathLike) -> Path:
    """Collective. An empty ``.<name>.partial`` directory. What a crashed save of this name left is first
    brought to where that save was going (``finish_interrupted``): nothing complete is lost to the new one."""
    partial = partial_path(path)
    if _is_rank_zero():
        report(finish_interrupted(path))
        partial.mkdir(parents=True)
    _barrier()
    return partial


def write_tensors(partial: Path, tensors: Entries, *, process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Collective: every rank writes its boxes (DCP dedupes replicas), the coordinator writes the index."""
    with warnings.catch_warnings():  # a single process without torch.distributed is a legitimate writer
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(dict(tensors), storage_writer=FileSystemWriter(partial, thread_count=1), planner=_SavePlanner(),
                 process_group=process_group, no_dist=not dist.is_initialized())


def file_checksum(path: Path) -> str:
    """The file's CRC-32 as recorded in ``megatron_3d.json`` (its cost, measured once: ``benchmarks/README.md``,
    "Recorded results")."""
    return f"{file_crc32(path):08x}"


def checksum_own_files(partial: Path, rank: int) -> dict[str, dict]:
    """The checksums of the files this rank wrote: its shards (DCP names them ``__<rank>_<n>.distcp``) and,
    on rank zero, the index and the trainer state."""
    files = sorted(partial.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        files += [partial / INDEX_FILE, partial / TRAINER_STATE_FILE]
    return {file.name: {CHECKSUM_ALGORITHM: file_checksum(file), "bytes": file.stat().st_size} for file in files}


def serialize_trainer_state(trainer_state: Mapping[str, Any]) -> bytes:
    """``trainer_state.pt``'s bytes, made when the save starts (Lightning's dict refers to live objects)."""
    buffer = io.BytesIO()
    torch.save(dict(trainer_state), buffer)
    return buffer.getvalue()


def entry_bytes(tensors: Entries) -> int:
    """The bytes of this rank's tensors (replicas included: DCP writes each box once)."""
    return sum(sum(piece.numel() * piece.element_size() for piece in value.pieces.values())
               if isinstance(value, ShardedEntry) else value.numel() * value.element_size() for value in tensors.values())


def _report(error: Optional[BaseException]) -> Optional[str]:
    return None if error is None else f"{type(error).__name__}: {error}"


def _agree_on_failure(error: Optional[BaseException], partial: Path, path: Path, needed: int,
                      group: Optional[dist.ProcessGroup]) -> None:
    """Collective: if any rank failed, rank zero removes the unfinished directory and every rank raises (the
    failing rank its own error, explained if the disk is full; the others one that names it)."""
    reports = all_gather_objects(_report(error), group)
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if not failed:
        return
    if _is_rank_zero() and exists(partial):
        remove(partial)
    if error is None:
        rank, report = failed[0]
        raise RuntimeError(f"Saving checkpoint {path} failed on rank {rank} ({report}); nothing was saved and the "
                           f"unfinished files were removed.")
    explained = explain_full_disk(error, path, needed_bytes=needed)
    if explained is error:
        raise error
    raise explained from error


def write_sharded(partial: Path, path: PathLike, tensors: Entries, trainer_state: Optional[bytes],
                  info: Mapping[str, Any], *, checksums: bool, process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Collective: fill ``partial`` (the tensors, rank zero's trainer state, each rank's checksums) and rename
    it into place. A failure on any rank (a full disk, say) is raised on every rank once rank zero has
    removed the unfinished directory; the checkpoint under ``path`` is then as it was. Three small
    gathers: the bytes needed, the checksums with any error (and where each rank runs: rank zero checks that
    every rank's shards are in its view of ``partial``, ``shared_storage``), the outcome of the rename."""
    path = Path(path)
    rank = dist.get_rank(process_group) if dist.is_initialized() else 0
    needed = sum(all_gather_objects(entry_bytes(tensors), process_group))
    error: Optional[BaseException] = None
    try:
        write_tensors(partial, tensors, process_group=process_group)  # DCP raises a failure on every rank
        if rank == 0:
            with open(partial / TRAINER_STATE_FILE, "wb") as out:
                out.write(trainer_state or b"")
        table = checksum_own_files(partial, rank) if checksums else {}
    except BaseException as caught:
        error, table = caught, {}
    tables = all_gather_objects((table, _report(error), where()), process_group)
    if any(report is not None for _, report, _ in tables):
        _agree_on_failure(error, partial, path, needed, process_group)
    if rank == 0:
        try:
            check_shards_here(partial, path, [place for _, _, place in tables])
            finish_save(partial, path, info, {name: entry for table, _, _ in tables for name, entry in table.items()}
                        if checksums else None)
        except BaseException as caught:
            error = caught
    _agree_on_failure(error, partial, path, needed, process_group)


def finish_save(partial: Path, path: PathLike, info: Mapping[str, Any], checksums: Optional[dict] = None) -> None:
    """Rank zero only, after every rank's files are on disk: the info file (last: it marks the save
    complete), then the rename into place."""
    info = {"format": FORMAT, "format_version": FORMAT_VERSION, **info}
    if checksums is not None:
        info["checksums"] = {"algorithm": CHECKSUM_ALGORITHM, "files": checksums}
    with open(partial / INFO_FILE, "w") as out:
        json.dump(info, out, indent=2, default=str)
        out.flush()
        os.fsync(out.fileno())
    move_into_place(partial, Path(path))


def save_sharded(path: PathLike, tensors: Entries, trainer_state: Mapping[str, Any], info: Mapping[str, Any], *,
                 checksums: bool = False) -> None:
    """Collective over the world: write a sharded checkpoint directory atomically."""
    state = serialize_trainer_state(trainer_state) if _is_rank_zero() else None
    write_sharded(start_save(path), path, tensors, state, info, checksums=checksums)


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

    def save(self, path: PathLike, tensors: Entries, trainer_state: Mapping[str, Any], info: Mapping[str, Any], *,
             checksums: bool = False) -> None:
        """Collective over the world (returns once the copies are made)."""
        self.wait()
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")  # CPU copies: gloo, whatever the training backend
        partial = start_save(path)
        state = serialize_trainer_state(trainer_state) if _is_rank_zero() else None
        staged = {name: value.to_cpu() if isinstance(value, ShardedEntry) else value.detach().to("cpu", copy=True)
                  for name, value in tensors.items()}

        def write() -> None:
            try:
                write_sharded(partial, path, staged, state, info, checksums=checksums, process_group=self._group)
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
    """A directory, or a name whose replacement was interrupted (``finish_interrupted`` recovers it)."""
    return Path(path).is_dir() or (not Path(path).exists() and (replaced_path(path).is_dir() or partial_path(path).is_dir()))


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
        hidden = [hidden for hidden in (partial_path(path), replaced_path(path)) if hidden.exists()]
        hint = (f" A save was interrupted while replacing it; what it left is at {' and '.join(map(str, hidden))} "
                f"(the previous checkpoint is intact at {replaced_path(path)}): the next run of a Trainer with "
                f"this strategy, or `lightning-megatron checkpoint recover {path}`, gives the newest complete one "
                f"its name." if hidden else "")
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


def verify_checksums(saved: SavedCheckpoint, *, rank: int = 0, world_size: int = 1) -> int:
    """Compare the files with the checksums the save recorded (this rank's share: every ``world_size``-th
    file from ``rank``); returns the bytes read. Raises ``RuntimeError`` naming a file whose content changed,
    and when the checkpoint recorded no checksums."""
    recorded = saved.info.get("checksums")
    if not recorded:
        raise RuntimeError(f"Checkpoint {saved.path} records no checksums (it was saved with checkpoint_checksums="
                           f"False, or by an earlier lightning-megatron), so its content cannot be verified. To load "
                           f"it unchecked, use Megatron3DStrategy(verify_checkpoint='recorded'); to give it "
                           f"checksums, load it and save it again.")
    algorithm = recorded.get("algorithm")
    if algorithm != CHECKSUM_ALGORITHM:
        raise RuntimeError(f"{saved.path / INFO_FILE} records {algorithm!r} checksums; this version verifies "
                           f"{CHECKSUM_ALGORITHM!r}.")
    read = 0
    for name, expected in sorted(recorded["files"].items())[rank::world_size]:
        file = saved.path / name
        if not file.is_file():
            raise RuntimeError(f"Checkpoint file {file} is missing (its checksum is recorded in {INFO_FILE}).")
        actual = file_checksum(file)
        read += file.stat().st_size
        if actual != expected[CHECKSUM_ALGORITHM]:
            raise RuntimeError(f"Checkpoint file {file} is damaged: its {algorithm} is {actual}, the save recorded "
                               f"{expected[CHECKSUM_ALGORITHM]} ({expected['bytes']:,} bytes then, "
                               f"{file.stat().st_size:,} now); nothing was loaded from it. Copy the checkpoint "
                               f"directory again from where it came from, or resume from an earlier checkpoint "
                               f"(`lightning-megatron checkpoint verify DIR` compares another one's files).")
    return read


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
