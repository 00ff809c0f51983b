"""Index arrays cached on disk, built by one rank and read by every other.

A cache entry is a directory named by a hash of everything the arrays depend on (its
*key*). It holds one ``.npy`` file per array and ``manifest.json``, written last, with the
key itself and each file's size and CRC-32. An entry is used only when its manifest
matches the key and every file its size and checksum; anything else (a stale entry, a
truncated or damaged file, a leftover of a crashed build) is rebuilt, never trusted. A
build writes into a temporary directory that is renamed into place, so a reader never sees
half an entry and two builders racing on a shared file system both leave a whole one.

Who builds: global rank 0 first, while the others wait at a barrier; then, for a cache
directory that is not shared between nodes, the first rank of every node that still finds
no valid entry; then every rank opens the files (read where indexed, never mapped: ``data/file_array.py``). No rank builds while another reads.
The builders verify every checksum; the other ranks, after them, the manifest and the sizes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from lightning_megatron.checksums import file_crc32
from lightning_megatron.data.file_array import FileArray
from lightning_megatron.parallel.agree import PeerFailed



def say(message: str) -> None:
    """Index builds are rare and take time: said on stderr by the rank doing them, whatever the log level."""
    print(f"lightning-megatron: {message}", file=sys.stderr, flush=True)

MANIFEST = "manifest.json"


@dataclass
class Ranks:
    """Where this process sits, and how to wait for the others: ``all_ok(ok)`` is a barrier that also tells
    every rank whether every rank succeeded (a build that fails on one rank must not leave the others
    waiting until the process group times out). One process: rank 0, nothing to wait for."""

    global_rank: int = 0
    local_rank: int = 0
    all_ok: Callable[[bool], bool] = field(default=lambda ok: ok)

    @classmethod
    def of_trainer(cls, trainer: Any) -> "Ranks":
        import torch.distributed as dist

        if getattr(trainer, "world_size", 1) == 1 or not dist.is_initialized():
            return cls()
        device = trainer.strategy.root_device

        def all_ok(ok: bool) -> bool:
            flag = torch.tensor([int(ok)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            return bool(flag.item())

        return cls(trainer.global_rank, trainer.local_rank, all_ok)


def key_digest(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def _entry_problem(entry: Path, key: Mapping[str, Any], *, checksums: bool = True) -> Optional[str]:
    """Why the entry cannot be used, or ``None`` when it is whole and belongs to ``key``. Without ``checksums``
    only the manifest and the file sizes are checked: what a rank that did not build checks after a rank that
    did has read every byte."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest" if entry.exists() else None
    except (OSError, ValueError) as error:
        return f"unreadable manifest ({error})"
    if manifest.get("key") != json.loads(json.dumps(key)):
        return "built for other data or settings"
    for name, expected in manifest.get("files", {}).items():
        path = entry / f"{name}.npy"
        if not path.is_file():
            return f"{path.name} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{path.name} is {path.stat().st_size} bytes, not {expected['bytes']}"
        if checksums and file_crc32(path) != expected["crc32"]:
            return f"{path.name} fails its checksum"
    return None


def _is_valid(entry: Path, key: Mapping[str, Any]) -> bool:
    return (entry / MANIFEST).is_file() and _entry_problem(entry, key) is None


def _write_entry(entry: Path, key: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    files = {}
    for name, array in arrays.items():
        path = tmp / f"{name}.npy"
        np.save(path, np.ascontiguousarray(array))
        files[name] = {"bytes": path.stat().st_size, "crc32": file_crc32(path)}
    (tmp / MANIFEST).write_text(json.dumps({"key": key, "files": files}, indent=1, sort_keys=True) + "\n")
    if entry.exists():  # damaged or stale: replaced whole
        shutil.rmtree(entry, ignore_errors=True)
    try:
        os.replace(tmp, entry)
    except OSError:  # another node's builder renamed a whole entry first
        shutil.rmtree(tmp, ignore_errors=True)
        if not _is_valid(entry, key):
            raise


def build_once(ranks: Ranks, *, needs_build: Callable[[], bool], build: Callable[[], None], what: str,
               where: str) -> None:
    """Run ``build`` on global rank 0 while the others wait, then on the first rank of any node that still
    ``needs_build`` (a cache directory that is not shared between nodes). A build that fails on one rank
    raises there and a ``RuntimeError`` on every other one, instead of a hang."""

    def phase(builds: bool, who: str) -> None:
        error = None
        if builds:
            try:
                build()
            except Exception as raised:  # every rank hears of it, then the builder raises it
                error = raised
        if not ranks.all_ok(error is None):
            if error is not None:
                raise error
            raise PeerFailed(f"Building the {what} in {where} failed on {who}; its error says why.")

    phase(ranks.global_rank == 0, "rank 0")
    phase(ranks.local_rank == 0 and ranks.global_rank != 0 and needs_build(), "the first rank of another node")


@dataclass
class CachedArrays:
    arrays: dict[str, FileArray]
    directory: Path
    built_here: bool  # this process built the entry (tests count builds across ranks)
    build_seconds: float = 0.0


def load_or_build(
    cache_dir: str | os.PathLike,
    key: Mapping[str, Any],
    build: Callable[[], Mapping[str, np.ndarray]],
    *,
    ranks: Ranks,
    what: str,
) -> CachedArrays:
    """The arrays of ``key``: read from ``cache_dir`` when a valid entry is there, else built by one rank (see
    the module docstring) and written first. ``what`` names the arrays in the log."""
    entry = Path(cache_dir) / key_digest(key)
    built_here, seconds = False, 0.0

    def build_if_needed() -> None:
        nonlocal built_here, seconds
        problem = _entry_problem(entry, key)
        if problem is None and entry.exists():
            return
        if problem is not None:
            say(f"the cached {what} index {entry} is not usable ({problem}); rebuilding it")
        start = time.perf_counter()
        arrays = build()
        try:
            _write_entry(entry, key, arrays)
        except OSError as error:
            raise OSError(error.errno, f"Cannot write the {what} index to {cache_dir} ({error.strerror or error}); "
                          f"give the data module an index_cache_dir= that is writable and seen by every rank of a "
                          f"node, or set LIGHTNING_MEGATRON_CACHE", str(entry)) from error
        seconds, built_here = time.perf_counter() - start, True
        say(f"built the {what} index in {seconds:.2f} s: {entry}")

    build_once(ranks, needs_build=lambda: not _is_valid(entry, key), build=build_if_needed, what=what,
               where=str(cache_dir))
    problem = _entry_problem(entry, key, checksums=False)
    if problem is not None or not entry.exists():
        raise RuntimeError(f"The {what} index at {entry} is not usable after it was built: {problem or 'missing'}; "
                           f"is {cache_dir} writable and on a file system every rank of a node sees?")
    manifest = json.loads((entry / MANIFEST).read_text())
    arrays = {name: FileArray.of_npy(entry / f"{name}.npy") for name in manifest["files"]}
    return CachedArrays(arrays, entry, built_here, seconds)
