"""Full (consolidated) state dicts: global names, global unpadded shapes, any layout.

Saving gathers each tensor-parallel shard into its global tensor; loading cuts this
rank's shard back out. A checkpoint written at one tensor-parallel size therefore loads
at any other. Sharded checkpoints (``checkpoint.sharded``) never gather; these are for export and tests.

``Megatron3DStrategy(checkpoint_format="full")`` saves one such state dict as Lightning's
single checkpoint file (a ``torch.save`` archive), gathered onto global rank 0 alone
(:func:`gather_full_state_dict_on_rank_zero`: every other rank sends its own pieces, tensor by
tensor, and never holds more); ``open_full`` reads one in a single process, with
``weights_only=True`` and memory-mapped, for ``lightning-megatron checkpoint``.
"""

from __future__ import annotations

import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from lightning_megatron.parallel.shards import TensorShard, shard_of


def gather_shard(local: Tensor, shard: TensorShard, group: Optional[dist.ProcessGroup]) -> Tensor:
    """The global tensor (padding dropped) of a tensor-parallel shard, from every rank's ``local`` in ``group``
    (the tp group; ``None`` when the shard is not split): the ranks' segments put where they belong."""
    if group is None or shard.world == 1:
        return shard.assemble([local])
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return shard.assemble(parts)


def gather_full_state_dict(module: nn.Module, group: Optional[dist.ProcessGroup]) -> dict[str, Any]:
    """Every rank returns the full state dict on the CPU (a collective over ``group``, the tp group, and
    under ZeRO-3 over the dp group that shards the parameters' rows)."""
    full: dict[str, Any] = {}
    # Shard specs by name from the parameters themselves: FSDP's state-dict hooks may hand out other objects.
    shards = {name: shard_of(p) for name, p in module.named_parameters(remove_duplicate=False)}
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, Tensor):
            full[name] = value
            continue
        tensor = value.detach()
        tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # over dp: the tp shard
        shard = shards.get(name) or shard_of(value)
        if shard is not None:
            tensor = gather_shard(tensor, shard, group)
        full[name] = tensor.cpu().clone()
    return full


def merge_pipeline_stages(state: dict[str, Any], group: Optional[dist.ProcessGroup]) -> dict[str, Any]:
    """Each pipeline stage (or expert-parallel rank: its experts) holds some keys; every rank gets their union
    (a collective over ``group``)."""
    if group is None:
        return state
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, state, group=group)
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    return merged


@dataclass(frozen=True)
class _Piece:
    """What one rank holds of one state-dict entry: the tensor-parallel shard index ``tp`` and its ``shard``
    (``None``: not split) and, for a ZeRO-3 parameter (a DTensor sharded by rows over dp), the row chunk ``dp``
    (``None``: whole)."""

    tp: Optional[int]
    dp: Optional[int]
    shape: tuple[int, ...]
    dtype: torch.dtype
    shard: Optional[TensorShard]


def _pieces_held(module: nn.Module) -> dict[str, Any]:
    """This rank's entries: a :class:`_Piece` per tensor (shapes only, no data), the value itself otherwise."""
    shards = {name: shard_of(p) for name, p in module.named_parameters(remove_duplicate=False)}
    held: dict[str, Any] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, Tensor):
            held[name] = value
            continue
        shard = shards.get(name) or shard_of(value)  # also at tp1: a padded vocabulary's padding is dropped
        local, dp = _row_chunk(value)
        held[name] = _Piece(None if shard is None else shard.rank, dp, tuple(local.shape), local.dtype, shard)
    return held


def _row_chunk(value: Tensor) -> tuple[Tensor, Optional[int]]:
    """A ZeRO-3 DTensor's own row chunk and its index over dp (FSDP2's ``Shard(0)`` over a 1-D mesh), else the
    whole (tensor-parallel-local) tensor and ``None``; another DTensor layout is gathered here (a collective)."""
    if not isinstance(value, DTensor):
        return value.detach(), None
    if value.device_mesh.ndim == 1 and tuple(value.placements) == (Shard(0),):
        return value.detach().to_local(), value.device_mesh.get_local_rank()
    return value.detach().full_tensor(), None


def gather_full_state_dict_on_rank_zero(module: nn.Module, device: Union[torch.device, str]) -> dict[str, Any]:
    """The full state dict (global names, unpadded, on the CPU) on global rank 0 and ``{}`` on every other rank,
    over tp, pp, ep and ZeRO-3 at once; a collective of every rank of the default group.

    Rank 0 learns who holds what (shapes only: one ``gather_object`` of names, shapes and shard specs), picks
    one holder per piece (the lowest rank: dp and cp replicas send nothing; a pipeline-tied copy comes from the
    first stage that holds it) and tells everyone (one ``broadcast_object_list`` of the plan). Then, entry by
    entry in the plan's order, each chosen holder sends its own piece (its tensor-parallel shard, or its ZeRO-3
    row chunk of one) to rank 0, which assembles the tensor and moves it to the CPU. So a rank other than 0
    holds nothing beyond its own shards (``device``: where the pieces travel, the training device: NCCL
    sends only CUDA tensors), and no tensor is pickled. The values equal :func:`gather_full_state_dict` merged
    over the pipeline (and expert) stages, which every rank computes whole."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return gather_full_state_dict(module, None)
    rank, world = dist.get_rank(), dist.get_world_size()
    held = _pieces_held(module)
    manifests: Optional[list] = [None] * world if rank == 0 else None
    dist.gather_object(held, manifests, dst=0)
    plan: list = [_plan(manifests) if rank == 0 else None]
    dist.broadcast_object_list(plan, src=0)
    local = module.state_dict(keep_vars=True)
    full: dict[str, Any] = {}
    for name, senders in plan[0]:
        if not isinstance(senders, list):  # a value that is not a tensor: rank 0 has it from the manifests
            if rank == 0:
                full[name] = senders
            continue
        mine = _row_chunk(local[name])[0] if name in local else None
        if rank != 0:
            if mine is not None and mine.numel() and any(source == rank for source, _ in senders):
                dist.send(mine.contiguous().to(device), dst=0)
            continue
        parts = [(piece, mine if source == 0 else _receive(piece, source, device)) for source, piece in senders]
        tensor = _assemble(parts).cpu()
        full[name] = tensor.clone() if mine is not None and _shares_memory(tensor, mine) else tensor
    return full


def _plan(manifests: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """Per entry (in the order of the ranks' state dicts, rank by rank): ``[(source rank, piece), ...]`` with one
    source per distinct piece, or the value itself for an entry that is not a tensor."""
    order: dict[str, dict] = {}
    for source, manifest in enumerate(manifests):
        for name, entry in manifest.items():
            sources = order.setdefault(name, {})
            key = (entry.tp, entry.dp) if isinstance(entry, _Piece) else None
            sources.setdefault(key, (source, entry))  # the lowest rank holding that piece
    plan = []
    for name, sources in order.items():
        if None in sources:
            plan.append((name, sources[None][1]))
        else:
            plan.append((name, [sources[key] for key in sorted(sources, key=lambda k: (k[0] or 0, k[1] or 0))]))
    return plan


def _shares_memory(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` is (a view of) ``b``'s memory: rank 0's own whole parameter is copied, not aliased."""
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _receive(piece: _Piece, source: int, device: Union[torch.device, str]) -> Tensor:
    buffer = torch.empty(piece.shape, dtype=piece.dtype, device=device)
    if buffer.numel():
        dist.recv(buffer, src=source)
    return buffer


def _assemble(parts: list[tuple[_Piece, Tensor]]) -> Tensor:
    """One tensor from its pieces (sorted by tensor-parallel shard, then ZeRO-3 row chunk)."""
    by_shard: dict[Optional[int], list[Tensor]] = {}
    for piece, tensor in parts:
        by_shard.setdefault(piece.tp, []).append(tensor)
    shards = [torch.cat(chunks) if len(chunks) > 1 else chunks[0] for chunks in by_shard.values()]
    shard = parts[0][0].shard
    return shard.assemble(shards) if shard is not None else shards[0]


def local_state_dict_from_full(module: nn.Module, full: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's entries (its pipeline stage, its tensor-parallel shards) of a full state dict."""
    local: dict[str, Any] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if name not in full:
            continue  # load_state_dict(strict=True) reports it as missing
        shard = shard_of(value) if isinstance(value, Tensor) else None
        if shard is None:
            local[name] = full[name]
            continue
        saved = full[name]
        if tuple(saved.shape) != shard.global_shape:
            raise ValueError(
                f"Checkpoint tensor {name!r} has shape {tuple(saved.shape)} but the model expects the global shape "
                f"{shard.global_shape}. The checkpoint belongs to a model of another size."
            )
        local[name] = shard.local_slice(saved)
    return local


def full_optimizer_state_unusable(saved_layout: Mapping[str, Any], config: Any, *, has_main_params: bool) -> Optional[str]:
    """Why a full (single-file) checkpoint's optimizer state cannot be restored here, or None if it can.

    It holds rank 0's optimizer state only, which is every rank's only at tp=1 without ZeRO or fp32 main
    parameters, at saving and at loading."""
    sharded_now = config.tensor_parallel_size != 1 or config.zero_stage != 0 or has_main_params
    sharded_then = saved_layout.get("tensor_parallel_size", 1) != 1 or saved_layout.get("zero_stage", 0) != 0
    if not (sharded_now or sharded_then):
        return None
    return (f"Megatron3DStrategy: a full (single-file) checkpoint's optimizer state is not restored under tensor "
            f"parallelism or fp32 main parameters (saved tp={saved_layout.get('tensor_parallel_size', '?')}, "
            f"zero_stage={saved_layout.get('zero_stage', '?')}; now tp={config.tensor_parallel_size}, "
            f"zero_stage={config.zero_stage}); the weights and the trainer state are. The optimizer starts fresh. "
            f"Sharded checkpoints (checkpoint_format='sharded', the default) restore it at any layout.")


@dataclass
class FullCheckpoint:
    """A single-file checkpoint as ``torch.load(weights_only=True, mmap=True)`` reads it: Lightning's dict, its
    tensors memory-mapped (a tensor's bytes are read when it is used)."""

    path: Path
    checkpoint: dict[str, Any]

    def tensors(self) -> dict[str, Tensor]:
        """Its tensors under the keys a sharded checkpoint uses where the file knows them: ``state_dict/<name>``,
        and ``optimizer/<i>/<position>/<key>`` (the file numbers parameters by their position in the optimizer's
        param groups, as ``torch.optim.Optimizer.state_dict()`` does; it does not record their names)."""
        tensors = {f"state_dict/{name}": value for name, value in self.checkpoint["state_dict"].items()
                   if isinstance(value, Tensor)}
        for index, optimizer in enumerate(self.checkpoint.get("optimizer_states") or []):
            state = optimizer.get("state", {}) if isinstance(optimizer, Mapping) else {}
            for position, values in state.items():
                for key, value in (values.items() if isinstance(values, Mapping) else ()):
                    if isinstance(value, Tensor):
                        tensors[f"optimizer/{index}/{position}/{key}"] = value
        return tensors

    def trainer_state(self) -> dict[str, Any]:
        """Everything but the model weights (hyper-parameters, loops, optimizer state, ...)."""
        return {key: value for key, value in self.checkpoint.items() if key != "state_dict"}


def open_full(path: Union[str, Path]) -> FullCheckpoint:
    """Read a ``checkpoint_format="full"`` file in one process, never unpickling anything but tensors and plain
    containers. Raises ``RuntimeError`` naming the file and what is wrong with it."""
    path = Path(path)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RuntimeError(
            f"{path} holds pickled objects other than tensors and plain Python values, and lightning-megatron never "
            f"unpickles those (torch.load(weights_only=True) refused: {reason}). Checkpoints that Megatron3DStrategy "
            f"saves hold none; if you trust this file, load it with torch.load(weights_only=False) yourself and save "
            f"its tensors again.") from error
    except Exception as error:
        raise RuntimeError(f"Could not read {path}: {error}. The file is damaged or truncated; use another "
                           f"checkpoint.") from error
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), Mapping):
        keys = sorted(map(str, checkpoint))[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise RuntimeError(f"{path} is a torch.save file but not a Lightning checkpoint: it holds no 'state_dict' "
                           f"(it holds {keys}). Pass a checkpoint that Trainer.save_checkpoint or ModelCheckpoint "
                           f"wrote.")
    return FullCheckpoint(path, checkpoint)


def verify_full(path: Union[str, Path]) -> tuple[int, int]:
    """Compare every record of a full checkpoint (a zip archive) with the CRC-32 the archive recorded for it;
    returns (records, bytes). A full checkpoint records no checksums of its own: the archive's are what there is."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
            records = len(archive.infolist())
    except (OSError, zipfile.BadZipFile) as error:
        raise RuntimeError(f"Could not read {path} as a torch.save archive: {error}. The file is damaged or "
                           f"truncated; use another checkpoint.") from error
    if damaged is not None:
        raise RuntimeError(f"Checkpoint file {path} is damaged: the CRC-32 of its record {damaged!r} does not match "
                           f"the one the archive recorded. Copy the checkpoint again or use another one.")
    return records, path.stat().st_size
