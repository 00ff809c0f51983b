"""Sharded checkpoints need a directory that every node sees; where one does not, every rank refuses.

Every rank writes its own shards into the checkpoint directory, but rank 0 alone writes the index
(``.metadata``), ``trainer_state.pt`` and ``megatron_3d.json`` and renames the finished directory into
place, and a resume reads any rank's shards on any rank (the layout may change). A directory on
node-local disks therefore cannot hold a checkpoint: node 1's shards would land on node 1's disk beside
no index, and node 1 could not read rank 0's files back. A path does not say whether it is shared, so
the three moments where the difference shows check it, each inside a gather the step already makes or
right after one, and raise the same error on every rank before any rank could wait for another:

* **fit start** (``check_directories_agree``): every rank lists its ``ModelCheckpoint`` directories.
  Listings that differ between nodes would make ``ckpt_path="last"`` resolve to a checkpoint on one node
  and to none on another; the ranks that load would then wait for ever for the ones that do not.
* **save** (``check_shards_here``): before the rename, rank 0 finds every shard file the index lists; a
  rank whose files are not there wrote them to another disk. Nothing is renamed into place.
* **load** (``check_visible_everywhere``): every rank sees the checkpoint, or none goes on.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Optional, Sequence

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from lightning_megatron.checkpoint.replacement import exists, partial_path, replaced_path
from lightning_megatron.parallel.agree import all_gather_objects

CHECKPOINT_SUFFIX = ".ckpt"  # ModelCheckpoint.FILE_EXTENSION
_SHARD_RANK = re.compile(r"__(\d+)_\d+\.distcp")
FIX = ("Sharded checkpoints need one directory that every node sees (a shared filesystem: NFS, Lustre, GPFS, "
       "...): point ModelCheckpoint(dirpath=...) / the checkpoint path there.")


def where() -> str:
    """This process's node, for an error message: its node rank as the launcher set it, and its host."""
    node = next((os.environ[name] for name in ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID") if name in os.environ), "?")
    return f"node {node} ({socket.gethostname()})"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _ranks_at(places: Sequence[str], ranks: Sequence[int]) -> str:
    """``"ranks 2, 3 (node 1 (host))"``: the ranks grouped by where they run."""
    by_place: dict[str, list[int]] = {}
    for rank in ranks:
        by_place.setdefault(places[rank], []).append(rank)
    return "; ".join(f"rank{'s' if len(group) > 1 else ''} {', '.join(map(str, group))} ({place})"
                     for place, group in by_place.items())


def _listing(directory: Path) -> Optional[list[str]]:
    """The checkpoints in ``directory`` (Lightning's ``.ckpt`` names, what ``ckpt_path="last"`` chooses from;
    other files, a logger's say, may differ between ranks), or None without a directory."""
    if not directory.is_dir():
        return None
    return sorted(entry.name for entry in directory.iterdir() if entry.name.endswith(CHECKPOINT_SUFFIX))


def check_directories_agree(directories: Sequence[Path]) -> None:
    """Collective (one gather). Every rank must see the same checkpoints in its checkpoint directories;
    call it after the process group exists and before ``ckpt_path`` is loaded."""
    if not _distributed() or not directories:
        return
    dist.barrier()  # a later fit's start: the ranks' work of the previous one (removing old checkpoints) is done
    seen = all_gather_objects(([_listing(Path(d)) for d in directories], where()))
    places = [place for _, place in seen]
    for index, directory in enumerate(directories):
        views: dict[Optional[tuple], list[int]] = {}
        for rank, (listings, _) in enumerate(seen):
            listing = listings[index] if index < len(listings) else None
            views.setdefault(None if listing is None else tuple(listing), []).append(rank)
        if len(views) > 1:
            shown = "; ".join(f"{_ranks_at(places, ranks)} see{'s' if len(ranks) == 1 else ''} "
                              f"{'no directory' if view is None else list(view[:6]) or 'an empty directory'}"
                              for view, ranks in views.items())
            raise RuntimeError(f"The checkpoint directory {directory} holds different files on different ranks: "
                               f"{shown}. It is not shared by every node (a node-local disk?), so "
                               f"ckpt_path=\"last\" would resume some ranks and not others. {FIX}")


def check_shards_here(partial: Path, path: Path, places: Sequence[str]) -> None:
    """Rank 0, after every rank wrote its shards into ``partial`` (its own view of it): each shard file the
    index lists must be here, else the ranks that wrote it saved to a directory rank 0 does not see."""
    index = FileSystemReader(partial).read_metadata()
    files = sorted({item.relative_path for item in (index.storage_data or {}).values()})
    missing = [name for name in files if not (partial / name).is_file()]
    if not missing:
        return
    ranks = sorted({int(match.group(1)) for name in missing if (match := _SHARD_RANK.fullmatch(name))})
    raise RuntimeError(
        f"Saving checkpoint {path}: the shards of {_ranks_at(places, ranks)} are not in {partial} as rank 0 "
        f"({places[0]}) sees it ({len(missing)} of {len(files)} files missing, e.g. {missing[0]}). The directory "
        f"is not shared by every node (a node-local disk?); nothing was saved. What those ranks wrote is left in "
        f"their own {partial.name} (in a ModelCheckpoint directory, the next start removes it). {FIX}")


def check_visible_everywhere(path: Path) -> None:
    """Collective (one gather). Every rank sees checkpoint ``path`` (or what an interrupted save of it left),
    or every rank raises; when no rank sees it, the loader's own error says so."""
    if not _distributed():
        return
    path = Path(path)
    seen = all_gather_objects((any(exists(p) for p in (path, partial_path(path), replaced_path(path))), where()))
    places = [place for _, place in seen]
    blind = [rank for rank, (visible, _) in enumerate(seen) if not visible]
    if blind and len(blind) < len(seen):
        sighted = [rank for rank, (visible, _) in enumerate(seen) if visible]
        raise RuntimeError(f"Checkpoint {path} exists for {_ranks_at(places, sighted)} but not for "
                           f"{_ranks_at(places, blind)}: it is on a disk those ranks do not share. {FIX}")
