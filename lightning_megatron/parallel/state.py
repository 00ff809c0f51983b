"""Process groups of one parallel layout, built from a DeviceMesh ("pp", "dp", "cp", "tp").

A ``ParallelState`` is an ordinary object handed to whatever needs a group, not a
module-level global as in Megatron-LM: several layouts can then live side by side in
one set of processes (which is how the tests sweep layouts without relaunching).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_megatron.parallel.config import ParallelConfig

MESH_DIM_NAMES = ("pp", "dp", "cp", "tp")
#: The flattened ("dp", "cp") dimension: the ranks that hold the same weight shards.
REPLICA_DIM = "dp_cp"


@dataclass
class ParallelState:
    """The layout, the mesh, and this process's coordinates in it.

    With a single process and no initialised default group, ``mesh`` and the groups are
    ``None`` and every collective in the package becomes a no-op.
    """

    config: ParallelConfig
    device: torch.device
    mesh: Optional[DeviceMesh] = None
    model_parallel_group: Optional[dist.ProcessGroup] = None
    embedding_group: Optional[dist.ProcessGroup] = None
    expert_parallel_group: Optional[dist.ProcessGroup] = None
    expert_data_parallel_group: Optional[dist.ProcessGroup] = None
    replica_mesh: Optional[DeviceMesh] = None
    expert_data_mesh: Optional[DeviceMesh] = None
    timeout: Optional[timedelta] = None
    _subgroups: dict[int, Optional[dist.ProcessGroup]] = field(default_factory=dict, repr=False)

    @classmethod
    def create(cls, config: ParallelConfig, device: torch.device | str,
               timeout: Optional[timedelta] = None) -> "ParallelState":
        """``timeout``: for every group of the layout (``new_group`` and the DeviceMesh otherwise give
        torch's default, 30 minutes on gloo, whatever ``init_process_group`` was given)."""
        device = torch.device(device)
        if not dist.is_available() or not dist.is_initialized():
            if config.world_size != 1:
                raise RuntimeError(
                    f"The layout needs {config.world_size} processes but torch.distributed is not initialised. "
                    f"Launch with torchrun or Lightning's Trainer(devices=...)."
                )
            return cls(config=config, device=device)
        if dist.get_world_size() != config.world_size:
            raise ValueError(
                f"The layout tp={config.tensor_parallel_size} x cp={config.context_parallel_size} x "
                f"pp={config.pipeline_parallel_size} x dp={config.data_parallel_size} needs {config.world_size} "
                f"processes, but the world has {dist.get_world_size()}. Change the sizes or the number of processes."
            )
        shape = (config.pipeline_parallel_size, config.data_parallel_size, config.context_parallel_size,
                 config.tensor_parallel_size)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIM_NAMES)
        replica_mesh = mesh["dp", "cp"]._flatten(REPLICA_DIM)  # kept: slicing a flattened dim from the root is deprecated
        model_parallel_group, embedding_group = _model_parallel_and_embedding_groups(config)
        expert_group, expert_data_group = _expert_groups(config, replica_mesh.get_group())
        expert_data_mesh = _expert_data_mesh(config, mesh)
        if timeout is not None:
            groups = [mesh.get_group(dim) for dim in MESH_DIM_NAMES] + [replica_mesh.get_group(), model_parallel_group,
                                                                        embedding_group, expert_group, expert_data_group]
            groups += [expert_data_mesh.get_group()] if expert_data_mesh is not None else []
            for group in {id(g): g for g in groups if g is not None}.values():
                dist.distributed_c10d._set_pg_timeout(timeout, group)  # gloo and NCCL (set_timeout: gloo only)
        return cls(config=config, device=device, mesh=mesh, model_parallel_group=model_parallel_group,
                   embedding_group=embedding_group, expert_parallel_group=expert_group,
                   expert_data_parallel_group=expert_data_group, replica_mesh=replica_mesh,
                   expert_data_mesh=expert_data_mesh, timeout=timeout)

    def tensor_parallel_subgroup(self, size: int) -> Optional[dist.ProcessGroup]:
        """This rank's group of ``size`` consecutive tp ranks (tp ranks ``k * size`` to ``(k + 1) * size - 1``),
        where a segmented shard replicates a range (``tensor_parallel.styles.QueryGroupColumn``'s key/value
        heads); ``None`` for a group of one. ``size == tp`` is the tp group itself.

        Collective the first time a size is asked for: every rank of the world creates every such group
        of every (pp, dp, cp) coordinate, in the same order, with the layout's timeout; cached afterwards.
        """
        tp = self.config.tensor_parallel_size
        if size < 1 or tp % size:
            raise ValueError(f"A tensor-parallel subgroup of {size} ranks does not tile tensor_parallel_size={tp}: "
                             f"its size must divide {tp}.")
        if size == tp:
            return self.tensor_parallel_group
        if self.mesh is None or size == 1:
            return None
        if size not in self._subgroups:
            config, rank = self.config, dist.get_rank()
            for p in range(config.pipeline_parallel_size):
                for d in range(config.data_parallel_size):
                    for c in range(config.context_parallel_size):
                        for first in range(0, tp, size):
                            ranks = [config.rank_of(pipeline_rank=p, data_rank=d, context_rank=c, tensor_rank=t)
                                     for t in range(first, first + size)]
                            group = dist.new_group(ranks, timeout=self.timeout)
                            if rank in ranks:
                                self._subgroups[size] = group
        return self._subgroups[size]

    def group(self, dim: str) -> Optional[dist.ProcessGroup]:
        """The process group along one mesh dimension, or ``None`` when it has a single member."""
        if self.mesh is None or self.mesh[dim].size() == 1:
            return None
        return self.mesh.get_group(dim)

    @property
    def is_first_pipeline_stage_rank(self) -> bool:
        return self.pipeline_parallel_rank == 0

    @property
    def tensor_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self.group("tp")

    @property
    def data_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self.group("dp")

    @property
    def pipeline_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self.group("pp")

    @property
    def context_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks that split one sample's sequence (the ring of ring attention)."""
        return self.group("cp")

    @property
    def replica_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks that hold the same weight shards, ``dp x cp``: gradients are summed and ZeRO shards over it,
        and metrics are averaged over it (each of its ranks saw different tokens). ``None`` for one rank."""
        if self.replica_mesh is None or self.replica_mesh.size() == 1:
            return None
        return self.replica_mesh.get_group()

    @property
    def replica_rank(self) -> int:
        """This rank's index in :attr:`replica_group`: ``dp_rank * cp + cp_rank``."""
        return self.data_parallel_rank * self.config.context_parallel_size + self.context_parallel_rank

    @property
    def context_parallel_rank(self) -> int:
        return self._local_rank("cp")

    def _local_rank(self, dim: str) -> int:
        return 0 if self.mesh is None else self.mesh.get_local_rank(dim)

    @property
    def tensor_parallel_rank(self) -> int:
        return self._local_rank("tp")

    @property
    def expert_slot(self) -> int:
        """This rank's :meth:`ParallelConfig.expert_slot`: its data-parallel rank (with ``expert_tensor_parallel_size
        = 1``: its tp and dp ranks together)."""
        return self.config.expert_slot(self.data_parallel_rank, self.tensor_parallel_rank)

    @property
    def expert_parallel_rank(self) -> int:
        """Which ``1/ep`` of the experts this rank holds: slot ``j`` is expert-parallel rank ``j % ep``."""
        return self.expert_slot % self.config.expert_parallel_size

    @property
    def expert_data_parallel_rank(self) -> int:
        return self.expert_slot // self.config.expert_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        return self._local_rank("dp")

    @property
    def pipeline_parallel_rank(self) -> int:
        return self._local_rank("pp")


def _expert_groups(config: ParallelConfig, replica_group: Optional[dist.ProcessGroup]):
    """The expert-parallel group (``ep`` consecutive expert slots, ``ParallelConfig.expert_slot``: they exchange
    tokens, each holding ``1/ep`` of the experts) and the expert-data-parallel group (the slots holding the same
    experts: they sum the experts' gradients), for this rank; ``None`` for a group of one. The slots are the dp
    ranks of one (pp, tp) coordinate, or with ``expert_tensor_parallel_size=1`` the tp x dp ranks of one pipeline
    stage. Every rank creates every group, in the same order."""
    ep, edp = config.expert_parallel_size, config.expert_data_parallel_size
    folded = config.whole_experts
    if ep == 1:
        return None, replica_group
    if edp == 1 and not folded:  # (expert parallelism runs without context parallelism: the replicas are the dp ranks)
        return replica_group, None
    rank = dist.get_rank()
    expert_group = expert_data_group = None
    etp, tp, dp = config.expert_tensor_parallel, config.tensor_parallel_size, config.data_parallel_size
    for p in range(config.pipeline_parallel_size):
        for t0 in range(etp):  # the tp position inside an expert's split: its slots run over the other coordinates
            slots = [config.rank_of(pipeline_rank=p, data_rank=d, tensor_rank=t) for d in range(dp)
                     for t in range(t0, tp, etp)]
            for first in range(0, len(slots), ep):
                group = dist.new_group(slots[first:first + ep])
                if rank in slots[first:first + ep]:
                    expert_group = group
            if edp > 1:
                for offset in range(ep):
                    group = dist.new_group(slots[offset::ep])
                    if rank in slots[offset::ep]:
                        expert_data_group = group
    return expert_group, expert_data_group


def _expert_data_mesh(config: ParallelConfig, mesh: DeviceMesh) -> Optional[DeviceMesh]:
    """The 1-D mesh of this rank's expert-data-parallel group (``slots / ep`` ranks, possibly one), over which ZeRO-3
    shards the experts (``optim.zero3``); only for ZeRO-3 with expert parallelism (other layouts use the groups).
    The expert slots (dp, or dp x tp with whole experts) unflattened into ("edp", "ep"): slot ``j`` is
    ``(j // ep, j % ep)``, as :func:`_expert_groups`."""
    ep = config.expert_parallel_size
    if ep == 1 or config.zero_stage != 3:
        return None
    if config.whole_experts:  # the slots run over dp and tp (cp is 1 with ep)
        slots = mesh["dp", "cp", "tp"]._flatten("expert_slots")
        return slots._unflatten(0, (config.expert_data_parallel_size, ep), ("edp", "ep"))["edp"]
    return mesh._unflatten("dp", (config.expert_data_parallel_size, ep), ("edp", "ep"))["edp"]


def _model_parallel_and_embedding_groups(config: ParallelConfig):
    """Groups that are not mesh dimensions; every rank creates every group, in the same order.

    The model-parallel group (all tp x pp ranks of one replica, one (dp, cp) coordinate) sums squared
    gradient norms; the embedding group (first and last pipeline stage of one (dp, cp, tp) coordinate)
    sums the gradients of the embedding tied across them.
    """
    tp, pp, dp, cp = (config.tensor_parallel_size, config.pipeline_parallel_size, config.data_parallel_size,
                      config.context_parallel_size)
    rank = dist.get_rank()
    model_parallel_group = embedding_group = None
    replicas = [(d, c) for d in range(dp) for c in range(cp)]
    if tp * pp > 1:  # a replica of one rank needs no group (and every extra group is one more to tear down)
        for d, c in replicas:
            ranks = [config.rank_of(pipeline_rank=p, data_rank=d, context_rank=c, tensor_rank=t)
                     for p in range(pp) for t in range(tp)]
            group = dist.new_group(ranks)
            if rank in ranks:
                model_parallel_group = group
    if pp > 1:
        for d, c in replicas:
            for t in range(tp):
                ranks = [config.rank_of(pipeline_rank=p, data_rank=d, context_rank=c, tensor_rank=t) for p in (0, pp - 1)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    embedding_group = group
    return model_parallel_group, embedding_group
